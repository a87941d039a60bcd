"""Re-running a claimed round of one unit: what an auditor does, whether it is the aggregator
(aggregate/trust/audit.py `Replayer`) or another worker verifying for it (swarm/verify.py,
docs/security.md "Delegated verification").

A round is named by its push header (steps, data key, codec) and work claim (base hash, recipe,
start and end state hashes). `RoundReplay.run` trains the claimed steps on the claimed windows from
θ^base and the uploaded start state, exactly as a worker does (the same trainer, sampler and
`encode_update`), and returns the codec bytes and end hashes; `result_digest` of them is what a
verifier attests. For a dispute (a verifier's digest against the push, or two verifiers against each
other) `trace` gives the hash of the whole state (θ and optimizer state) after each step, and
`state_after` / `step_once` let a referee recompute the single step where two traces first differ.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from btnode.codec.frames import encode_update
from btnode.data.source import ByteSource
from btnode.data.windows import WindowSampler
from btnode.model.config import ModelConfig
from btnode.protocol import OPTIMIZER_PREFIX, RESIDUAL_PREFIX, PushHeader
from btnode.store.files import load_optimizer, optimizer_tensors, state_sha256
from btnode.store.models import init_unit
from btnode.train.config import TrainConfig
from btnode.train.trainers import optimizer_spec, unit_trainer

Tensors = dict[str, torch.Tensor]
PARAM_PREFIX = "theta."  # a traced state's parameters (beside OPTIMIZER_PREFIX's optimizer tensors)


@dataclass(frozen=True)
class ReplayResult:
    raw: dict[str, bytes]  # the replayed delta's codec bytes
    optimizer_end: str  # state_sha256 of the optimizer state it ends with
    residual_end: str  # ... and of the residual it leaves
    trace: tuple[str, ...] = ()  # `state_digest` after each step, when asked for

    @property
    def digest(self) -> str:
        return result_digest(self.raw, self.optimizer_end, self.residual_end)


def result_digest(raw: Mapping[str, bytes], optimizer_end: str, residual_end: str) -> str:
    """One hash of what a round produced: its codec bytes by tensor name, and its end state hashes.
    The aggregator computes it of a push (its bytes, its claim's end hashes); a verifier of its replay."""
    h = hashlib.sha256(b"btnode-round-result\0")
    for name in sorted(raw):
        h.update(name.encode() + b"\0" + len(raw[name]).to_bytes(8, "big") + raw[name])
    h.update(optimizer_end.encode() + b"\0" + residual_end.encode())
    return h.hexdigest()


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[Tensors, Tensors]:
    """(optimizer tensors, residual) of an uploaded start state."""
    return ({n[len(OPTIMIZER_PREFIX):]: t for n, t in state.items() if n.startswith(OPTIMIZER_PREFIX)},
            {n[len(RESIDUAL_PREFIX):]: t for n, t in state.items() if n.startswith(RESIDUAL_PREFIX)})


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with torch's intra-op thread count at n (reductions split by it), then restore it."""
    before = torch.get_num_threads()
    if n != before and 1 <= n <= (os.cpu_count() or 1):
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class RoundReplay:
    """Replays rounds of unit `unit`. Holds no swarm state: give it a round, get its result."""

    def __init__(self, cfg: ModelConfig, unit: int, corpus: ByteSource | bytes):
        self.cfg, self.unit = cfg, unit
        self.sampler = WindowSampler(corpus, cfg.context)
        model = init_unit(cfg, unit, 0)
        self.shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        self.optimizer_shapes = optimizer_spec(model)

    def _trainer(self, tc: TrainConfig, base: Mapping[str, torch.Tensor], optim: Tensors):  # type: ignore[no-untyped-def]
        model = init_unit(self.cfg, self.unit, tc.seed)
        model.load_state_dict(dict(base))
        trainer = unit_trainer(self.cfg, self.unit, model, tc, device=torch.device("cpu"))
        if optim:  # copies: AdamW steps its loaded state in place, and a job's start state is replayed more than once
            load_optimizer(trainer.opt, {n: t.clone() for n, t in optim.items()}, trainer.opt.state_dict()["param_groups"])
        return trainer

    def _step(self, trainer, header: PushHeader, tc: TrainConfig, step: int) -> None:  # type: ignore[no-untyped-def]
        trainer.step = step
        trainer.train_step(self.sampler.batch(tc.seed, header.data_key, step, tc.batch), header.worker_id)

    def run(self, header: PushHeader, tc: TrainConfig, base: Mapping[str, torch.Tensor],
            start: Mapping[str, torch.Tensor], *, keep: int, error_feedback: bool, trace: bool = False) -> ReplayResult:
        """The claimed round again: `header.steps` from θ^base (`base`) and the uploaded `start` state,
        encoded at `keep` (a sparse codec's, as its frames state) with or without error feedback."""
        optim, residual = split_state(start)
        trainer = self._trainer(tc, base, optim)
        hashes = []
        for step in header.steps:
            self._step(trainer, header, tc, step)
            if trace:
                hashes.append(state_digest(trainer))
        raw, res_end = encode_update(trainer.model.state_dict(), base, residual, header.codec,
                                     error_feedback=error_feedback, keep=keep)
        return ReplayResult(raw, state_sha256(optimizer_tensors(trainer.opt)[0]), state_sha256(res_end), tuple(hashes))

    def state_after(self, header: PushHeader, tc: TrainConfig, base: Mapping[str, torch.Tensor],
                    start: Mapping[str, torch.Tensor], k: int) -> Tensors:
        """The whole state (θ, optimizer) after the first `k` claimed steps (k ≥ 1): what a party to a
        dispute uploads for the referee's one step (its `state_digest` is trace[k − 1])."""
        trainer = self._trainer(tc, base, split_state(start)[0])
        for step in header.steps[:k]:
            self._step(trainer, header, tc, step)
        return full_state(trainer)

    def step_once(self, header: PushHeader, tc: TrainConfig, state: Mapping[str, torch.Tensor], k: int) -> str:
        """The referee's work: from the whole state after k claimed steps, train step k + 1 and return
        the `state_digest` it ends with (trace[k] of an honest replay)."""
        theta = {n[len(PARAM_PREFIX):]: t for n, t in state.items() if n.startswith(PARAM_PREFIX)}
        trainer = self._trainer(tc, theta, split_state(state)[0])
        self._step(trainer, header, tc, header.steps[k])
        return state_digest(trainer)

    def initial_state(self, base: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor]) -> Tensors:
        """The whole state before the round's first step: θ^base and the start optimizer state."""
        return {**{PARAM_PREFIX + n: t for n, t in base.items()},
                **{OPTIMIZER_PREFIX + n: t for n, t in split_state(start)[0].items()}}

    def encode_final(self, header: PushHeader, base: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor],
                     final: Mapping[str, torch.Tensor], *, keep: int, error_feedback: bool) -> str:
        """The `result_digest` of a round that ended in the whole state `final`: its encode against θ^base
        and the start residual (the referee's work when two parties agree on every step)."""
        theta = {n[len(PARAM_PREFIX):]: t for n, t in final.items() if n.startswith(PARAM_PREFIX)}
        optim = {n[len(OPTIMIZER_PREFIX):]: t for n, t in final.items() if n.startswith(OPTIMIZER_PREFIX)}
        raw, res_end = encode_update(theta, base, split_state(start)[1], header.codec, error_feedback=error_feedback,
                                     keep=keep)
        return result_digest(raw, state_sha256(optim), state_sha256(res_end))

    def state_spec(self) -> dict[str, tuple[int, ...]]:
        """What a whole state (`state_after`) holds: θ and the optimizer state, by name and shape."""
        return {**{PARAM_PREFIX + n: s for n, s in self.shapes.items()},
                **{OPTIMIZER_PREFIX + n: s for n, s in self.optimizer_shapes.items()}}


def full_state(trainer) -> Tensors:  # type: ignore[no-untyped-def]
    return {**{PARAM_PREFIX + n: t.detach().cpu().clone() for n, t in trainer.model.state_dict().items()},
            **{OPTIMIZER_PREFIX + n: t.detach().cpu().clone() for n, t in optimizer_tensors(trainer.opt)[0].items()}}


def state_digest(trainer) -> str:  # type: ignore[no-untyped-def]
    """The hash of a trainer's whole state (θ and optimizer state, including its step counts)."""
    return state_sha256(full_state(trainer))
