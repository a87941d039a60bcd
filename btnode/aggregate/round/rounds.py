"""One block's round (design §3.3): which updates count toward version v+1, and when it closes.

A round opens when version v is published. An update based on v (or, with a staleness bound s,
on v−s … v−1, weighted down) is accepted while the round is open. One based on the version
just before the oldest accepted one is LATE: its round closed before it arrived. Anything older
is STALE. The round closes at its deadline once `min_updates` are accepted, or earlier once every
registered replica has reported and at least one update was accepted. With none accepted it
stays open, and its clock starts again when the deadline passes (BlockAggregator.tick): a block
never publishes a version nobody trained, and replicas that were all away get a full τ together.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from btnode.codec.codecs import Codec
from btnode.codec.sparse import SparseTensor
from btnode.errors import ConfigError, MalformedInput, StaleUpdate
from btnode.protocol import Judgement, ManifestEntry, Outcome
from btnode.settings import flag


@dataclass(frozen=True)
class RoundConfig:
    deadline_s: float = flag("--deadline", "τ: seconds a round stays open before it may close.", default=30.0)
    min_updates: int = flag("--min-updates", "Accepted updates needed to close at the deadline.", default=1)
    max_staleness: int = flag("--max-staleness", "Accept updates this many versions old (weighted down).", default=0)
    staleness_decay: float = 0.5  # weight factor per version of staleness

    def __post_init__(self) -> None:
        if self.deadline_s <= 0 or self.min_updates < 1 or self.max_staleness < 0 or not 0 < self.staleness_decay <= 1:
            raise ConfigError(f"invalid round settings: {self}")


@dataclass
class Update:
    worker_id: str
    update_id: str
    base_version: int
    samples: float
    loss: float
    delta: dict[str, torch.Tensor | SparseTensor] | None  # sparse codecs' updates stay sparse (aggregate/sums/accumulate.py);
    #   None once summed into the round (BlockAggregator._take), when its raw bytes went to the round's spill
    weight: float  # in the round's sum: its work times its sender's standing (aggregate/trust/standing.py), and at
    #   close its vote (round/screen.py: near-copies share one); 0: in the round, not in the sum
    norm: float = 0.0  # ‖Δ‖ as it arrived (before any clipping)
    scale: float = 1.0  # the factor --clip applied before summing
    codec: Codec = Codec.FP32  # of `raw` / the spilled bytes
    raw: dict[str, bytes] | None = None  # its codec bytes, until they are spilled
    spilled: dict[str, tuple[int, int]] | None = None  # where its bytes are in the round's spill
    sketch: torch.Tensor | None = None  # what the screen keeps of it (accumulate.Sketcher)
    manifest: tuple[ManifestEntry, ...] = ()  # a relay's combined update: the child updates in it
    work: float = 0.0  # samples × staleness factor, what its claims earn (its weight before standing); 0: its weight
    standing: float = 1.0  # its sender's standing when it entered the round (aggregate/trust/standing.py)

    def __post_init__(self) -> None:
        self.work = self.work or self.weight

    @property
    def included(self) -> tuple[str, ...]:
        """The update ids this update puts into a version: its children's, or its own."""
        return tuple(e.update_id for e in self.manifest) or (self.update_id,)


@dataclass
class Round:
    version: int
    opened_at: float
    cfg: RoundConfig
    accepted: dict[str, Update] = field(default_factory=dict)  # by worker id
    reported: set[str] = field(default_factory=set)
    counts: Counter = field(default_factory=Counter)

    def judge(self, worker_id: str, base_version: int, *, replacing: bool = False) -> tuple[Outcome, float, str]:
        """(outcome, staleness weight factor, reason) for an update's timing, before its content.
        `replacing`: a relay's amended combined update, which takes the place of its accepted one."""
        v, s = self.version, self.cfg.max_staleness
        if base_version > v:
            raise MalformedInput("future_version", f"base version {base_version} is ahead of the current version {v}")
        if worker_id in self.accepted and not replacing:
            raise MalformedInput("duplicate", f"worker {worker_id!r} already has an accepted update in round {v}")
        if base_version >= v - s:
            return Outcome.PENDING, self.cfg.staleness_decay ** (v - base_version), ""
        if base_version == v - s - 1:
            return Outcome.LATE, 0.0, (f"round {base_version} closed before this update arrived; "
                                       f"the block is at version {v}")
        raise StaleUpdate("stale", f"base version {base_version} is older than the staleness bound allows "
                                   f"(current {v}, max staleness {s})")

    def add(self, update: Update) -> None:
        self.accepted[update.worker_id] = update
        self.reported.add(update.worker_id)
        self.reported.update(e.worker_id for e in update.manifest)  # a relay reports for its children
        self.counts[Outcome.PENDING] += 1

    def note(self, worker_id: str, outcome: Outcome, base_version: int) -> None:
        """Record a non-accepted report (late, stale, rejected). Only a report based on this
        round's version means the replica is done with this round; a late one is still coming."""
        if base_version == self.version:
            self.reported.add(worker_id)
        self.counts[outcome] += 1

    def close_reason(self, now: float, registered: set[str]) -> str | None:
        if not self.accepted:
            return None
        if now >= self.opened_at + self.cfg.deadline_s and len(self.accepted) >= self.cfg.min_updates:
            return "deadline"
        if registered and registered <= self.reported:
            return "all_reported"
        return None

    def deadline(self) -> float:
        return self.opened_at + self.cfg.deadline_s

    def judgement(self, outcome: Outcome, reason: str = "") -> Judgement:
        return Judgement(outcome=outcome, reason=reason, round_version=self.version)
