"""`Fold`: what a worker's next update will carry — each step trained since its last push (its
number, which names its windows, and its CE) and, while the next version is on its way, the θ that work is measured from — as an
immutable value that each event of a round (train, push, answer, new version) replaces."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

Tensors = Mapping[str, torch.Tensor]


class Trained(NamedTuple):
    step: int  # the trainer's step: its windows are WindowSampler.batch(seed, data key, step, batch)
    ce: float


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no single truth value; compare the fields
class Fold:
    """The rule (worker.py's module doc): once version v+1 arrives, θ ← θ^{v+1} + (θ_now − origin),
    and the steps in `pending` go into the next update. The origin is θ at the push when the update
    was accepted, and θ^v when it was not (then its steps are pending again: nothing of it reached
    v+1). Invariants: `in_flight` is non-empty only between `sent` and the answer; after `landed`
    there is no origin, and `pending` is empty unless a carry was taken."""

    pending: tuple[Trained, ...] = ()  # each step the next update will carry
    in_flight: tuple[Trained, ...] = ()  # the steps of the update awaiting its answer
    origin: Tensors | None = None  # θ the carry is measured from while waiting; None: nothing to fold

    def trained(self, step: int, ce: float) -> Fold:
        return replace(self, pending=(*self.pending, Trained(step, ce)))

    def due(self, steps_per_round: int) -> int:
        """Steps still to train before the next push (H minus what is already pending)."""
        return max(0, steps_per_round - len(self.pending))

    @property
    def loss(self) -> float:
        """Mean CE over the pending steps: the next update's reported loss."""
        assert self.pending, "no steps pending"
        return sum(t.ce for t in self.pending) / len(self.pending)

    @property
    def steps(self) -> tuple[int, ...]:
        """The pending steps' numbers, in the order trained: which windows the next update holds."""
        return tuple(t.step for t in self.pending)

    def sent(self) -> Fold:
        """The pending steps went out as an update."""
        return Fold(in_flight=self.pending, origin=self.origin)

    def accepted(self, at_push: Tensors) -> Fold:
        """The update is in the next version: fold in only what was trained after it (θ − θ at push)."""
        return Fold(pending=self.pending, origin=at_push)

    def refused(self, base: Tensors, most: int) -> Fold:
        """Nothing of the update reaches the next version: fold all of it in (θ − θ^v), its steps too,
        unless the next update would then hold more than `most` steps (the aggregator refuses more:
        aggregate/trust/claims.py); then nothing is folded, as in `idle`."""
        pending = self.in_flight + self.pending
        return Fold(pending=pending, origin=base) if len(pending) <= most else self.idle()

    def idle(self) -> Fold:
        """Nothing is folded in: the next version is adopted exactly and pending steps are dropped."""
        return Fold(pending=self.pending)

    @property
    def carries(self) -> bool:
        """Whether the next version gets a carry: an origin, and steps trained since it."""
        return self.origin is not None and bool(self.pending)

    def carry(self, now: Tensors) -> dict[str, torch.Tensor]:
        """θ_now − origin, to add onto the next version."""
        assert self.origin is not None, "no origin to measure a carry from"
        origin = self.origin
        return {n: now[n] - origin[n] for n in now}

    def landed(self) -> Fold:
        """The next version was adopted (and the carry, if any, added): pending steps stay only if carried."""
        return replace(self, pending=self.pending if self.carries else (), origin=None)
