"""Cheating workers (issue #23), for tests and bench/cheats.py: each is a `BlockWorker` that changes
what it pushes or what it trains on, while its claims look honest (the steps it lists, and samples
= len(steps) × batch, as an honest worker states them). The simulator hosts them by worker id
(`Simulation(..., workers={id: factory})`); a factory takes BlockWorker's constructor arguments.

`CHEATS` names every cheat the bench runs; `cheat_factory(name, victim=...)` builds one."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from btnode.codec.codecs import decode
from btnode.codec.frames import encode_raw
from btnode.data.source import ByteSource
from btnode.protocol import Judgement, PushHeader
from btnode.swarm.worker import BlockWorker

Tensors = dict[str, torch.Tensor]
Raw = dict[str, bytes]
LAZY_STEPS = 5  # what the lazy worker really trains of its H
SCALE = 100.0  # the scaled cheat's factor
SYBILS = 2  # extra ids the sybil pushes under
SENTENCE = b"The cat sat on the mat. "


class ForgingWorker(BlockWorker):
    """Trains honestly, then pushes `forge(Δ)` in place of its Δ, under the honest header."""

    def forge(self, delta: Tensors) -> Tensors:
        raise NotImplementedError

    def make_update(self) -> tuple[PushHeader, Raw]:
        header, raw = super().make_update()
        delta = {n: decode(self.wcfg.codec, raw[n], self.spec[n]) for n in self.spec}
        self._last_update = (header, encode_raw(self.forge(delta), self.wcfg.codec))
        return self._last_update


class ZeroWorker(ForgingWorker):
    """Withholds its work: pushes a zero delta (an update that moves nothing, paid as H steps)."""

    def forge(self, delta: Tensors) -> Tensors:
        return {n: torch.zeros_like(d) for n, d in delta.items()}


class NegatedWorker(ForgingWorker):
    """Pushes −Δ: a sign flip at the honest size (the same cheat once claims fix the weight)."""

    def forge(self, delta: Tensors) -> Tensors:
        return {n: -d for n, d in delta.items()}


class ScaledWorker(ForgingWorker):
    """Pushes SCALE × Δ: the per-coordinate claim bound refuses it."""

    def forge(self, delta: Tensors) -> Tensors:
        return {n: SCALE * d for n, d in delta.items()}


class ReplayOwnWorker(ForgingWorker):
    """Pushes its round-0 delta again every round."""

    first: Tensors | None = None

    def forge(self, delta: Tensors) -> Tensors:
        if self.first is None:
            self.first = delta
        return self.first


class ReplayPublishedWorker(ForgingWorker):
    """Pushes the block's latest published delta (which any worker can fetch) as its own; zero before
    anything was published."""

    def forge(self, delta: Tensors) -> Tensors:
        assert self.info is not None
        if self.info.version == 0:
            return {n: torch.zeros_like(d) for n, d in delta.items()}
        return self.link.fetch_delta(self.wcfg.block, self.info.version, self.spec).tensors


class LazyWorker(BlockWorker):
    """Trains LAZY_STEPS of the steps due and lists them all: its step counter and the steps it
    claims move as an honest worker's would."""

    def train_steps(self, n: int) -> None:
        super().train_steps(min(n, LAZY_STEPS))
        skip(self, n - min(n, LAZY_STEPS))


class FreeRiderWorker(ForgingWorker):
    """Trains nothing, lists H steps, and pushes a tiny random delta (N(0, (lr/10)²) per
    coordinate, far inside the bound): the cheapest update that is not exactly zero."""

    def train_steps(self, n: int) -> None:
        skip(self, n)

    def forge(self, delta: Tensors) -> Tensors:
        g = torch.Generator().manual_seed(self.trainer.step)
        return {n: torch.randn(d.shape, generator=g) * (self.tc.lr / 10) for n, d in delta.items()}


class CopyingWorker(ForgingWorker):
    """Pushes another replica's update of the same round as its own (its bytes, read off the wire:
    in the simulator, the victim's last made update)."""

    def __init__(self, *args: object, victim: Callable[[], BlockWorker], **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.victim = victim

    def forge(self, delta: Tensors) -> Tensors:
        return delta  # replaced at push time, when the victim's update of this round exists

    def push(self, header: PushHeader, raw: Raw) -> Judgement:
        theirs = self.victim()._last_update
        if theirs is not None and theirs[0].base_version == header.base_version:
            raw = theirs[1]
        return super().push(header, raw)


class SybilWorker(NegatedWorker):
    """Pushes −Δ under its own id and under SYBILS more ids that never joined (stating no data key,
    as an older worker may), so that bad updates outnumber the honest ones."""

    def push(self, header: PushHeader, raw: Raw) -> Judgement:
        for i in range(SYBILS):
            fake = replace(header, worker_id=f"{self.wcfg.worker_id}-sybil{i}", update_id=uuid.uuid4().hex, data_key="")
            super().push(fake, raw)
        return super().push(header, raw)


def skip(worker: BlockWorker, n: int) -> None:
    """Lists n steps as trained without training them (the fold records each with the CE of the
    last step really trained, or 0)."""
    ce = worker._fold.pending[-1].ce if worker._fold.pending else 0.0
    for _ in range(n):
        worker._fold = worker._fold.trained(worker.trainer.step, ce)
        worker.trainer.step += 1


def other_data(corpus: ByteSource | bytes, how: str) -> bytes:
    """The cheater's own corpus: one sentence repeated, or the swarm's bytes reversed."""
    data = corpus if isinstance(corpus, bytes) else corpus.read(0, len(corpus))
    if how == "sentence":
        return SENTENCE * (len(data) // len(SENTENCE) + 1)
    return data[::-1]


def _on_other_data(how: str, cfg, tc, wcfg, link, corpus, **kwargs) -> BlockWorker:  # type: ignore[no-untyped-def]
    return BlockWorker(cfg, tc, wcfg, link, other_data(corpus, how), **kwargs)


CHEATS: dict[str, Callable[..., BlockWorker]] = {
    "zero": ZeroWorker,
    "negated": NegatedWorker,
    "scaled": ScaledWorker,
    "replay_own": ReplayOwnWorker,
    "data_sentence": partial(_on_other_data, "sentence"),
    "data_reversed": partial(_on_other_data, "reversed"),
    "lazy": LazyWorker,
    "free_rider": FreeRiderWorker,
    "replay_published": ReplayPublishedWorker,
    "copy": CopyingWorker,
    "sybil": SybilWorker,
}


def cheat_factory(name: str, *, victim: Callable[[], BlockWorker] | None = None) -> Callable[..., BlockWorker]:
    """The factory of cheat `name`; "copy" needs `victim`, the worker whose updates it copies."""
    if name == "copy":
        assert victim is not None, "the copying cheat needs a victim"
        return partial(CopyingWorker, victim=victim)
    return CHEATS[name]
