"""`Repairs`: a root block's last closed rounds, kept so that what a revoked identity added can be taken
back (docs/security.md, "Repair"). A failed audit is evidence that the rounds its sender pushed to were
attacked: each such round is screened again without the revoked ids (so honest updates the screen
dropped because of them come back) and its mean made again from the round's spill (the sum is exact
fixed point, aggregate/sums/accumulate.py: a removed update comes out bit for bit). The outer steps
from the first repaired round on are taken again from the momentum they started from, and the next
published version adds Σ (step' − step): with plain averaging θ_next = θ_now + η Σ_r (mean'_r − mean_r);
with Nesterov momentum the buffers are the ones the repaired rounds would have left, so later steps
carry no echo of the attack either."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from btnode.aggregate.round.rounds import Update
from btnode.aggregate.round.screen import screen
from btnode.aggregate.round.tally import Tally
from btnode.aggregate.sums.averaging import OuterOptimizer

if TYPE_CHECKING:
    from btnode.aggregate.round.config import AggregatorConfig

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]


@dataclass
class ClosedRound:
    version: int  # the version its updates were based on; it made version + 1
    tally: Tally  # its spill (kept open while the round is kept) and sums
    kept: list[Update]  # what the published versions apply of it (after a repair: the repaired set)
    dropped: list[Update]  # what the screen dropped of it
    buffers: Tensors  # the outer momentum before its step ({} without momentum)
    base: Mapping[str, torch.Tensor] | None = None  # θ^version, which its updates started from (a later audit
    #   replays against it: aggregate/replays.py); None where θ lives in its version file (which may be gone)

    def senders(self) -> set[str]:
        return {u.worker_id for u in (*self.kept, *self.dropped)}


@dataclass
class Repair:
    """What one repair changed: the step the next version adds, the momentum it leaves, the rounds
    (by base version) it made again, the updates it took out and those it put back."""

    correction: Tensors
    buffers: Tensors
    rounds: list[int] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)  # worker ids taken out (of kept or dropped)
    restored: list[str] = field(default_factory=list)  # worker ids the screen had dropped, kept now
    others: set[str] = field(default_factory=set)  # every other sender of the repaired rounds


class Repairs:
    """The last `window` closed rounds of one block; the block's lock guards it."""

    def __init__(self, window: int, spec: Mapping[str, tuple[int, ...]], cfg: AggregatorConfig, label: str):
        self.spec, self.cfg, self.label = spec, cfg, label
        self.rounds: deque[ClosedRound] = deque()
        self.window = window
        self.count = 0  # repairs made

    def keep(self, r: ClosedRound) -> None:
        self.rounds.append(r)
        while len(self.rounds) > self.window:
            self.rounds.popleft().tally.spill.close()

    def close(self) -> None:
        while self.rounds:
            self.rounds.popleft().tally.spill.close()

    def mean(self, r: ClosedRound, ups: list[Update]) -> Tensors:
        """The round's combined delta over `ups` (zero for none), from its spill: exactly what its close
        computed for the same updates."""
        if not ups:
            return {n: torch.zeros(s) for n, s in self.spec.items()}
        r.tally.rebuild(ups)
        mean_of, _ = r.tally.combiner(ups, release=True)
        out = {n: mean_of(n) for n in self.spec}
        r.tally.sum = r.tally._accumulator()  # nothing held between repairs
        return out

    def repair(self, revoked: Callable[[str], bool], outer_buffers: Tensors) -> Repair | None:
        """Take every revoked sender out of the kept rounds; None when none of them is in any.
        `outer_buffers`: the block's momentum now (the end of the kept rounds' chain)."""
        first = next((i for i, r in enumerate(self.rounds) if any(revoked(w) for w in r.senders())), None)
        if first is None:
            return None
        old_outer, new_outer = OuterOptimizer(self.cfg.outer), OuterOptimizer(self.cfg.outer)
        old_outer.load_state_dict(self.rounds[first].buffers)
        new_outer.load_state_dict(self.rounds[first].buffers)
        fix = Repair(correction={n: torch.zeros(s) for n, s in self.spec.items()}, buffers={})
        for r in list(self.rounds)[first:]:
            r.buffers = new_outer.state_dict()
            pool = sorted((u for u in (*r.kept, *r.dropped) if not revoked(u.worker_id)), key=lambda u: u.worker_id)
            gone = [u.worker_id for u in (*r.kept, *r.dropped) if revoked(u.worker_id)]
            if gone:
                out = screen(pool, self.cfg, f"{self.label} round {r.version} (repair)")
                was_dropped = {u.worker_id for u in r.dropped}
                fix.rounds.append(r.version)
                fix.removed.extend(gone)
                fix.restored.extend(u.worker_id for u in out.kept if u.worker_id in was_dropped)
                fix.others.update(u.worker_id for u in pool)
                old_mean = self.mean(r, r.kept)  # with the votes the close gave them
                for u in out.kept:  # the votes the screen gives them without the revoked (round/screen.py)
                    u.weight = out.weights[u.update_id]
                new_mean = self.mean(r, out.kept)
                r.kept, r.dropped = out.kept, [u for u, _ in out.dropped]
            else:  # a later round, untouched: its mean is the same, its step may not be (momentum)
                old_mean = new_mean = self.mean(r, r.kept) if self.cfg.outer.momentum else None
            if old_mean is None:
                continue  # no momentum: the same mean gives the same step
            old_step, new_step = old_outer.step(old_mean), new_outer.step(new_mean)
            for n in self.spec:
                fix.correction[n] += new_step[n] - old_step[n]
        fix.buffers = new_outer.state_dict() if self.cfg.outer.momentum else dict(outer_buffers)
        self.count += 1
        return fix
