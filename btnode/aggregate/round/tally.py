"""`Tally`: the open round's accepted updates as a block keeps them. Memory does not grow with the
number of updates (issue #25): an update is summed on arrival into the round's exact running sum
(aggregate/sums/accumulate.py; the same sum in any arrival order) and then dropped; the round keeps of
it its norm, its weight, a 4,096-value sketch for the screen, and where its raw codec bytes lie in the
round's spill file (aggregate/sums/spill.py), from which it is re-decoded and subtracted if an audit or
the screen takes it out. Only the trimmed and median rules, which need every value of every update,
hold the updates (4 bytes a parameter each, fp32 in the spill)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from btnode.aggregate.round.rounds import Update
from btnode.aggregate.round.screen import spilled_rule
from btnode.aggregate.sums.accumulate import Accumulator, Sketcher, dense, scaled
from btnode.aggregate.sums.averaging import combine
from btnode.aggregate.sums.spill import Spill
from btnode.codec.codecs import Codec, decode
from btnode.codec.sparse import SparseTensor

if TYPE_CHECKING:
    from btnode.aggregate.round.config import AggregatorConfig


class Tally:
    """One round's sum, sketches and spill; the block's lock guards it."""

    def __init__(self, spec: Mapping[str, tuple[int, ...]], cfg: AggregatorConfig, unit: float, spill: Spill,
                 sketch_key: bytes):
        """`sketch_key`: this round's key of the screen's sketches (a secret, so that no worker can shape an
        update to look aligned in the sketch but not in fact)."""
        self.spec, self.cfg, self.unit, self.spill = spec, cfg, unit, spill
        self.holds_updates = cfg.outer.robust in ("trimmed", "median")  # they need every value at close
        self.sum = self._accumulator()  # the round's accepted updates, summed as they arrive
        self.sketcher = Sketcher(spec, sketch_key) if cfg.outer.robust != "mean" else None
        self.spill_taken = False  # the spill outlives the round (`take_spill`): whoever took it closes it

    def take_spill(self) -> Spill:
        """The round's spill, to outlive it (a relay keeps its last rounds' for their evidence)."""
        self.spill_taken = True
        return self.spill

    def _accumulator(self) -> Accumulator:
        return Accumulator(self.spec, self.cfg.sparse_mean, unit=self.unit)

    def values(self, update: Update) -> dict:
        """An update's values as summed: held in memory, or decoded again from the round's spill
        (bit for bit what arrived: decoding is deterministic), times its clip factor."""
        delta = update.delta
        if delta is None:
            assert update.spilled is not None
            raw = self.spill.get(update.spilled)
            delta = {n: SparseTensor.decode(b, self.spec[n], update.codec.two_bit) if update.codec.sparse
                     else decode(update.codec, b, self.spec[n]) for n, b in raw.items()}
        return scaled(delta, update.scale) if update.scale != 1 else delta

    def add(self, update: Update) -> None:
        """Into the running sum and its sketch, its raw bytes into the spill, and out of memory (unless
        the rule needs every update at close, or it came without raw bytes)."""
        values = self.restore(update)
        if self.holds_updates:  # fp32 on disk: the close reads them a column of coordinates at a time
            update.spilled = self.spill.put({n: t.contiguous().view(-1).numpy().tobytes()
                                             for n, t in dense(values).items()})
            update.codec, update.scale = Codec.FP32, 1.0
            update.raw = update.delta = None
        elif update.raw is not None:
            update.spilled = self.spill.put(update.raw)
            update.raw = update.delta = None

    def restore(self, update: Update) -> dict:
        """Into the running sum and its sketch, as it is (a spilled one: a round taken up after a
        restart); returns its values."""
        values = self.values(update)
        sketcher = self.sketcher
        if not self.holds_updates and update.weight > 0:  # weight 0: screened with the round, not in its sum
            if sketcher is None:
                self.sum.add(values, update.weight)
            else:  # summed and sketched in one pass: each tensor of a lazy update decoded once, not twice
                sketch = sketcher.empty()
                self.sum.add(values, update.weight, also=functools.partial(sketcher.add_into, sketch))
                update.sketch = sketch
        elif sketcher is not None:
            update.sketch = sketcher.of(values)
        return values

    def leave(self, update: Update) -> None:
        """Out of the running sum again, exactly."""
        if not self.holds_updates and update.weight > 0:
            self.sum.sub(self.values(update), update.weight)

    def reweight(self, update: Update, weight: float) -> None:
        """Its weight in the running sum made `weight` (the screen's vote at close), exactly: what it
        added is taken out and it is added again, so the sum is the one the new weights give in any order."""
        if weight == update.weight:
            return
        if not self.holds_updates:
            values = self.values(update)
            if update.weight > 0:
                self.sum.sub(values, update.weight)
            if weight > 0:
                self.sum.add(values, weight)
        update.weight = weight

    def rebuild(self, updates: Iterable[Update]) -> None:
        """The running sum made again from the round's updates (in worker-id order), exactly as it was:
        after a close that read (and freed) part of it failed, so that a retry makes the same version."""
        self.sum = self._accumulator()
        if not self.holds_updates:
            for u in updates:
                if u.weight > 0:
                    self.sum.add(self.values(u), u.weight)

    def combiner(self, ups: list[Update], *, release: bool = True) -> tuple[Callable[[str], torch.Tensor], str]:
        """(tensor name → that tensor of Δ̄, the rule's name). The round's running sum, with what the
        screen dropped already taken out; trimmed and median combine the updates they held (sparse
        ones made dense: N copies, the cost of choosing them), computing the rule once."""
        outer = self.cfg.outer
        if self.holds_updates:
            return (functools.partial(spilled_rule, self.spill, ups, self.spec, outer),
                    combine([{"x": torch.zeros(1)}] * len(ups), [1.0] * len(ups), outer)[1])
        robust = outer.robust if len(ups) >= 3 and outer.robust == "screened" else "mean"
        rule = f"{robust}/{self.cfg.sparse_mean}" if any(u.codec.sparse for u in ups) else robust
        return functools.partial(self.sum.mean_of, release=release), rule
