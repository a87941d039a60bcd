"""One optimizer step at a time: `BlockTrainer` trains one DiffusionBlock with its own AdamW
(design §2.5); `ARTrainer` trains the autoregressive baseline (and a DiLoCo replica). Each owns its
model and optimizer, and nothing else; the loops that feed them batches and write checkpoints live
in loops.py. `unit_trainer` picks the one a swarm unit needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from btnode.model.ar import ByteTransformer
from btnode.model.block import DiffusionBlock
from btnode.model.config import ModelConfig
from btnode.model.layout import Layout, window_layout
from btnode.model.noise import loss_weight, sample_sigma
from btnode.model.targets import target_table
from btnode.seeding import generator
from btnode.train.config import Precision, TrainConfig


@dataclass(frozen=True)
class StepStats:
    loss: float  # the optimised loss (λ-weighted CE for blocks)
    ce: float  # unweighted CE, nats/byte (a diagnostic for blocks: it sees a noised target)
    k: int  # segment length of this batch (1 for AR)


def make_optimizer(model: nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), foreach=True)


def optimizer_spec(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Names and shapes of make_optimizer's AdamW state once it has stepped, as
    store.files.optimizer_tensors names them: what a worker's uploaded optimizer state must hold."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    spec: dict[str, tuple[int, ...]] = {}
    for i, p in enumerate(decay + no_decay):  # state_dict numbers parameters group by group
        spec.update({f"state.{i}.step": (), f"state.{i}.exp_avg": tuple(p.shape), f"state.{i}.exp_avg_sq": tuple(p.shape)})
    return spec


class _Trainer:
    model: nn.Module

    def __init__(self, model: nn.Module, tc: TrainConfig, device: torch.device):
        self.tc = tc
        self.device = device
        self.model = model.to(device)
        self.opt = make_optimizer(self.model, tc)
        self.step = 0  # completed optimizer steps of this model

    def train_step(self, x: torch.Tensor, worker: int | str = 0) -> StepStats:
        raise NotImplementedError

    def logits(self, *inputs: object) -> torch.Tensor:
        """The model's fp32 logits. Under --precision bf16 the forward pass runs in bf16 autocast
        (the parameters it casts stay fp32, and so do their gradients and the optimizer) and the
        loss is taken in fp32; under fp32 this is the plain forward call, bit for bit."""
        return self._fp32(self.model, *inputs)

    def _fp32(self, fn: Callable[..., Any], *inputs: object) -> Any:
        """fn(*inputs) under the configured precision, its tensors (or tuple of tensors / None) in fp32."""
        if self.tc.precision is Precision.FP32:
            return fn(*inputs)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            out = fn(*inputs)
        return tuple(None if t is None else t.float() for t in out) if isinstance(out, tuple) else out.float()

    def _apply(self, loss: torch.Tensor) -> None:
        for group in self.opt.param_groups:
            group["lr"] = self.tc.lr_at(self.step)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.tc.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.tc.grad_clip)
        self.opt.step()
        self.step += 1


class BlockTrainer(_Trainer):
    """Trains block `block` on its σ interval. All randomness of a step is keyed by
    (seed, worker, block, step), so a resumed run replays the uninterrupted one exactly."""

    model: DiffusionBlock

    def __init__(self, model: DiffusionBlock, tc: TrainConfig, *, block: int, table: torch.Tensor,
                 device: torch.device):
        super().__init__(model, tc, device)
        self.cfg: ModelConfig = model.cfg
        self.block = block
        self.table = table.to(device)

    def segment_weights(self) -> list[float]:
        """Sampling weight of each trained K. A tail block exists to commit multi-byte segments
        jointly, and a K = 1 segment has nothing to commit jointly, so tail blocks train on K > 1
        only (every K > 1 equally often); a model trained only on K = 1 trains its tail on K = 1."""
        segs = self.cfg.segments
        if self.cfg.is_tail(self.block) and len(segs) > 1:
            return [0.0] + [1.0] * (len(segs) - 1)
        return self.tc.segment_weights(segs)

    def train_step(self, x: torch.Tensor, worker: int | str = 0) -> StepStats:
        """x: (B, N+1) byte windows."""
        cfg = self.cfg
        b, n = x.shape[0], x.shape[1] - 1
        g = generator("block-step", self.tc.seed, worker, self.block, self.step)
        tail = cfg.is_tail(self.block)
        if self.tc.k1_share is None and not tail:  # the original draw, kept so that existing runs replay bit-exactly
            k = cfg.segments[int(torch.randint(len(cfg.segments), (), generator=g))]
        else:
            weights = torch.tensor(self.segment_weights(), dtype=torch.float64)
            k = cfg.segments[int(torch.multinomial(weights, 1, generator=g))]
        phase = int(torch.randint(k, (), generator=g))
        sigma = sample_sigma(cfg, self.block, b, g)
        eps = torch.randn(b, n, cfg.d_model, generator=g)
        keep = torch.ones(b)
        if self.tc.ctx_share > 0 and not tail:  # drawn only when used, so that runs without it replay bit-exactly
            null = torch.rand(b, generator=g) < self.tc.ctx_share
            sigma = torch.where(null, torch.tensor(cfg.sigma_hi), sigma)
            keep = (~null).float()
        layout = window_layout(n, k, phase)
        if self.tc.noisy_rows < 1:  # drawn only when used, as above
            layout = segment_subset(layout, self.tc.noisy_rows, g)
        x, sigma, eps, keep = x.to(self.device), sigma.to(self.device), eps.to(self.device), keep.to(self.device)
        layout = layout.to(self.device)
        ctx, tgt = x[:, :-1], x[:, 1:]
        rows, eps = (tgt, eps) if self.tc.noisy_rows == 1 else (tgt[:, layout.positions], eps[:, layout.positions])
        # (B, T, C); a context-readout sample gets the null state z = 0 (no noise, no target)
        z = keep[:, None, None] * (self.table[rows] + sigma[:, None, None] * eps)
        self.model.train()
        logits, clean = self._fp32(self.model.train_logits, ctx, z, sigma, layout)
        t = rows.shape[1]
        ce = F.cross_entropy(logits.reshape(-1, cfg.vocab), rows.reshape(-1), reduction="none").view(b, t).mean(1)
        loss = (loss_weight(cfg, sigma) * ce).mean()
        if clean is not None:  # ModelConfig.ctx_head: the clean stream's next-byte CE at all N positions
            loss = loss + self.tc.ctx_weight * F.cross_entropy(clean.reshape(-1, cfg.vocab), tgt.reshape(-1))
        self._apply(loss)
        return StepStats(loss=loss.item(), ce=ce.mean().item(), k=k)


def segment_subset(layout: Layout, share: float, g: torch.Generator) -> Layout:
    """The rows of a random `share` of the layout's segments (at least one), in position order: the
    noisy rows a step trains on under TrainConfig.noisy_rows < 1."""
    segs = torch.unique(layout.segment)
    keep = max(1, round(share * len(segs)))
    chosen = segs[torch.randperm(len(segs), generator=g)[:keep]]
    rows = torch.isin(layout.segment, chosen)
    return Layout(layout.positions[rows], layout.context_end[rows], layout.segment[rows])


class ARTrainer(_Trainer):
    model: ByteTransformer

    def train_step(self, x: torch.Tensor, worker: int | str = 0) -> StepStats:
        x = x.to(self.device)
        self.model.train()
        logits = self.logits(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        self._apply(loss)
        return StepStats(loss=loss.item(), ce=loss.item(), k=1)


def unit_trainer(cfg: ModelConfig, unit: int, model: nn.Module, tc: TrainConfig, *,
                 device: torch.device) -> BlockTrainer | ARTrainer:
    """The trainer of swarm unit `unit` (store.models.init_unit builds its model): a BlockTrainer
    for block `unit`, or an ARTrainer for the whole AR model of a DiLoCo run (cfg.kind == "ar")."""
    if cfg.kind == "ar":
        return ARTrainer(model, tc, device)
    return BlockTrainer(model, tc, block=unit, table=target_table(cfg), device=device)  # type: ignore[arg-type]
