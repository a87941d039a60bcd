"""The one-sweep sampler (design §2.6): Euler steps on expected embeddings over a Φ-spaced σ grid,
each grid point evaluated by the block that owns it (routed by index).

The sweep is written as a chain of spans: `run_span` is what one block (one serving stage) does
with the state it receives, so the same code runs locally here and across a chain of stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from btnode.model.block import ContextCache, DiffusionBlock
from btnode.model.layout import Layout, RowLayout
from btnode.model.config import ModelConfig
from btnode.model.noise import generation_grid, generation_route, route
from btnode.model.readout import DEFAULT_READOUT, Readout, check_sweep_readout

Denoiser = Callable[[torch.Tensor, float], torch.Tensor]  # (z, σ) → logits


def euler_update(z: torch.Tensor, logits: torch.Tensor, table: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """D = softmax(logits)·E;  z ← D + (σ_{i+1}/σ_i)·(z − D)."""
    d = torch.softmax(logits.float(), dim=-1) @ table  # (B, T, C) expected embedding
    return d + (sigma_next / sigma) * (z - d)


def run_span(denoise: Denoiser, z: torch.Tensor, grid: Sequence[float], steps: Sequence[int],
             table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run grid points `steps` (consecutive indices) on state z.

    Every point but the last grid point is an Euler step; the last grid point returns the output
    logits instead. Returns (z, logits or None).
    """
    last = len(grid) - 1
    for i in steps:
        logits = denoise(z, grid[i])
        if i == last:
            return z, logits
        z = euler_update(z, logits, table, grid[i], grid[i + 1])
    return z, None


def spans(n_blocks: int, n_steps: int) -> list[list[int]]:
    """The grid indices each block runs, in chain order: spans(3, 7) = [[0, 1], [2, 3], [4, 5, 6]]."""
    return spans_of(route(n_blocks, n_steps))


def spans_of(owner: Sequence[int]) -> list[list[int]]:
    """Grid indices per block from the owner of every grid point (blocks 0 … max owner)."""
    return [[i for i, b in enumerate(owner) if b == block] for block in range(max(owner) + 1)]


def generation_spans(cfg: ModelConfig, n_steps: int, n_tail: int = 0) -> list[list[int]]:
    """The grid indices each block of a generation sweep runs: the scoring blocks' spans, then
    (with n_tail > 0) the tail blocks' spans over the points below σ_lo."""
    return spans_of(generation_route(cfg, n_steps, n_tail))


def block_denoiser(block: DiffusionBlock, cache: ContextCache, layout: Layout) -> Denoiser:
    def denoise(z: torch.Tensor, sigma: float) -> torch.Tensor:
        return block.denoise(z, torch.full((z.shape[0],), sigma, device=z.device), cache, layout)

    return denoise


@torch.no_grad()
def sweep_trace(blocks: Sequence[DiffusionBlock], caches: Sequence[ContextCache], z: torch.Tensor,
                grid: Sequence[float], layout: Layout, table: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """Every evaluation of one sweep, in grid order: (block index, logits). The last entry is the
    plain readout at σ_lo; the others are what pooled readouts combine."""
    trace: list[tuple[int, torch.Tensor]] = []
    for b, (block, cache, span) in enumerate(zip(blocks, caches, spans(len(blocks), len(grid)))):
        denoise = block_denoiser(block, cache, layout)

        def recorded(z: torch.Tensor, sigma: float, denoise: Denoiser = denoise, b: int = b) -> torch.Tensor:
            logits = denoise(z, sigma)
            trace.append((b, logits))
            return logits

        z, _ = run_span(recorded, z, grid, span, table)
    return trace


def context_logits(block: DiffusionBlock, cache: ContextCache, layout: Layout | RowLayout) -> torch.Tensor:
    """The block's own reading of the context: its prediction from the null state (z = 0) at σ_hi,
    what a block trained with `TrainConfig.ctx_share` learns; with ModelConfig.ctx_head, for rows that
    predict the byte right after their context, the clean stream's own head. Deterministic."""
    if block.ctx_head is not None:  # ModelConfig.ctx_head: rows right after their context read the clean head
        ends = layout.context_end.expand(cache.batch, -1) if layout.context_end.dim() == 1 else layout.context_end
        clean = block.clean_logits(cache.out.gather(1, ends[..., None].expand(-1, -1, cache.out.shape[-1])))
        if bool((layout.offsets == 0).all()):
            return clean
    sigma = torch.full((cache.batch,), block.cfg.sigma_hi, device=cache.out.device)
    z = torch.zeros(cache.batch, layout.positions.shape[-1], block.cfg.d_model, device=cache.out.device)
    noisy = block.denoise(z, sigma, cache, layout)
    if block.ctx_head is None:
        return noisy
    return torch.where((layout.offsets == 0)[..., None], clean, noisy)  # rows further ahead: the noisy stream at z = 0


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def pool(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Log-linear pooling with equal weights: mean of log-probabilities (a valid logit vector).
    Summed in order and divided once, exactly as the serving stages accumulate it hop by hop."""
    total = log_probs(parts[0])
    for p in parts[1:]:
        total = total + log_probs(p)
    return total / len(parts)


@torch.no_grad()
def sweep(blocks: Sequence[DiffusionBlock], caches: Sequence[ContextCache], z: torch.Tensor,
          grid: Sequence[float], layout: Layout, table: torch.Tensor,
          readout: Readout = DEFAULT_READOUT) -> torch.Tensor:
    """One full sweep from state z at grid[0] to output logits; every block runs its span.

    Readout.LAST: the last evaluation at σ_lo (the design's readout). Readout.POOL (the default):
    the last evaluation pooled with every block's `context_logits`, so that the chain is at least an
    ensemble of its blocks; each stage adds its own block's term, so pooling costs no extra traversal.
    """
    readout = check_sweep_readout(readout)
    logits = None
    for block, cache, span in zip(blocks, caches, spans(len(blocks), len(grid))):
        z, logits = run_span(block_denoiser(block, cache, layout), z, grid, span, table)
    assert logits is not None, "the last block must evaluate the last grid point"
    if readout is Readout.POOL:
        return pool([*(context_logits(b, c, layout) for b, c in zip(blocks, caches)), logits])
    return logits


@torch.no_grad()
def generation_sweep(blocks: Sequence[DiffusionBlock], caches: Sequence[ContextCache], z: torch.Tensor,
                     n_steps: int, n_tail: int, layout: Layout, table: torch.Tensor) -> torch.Tensor:
    """A sweep that continues below σ_lo through the tail blocks (blocks[B:]) and returns the last
    evaluation at σ_gen: the joint sample of a segment. No pooling: the pooled readout averages
    per-position context marginals, which is what the tail exists to go beyond."""
    cfg = blocks[0].cfg
    grid = generation_grid(cfg, n_steps, n_tail)
    parts = generation_spans(cfg, n_steps, n_tail)
    if len(blocks) != len(parts):
        raise ValueError(f"a sweep with {n_tail} tail steps runs {len(parts)} blocks, got {len(blocks)}")
    logits = None
    for block, cache, span in zip(blocks, caches, parts):
        z, logits = run_span(block_denoiser(block, cache, layout), z, grid, span, table)
    assert logits is not None
    return logits
