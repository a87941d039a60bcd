"""`Standing`: how much an identity's updates weigh in a round, from the work the swarm has verified of
it (replay audits passed, aggregate/trust/audit.py) and its recent drops at close (the robust screen,
aggregate/round/screen.py). docs/security.md, "Standing and the Sybil bound"."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from btnode.aggregate.trust.audit import Audits
from btnode.errors import ConfigError
from btnode.settings import flag

log = logging.getLogger(__name__)
UNWEIGHTED = "standing_at_close"  # the screen's reason for a kept update that weighs nothing: not a drop of its own


@dataclass(frozen=True)
class StandingConfig:
    full_at: int = flag("--full-standing", "With --audit: audits an identity must pass before its updates weigh in "
                                           "full; its weight grows in proportion until then (0 while on probation). "
                                           "docs/security.md.", default=8)
    drop_window: int = 8  # an identity's last rounds at close whose drops count against it
    drop_limit: int = 2  # drops within the window that put it back on probation: every update audited, held till then
    copy_cosine: float = 0.99  # sketches this aligned are near-copies and share one vote (honest pairs: ≤ 0.965 in the sim)

    def __post_init__(self) -> None:
        if self.full_at < 1 or self.drop_window < 1 or not 1 <= self.drop_limit <= self.drop_window \
                or not 0 < self.copy_cosine <= 1:
            raise ConfigError(f"invalid standing settings: {self}")


class Standing:
    """Per identity, a weight factor in [0, 1] that multiplies its updates' work (len(steps) × batch ×
    staleness factor) in the round's mean and in the screen's reference. Thread-safe: every block reads
    it and reports its closes to it.

    With audits: 0 while the identity is on probation (fewer than `probation` audits passed since it
    last joined fresh or was sent back), then (audits passed, all told) / `full_at`, at most 1. Without
    audits nothing is verified, and every identity starts at 1. Either way, halved for each drop at
    close in its last `drop_window` rounds; `drop_limit` of them send it back to probation
    (`Audits.force`), so that its updates are replayed before they count again."""

    def __init__(self, cfg: StandingConfig, audits: Audits | None, *, probation: int = 0):
        self.cfg, self.audits, self.probation = cfg, audits, probation
        self.lock = threading.Lock()
        self.recent: dict[str, deque[bool]] = {}  # identity → was it dropped, in each of its last rounds at close

    def verified(self, worker_id: str) -> float:
        """The share of full standing its verified work earns."""
        if self.audits is None:
            return 1.0
        passed, total = self.audits.passed(worker_id)
        return 0.0 if passed < self.probation else min(1.0, total / self.cfg.full_at)

    def drops(self, worker_id: str) -> int:
        with self.lock:
            return sum(self.recent.get(worker_id, ()))

    def factor(self, worker_id: str) -> float:
        return self.verified(worker_id) * 0.5 ** self.drops(worker_id)

    def closed(self, kept: Iterable[str], dropped: Iterable[tuple[str, str]]) -> list[str]:
        """A round closed with updates of `kept` applied and `dropped` (identity, reason) dropped. Returns the
        identities this sends back to probation."""
        sent_back = []
        with self.lock:
            for wid, was_dropped in [*((k, False) for k in kept), *((d, True) for d, why in dropped if why != UNWEIGHTED)]:
                seen = self.recent.setdefault(wid, deque(maxlen=self.cfg.drop_window))
                seen.append(was_dropped)
                if was_dropped and sum(seen) >= self.cfg.drop_limit and self.audits is not None:
                    seen.clear()  # its next updates are replayed: they decide afresh
                    sent_back.append(wid)
        for wid in sent_back:
            self.audits.force(wid)  # type: ignore[union-attr]
            log.warning("%s was dropped at close %d times in its last %d rounds: on probation again (every update "
                        "audited before it counts)", wid, self.cfg.drop_limit, self.cfg.drop_window)
        return sent_back
