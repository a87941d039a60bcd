"""SCE-S (design §2.7): for each of S fixed seeds, run the full one-sweep sampler from fresh noise
(never looking at the targets), average the final softmax probabilities over seeds, and score
−ln q(x_{t+1}). Only rows with at least N/2 bytes of context are scored (`eval_layout`), and the
autoregressive baseline is scored on exactly the same rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from btnode.data.source import ByteSource
from btnode.data.windows import eval_windows
from btnode.model.ar import ByteTransformer
from btnode.model.block import DiffusionBlock
from btnode.model.config import ModelConfig
from btnode.model.layout import eval_layout
from btnode.model.noise import default_steps, sigma_grid
from btnode.model.readout import DEFAULT_READOUT, Readout, check_sweep_readout
from btnode.model.sampler import context_logits, pool, sweep
from btnode.model.targets import target_table
from btnode.seeding import generator


@dataclass(frozen=True)
class SamplerCE:
    k: int
    n_steps: int
    seeds: tuple[int, ...]
    sce1: float  # nats/byte with the first seed alone
    sce: float  # nats/byte with probabilities averaged over all seeds
    positions: int  # scored positions

    @property
    def bits1(self) -> float:
        return self.sce1 / math.log(2)

    @property
    def bits(self) -> float:
        return self.sce / math.log(2)


def _noise(seed: int, window_ids: torch.Tensor, t: int, d: int) -> torch.Tensor:
    """Initial noise for each window, keyed by (seed, window index): independent of batching."""
    return torch.stack([torch.randn(t, d, generator=generator("eval-noise", seed, int(w))) for w in window_ids])


@torch.no_grad()
def sampler_ce(blocks: Sequence[DiffusionBlock], windows: torch.Tensor, *, k: int, seeds: Sequence[int],
               n_steps: int, device: torch.device, batch: int = 64,
               readout: Readout = DEFAULT_READOUT) -> SamplerCE:
    """SCE over `windows` (W, N+1) for segment length k, seeds[0] alone and all seeds averaged.
    `readout` as in `sweep`; the seed-independent context readouts of POOL are computed once."""
    cfg: ModelConfig = blocks[0].cfg
    n = cfg.context
    readout = check_sweep_readout(readout)
    if windows.shape[1] != n + 1:
        raise ValueError(f"windows of {windows.shape[1]} bytes, model wants {n + 1}")
    for blk in blocks:
        blk.eval()
    table = target_table(cfg).to(device)
    grid = sigma_grid(cfg, n_steps)
    layout = eval_layout(n, k).to(device)
    nll1 = torch.zeros((), dtype=torch.float64)
    nll = torch.zeros((), dtype=torch.float64)
    count = 0
    for lo in range(0, len(windows), batch):
        w = windows[lo:lo + batch].to(device)
        ids = torch.arange(lo, lo + len(w))
        tgt = w[:, 1:][:, layout.positions]  # (Wb, T)
        caches = [blk.encode_context(w[:, :-1]) for blk in blocks]
        ctx = [context_logits(blk, c, layout) for blk, c in zip(blocks, caches)] if readout is Readout.POOL else []
        q = torch.zeros(len(w), len(layout.positions), cfg.vocab, device=device, dtype=torch.float64)
        for j, seed in enumerate(seeds):
            z = grid[0] * _noise(seed, ids, len(layout.positions), cfg.d_model).to(device)
            logits = sweep(blocks, caches, z, grid, layout, table, readout=Readout.LAST)
            if readout is Readout.POOL:  # the same pooling sweep(readout=Readout.POOL) does
                logits = pool([*ctx, logits])
            p = torch.softmax(logits.double(), dim=-1)
            if j == 0:
                nll1 += -torch.log(p.gather(-1, tgt[..., None]).clamp_min(1e-300)).sum().cpu()
            q += p
        q /= len(seeds)
        nll += -torch.log(q.gather(-1, tgt[..., None]).clamp_min(1e-300)).sum().cpu()
        count += tgt.numel()
    return SamplerCE(k=k, n_steps=n_steps, seeds=tuple(seeds), sce1=float(nll1) / count, sce=float(nll) / count,
                     positions=count)


@dataclass(frozen=True)
class BlockAlone:
    """Block b read on its own, on the same windows and rows as the chain (K = 1)."""

    block: int
    noise: float  # SCE-S of one evaluation from pure noise at σ_hi, probabilities averaged over seeds
    context: float  # CE of its context readout (z = 0 at σ_hi; deterministic)

    @property
    def best(self) -> float:
        return min(self.noise, self.context)


@torch.no_grad()
def blocks_alone(blocks: Sequence[DiffusionBlock], windows: torch.Tensor, *, seeds: Sequence[int],
                 device: torch.device, batch: int = 64) -> list[BlockAlone]:
    """Each block read alone at K = 1, both ways; the chain composes only if it beats the best."""
    cfg: ModelConfig = blocks[0].cfg
    layout = eval_layout(cfg.context, 1).to(device)
    noise = [torch.zeros((), dtype=torch.float64) for _ in blocks]
    ctx = [torch.zeros((), dtype=torch.float64) for _ in blocks]
    count = 0
    for lo in range(0, len(windows), batch):
        w = windows[lo:lo + batch].to(device)
        ids = torch.arange(lo, lo + len(w))
        tgt = w[:, 1:][:, layout.positions][..., None]
        sigma = torch.full((len(w),), cfg.sigma_hi, device=device)
        zs = [cfg.sigma_hi * _noise(seed, ids, len(layout.positions), cfg.d_model).to(device) for seed in seeds]
        for b, blk in enumerate(blocks):
            blk.eval()
            cache = blk.encode_context(w[:, :-1])
            q = sum(torch.softmax(blk.denoise(z, sigma, cache, layout).double(), -1) for z in zs) / len(zs)
            noise[b] += -torch.log(q.gather(-1, tgt).clamp_min(1e-300)).sum().cpu()
            p = torch.log_softmax(context_logits(blk, cache, layout).double(), -1)
            ctx[b] += -p.gather(-1, tgt).sum().cpu()
        count += tgt.numel()
    return [BlockAlone(b, float(noise[b]) / count, float(ctx[b]) / count) for b in range(len(blocks))]


@torch.no_grad()
def ar_ce(model: ByteTransformer | Sequence[ByteTransformer], windows: torch.Tensor, *, device: torch.device,
          batch: int = 64) -> float:
    """Teacher-forced CE (nats/byte) at the rows eval_layout scores: t ∈ [N/2, N). Given several models,
    the CE of their ensemble: the mean of their predicted probabilities, as SCE-S averages over seeds."""
    models = [model] if isinstance(model, ByteTransformer) else list(model)
    for m in models:
        m.eval()
    n = models[0].cfg.context
    rows = eval_layout(n, 1).positions.to(device)
    total, count = 0.0, 0
    for lo in range(0, len(windows), batch):
        w = windows[lo:lo + batch].to(device)
        tgt = w[:, 1:][:, rows]
        if len(models) == 1:
            logits = models[0](w[:, :-1])[:, rows]
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), tgt.reshape(-1), reduction="sum").item()
        else:
            logp = torch.stack([F.log_softmax(m(w[:, :-1])[:, rows].double(), dim=-1) for m in models])
            mean = logp.logsumexp(0) - math.log(len(models))  # (B, R, 256): ln of the mean probability
            total -= mean.gather(-1, tgt.unsqueeze(-1)).sum().item()
        count += tgt.numel()
    return total / count


def sce1_k1(blocks: Sequence[DiffusionBlock], test: ByteSource | bytes, windows: int, device: torch.device) -> float:
    """The one-number score the asynchrony benchmarks track: SCE-1 at K = 1 (nats/byte) with
    N_s = 2B+1 and readout LAST on `windows` held-out windows spread evenly over `test`."""
    cfg: ModelConfig = blocks[0].cfg
    w = eval_windows(test, cfg.context, windows)
    with torch.no_grad():
        return sampler_ce([b.to(device) for b in blocks], w, k=1, seeds=[0], n_steps=default_steps(cfg),
                          device=device, readout=Readout.LAST).sce1


def swarm_ce(units: Sequence[torch.nn.Module], test: ByteSource | bytes, windows: int, device: torch.device) -> float:
    """The CE of a swarm's published model on the same held-out windows and rows: SCE-1 at K = 1 for
    blocks, teacher-forced CE for the one AR model of a DiLoCo run (nats/byte)."""
    if len(units) == 1 and isinstance(units[0], ByteTransformer):
        model = units[0].to(device)
        with torch.no_grad():
            return ar_ce(model, eval_windows(test, model.cfg.context, windows), device=device)
    return sce1_k1(units, test, windows, device)  # type: ignore[arg-type]
