"""Noise levels: the equal-probability block partition, per-block σ sampling, EDM scalings, the
sampler grid and index routing (design §2.2, §2.5, §2.6).

Everything is measured in "Φ-space": q(σ) = Φ((ln σ − P_mean)/P_std), the CDF of the training
density. Boundaries and grid points are computed in float64 so every host gets the same floats.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

from btnode.model.config import ModelConfig

_STD_NORMAL = NormalDist()
LAMBDA_MAX = 20.0  # λ(σ) is 4–5 on [1, 10]; the clamp only matters for configs with small σ


def _q(cfg: ModelConfig, sigma: float) -> float:
    return _STD_NORMAL.cdf((math.log(sigma) - cfg.p_mean) / cfg.p_std)


def _sigma_at(cfg: ModelConfig, q: float) -> float:
    return math.exp(cfg.p_mean + cfg.p_std * _STD_NORMAL.inv_cdf(q))


def _q_at_fraction(cfg: ModelConfig, frac: float) -> float:
    q_lo, q_hi = _q(cfg, cfg.sigma_lo), _q(cfg, cfg.sigma_hi)
    return q_hi - frac * (q_hi - q_lo)


def partition(cfg: ModelConfig) -> list[float]:
    """Boundaries s_0 = σ_hi > s_1 > … > s_B = σ_lo; block b owns [s_{b+1}, s_b]."""
    B = cfg.n_blocks
    inner = [_sigma_at(cfg, _q_at_fraction(cfg, k / B)) for k in range(1, B)]
    return [cfg.sigma_hi, *inner, cfg.sigma_lo]  # exact ends, no round-trip error


def _span_q_fraction(cfg: ModelConfig, top: float, bottom: float, frac: float) -> float:
    q_top, q_bottom = _q(cfg, top), _q(cfg, bottom)
    return q_top - frac * (q_top - q_bottom)


def tail_partition(cfg: ModelConfig) -> list[float]:
    """Boundaries of the tail blocks, σ_lo = t_0 > t_1 > … > t_T = σ_gen (equal training mass each);
    tail block j (block B + j) owns [t_{j+1}, t_j]. Empty without a tail."""
    T = cfg.tail_blocks
    if T == 0:
        return []
    inner = [_sigma_at(cfg, _span_q_fraction(cfg, cfg.sigma_lo, cfg.sigma_gen, k / T)) for k in range(1, T)]
    return [cfg.sigma_lo, *inner, cfg.sigma_gen]


def train_interval(cfg: ModelConfig, block: int) -> tuple[float, float]:
    """(lo, hi) of the σ values block `block` trains on: its cell widened by α_b = (s_b/s_{b+1})^γ.
    Scoring blocks stay inside [σ_lo, σ_hi]; tail blocks inside [σ_gen, σ_lo]."""
    if not 0 <= block < cfg.total_blocks:
        raise ValueError(f"block {block} out of range for {cfg.total_blocks} blocks")
    if cfg.is_tail(block):
        s, j, floor, ceil = tail_partition(cfg), block - cfg.n_blocks, cfg.sigma_gen, cfg.sigma_lo
    else:
        s, j, floor, ceil = partition(cfg), block, cfg.sigma_lo, cfg.sigma_hi
    hi, lo = s[j], s[j + 1]
    alpha = (hi / lo) ** cfg.gamma
    return max(floor, lo / alpha), min(ceil, hi * alpha)


def sample_sigma(cfg: ModelConfig, block: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """n draws from the truncated log-normal restricted to the block's training interval (fp32, CPU)."""
    lo, hi = train_interval(cfg, block)
    u_lo, u_hi = _q(cfg, lo), _q(cfg, hi)
    u = u_lo + (u_hi - u_lo) * torch.rand(n, generator=generator, dtype=torch.float64)
    return torch.exp(cfg.p_mean + cfg.p_std * torch.special.ndtri(u)).float()


def c_in(cfg: ModelConfig, sigma: torch.Tensor) -> torch.Tensor:
    """EDM input scaling 1/√(σ² + σ_d²)."""
    return torch.rsqrt(sigma**2 + cfg.sigma_data**2)


def c_noise(sigma: torch.Tensor) -> torch.Tensor:
    """EDM noise conditioning ¼·ln σ."""
    return 0.25 * torch.log(sigma)


def loss_weight(cfg: ModelConfig, sigma: torch.Tensor) -> torch.Tensor:
    """EDM weight λ(σ) = (σ² + σ_d²)/(σ·σ_d)², clamped at LAMBDA_MAX."""
    sd = cfg.sigma_data
    return ((sigma**2 + sd**2) / (sigma * sd) ** 2).clamp(max=LAMBDA_MAX)


def sigma_grid(cfg: ModelConfig, n_steps: int) -> list[float]:
    """n_steps points from σ_hi down to σ_lo, equally spaced in Φ-space (float64)."""
    if n_steps < 2:
        raise ValueError(f"the sampler needs at least 2 grid points, got {n_steps}")
    inner = [_sigma_at(cfg, _q_at_fraction(cfg, i / (n_steps - 1))) for i in range(1, n_steps - 1)]
    return [cfg.sigma_hi, *inner, cfg.sigma_lo]


def tail_grid(cfg: ModelConfig, n_tail: int) -> list[float]:
    """The n_tail grid points generation adds below σ_lo, equally spaced in Φ-space down to σ_gen
    (σ_lo itself is the scoring chain's last point and is not repeated)."""
    if n_tail < 0 or (n_tail and not cfg.tail_blocks):
        raise ValueError(f"{n_tail} tail steps for a model with {cfg.tail_blocks} tail blocks")
    inner = [_sigma_at(cfg, _span_q_fraction(cfg, cfg.sigma_lo, cfg.sigma_gen, i / n_tail)) for i in range(1, n_tail)]
    return [*inner, cfg.sigma_gen] if n_tail else []


def generation_grid(cfg: ModelConfig, n_steps: int, n_tail: int = 0) -> list[float]:
    """The scoring grid (n_steps points, σ_hi … σ_lo) followed by n_tail points below σ_lo."""
    return sigma_grid(cfg, n_steps) + tail_grid(cfg, n_tail)


def generation_route(cfg: ModelConfig, n_steps: int, n_tail: int = 0) -> list[int]:
    """Owner of every point of `generation_grid`: the scoring route, then the tail blocks' route."""
    owners = route(cfg.n_blocks, n_steps)
    if n_tail:
        if n_tail < cfg.tail_blocks:
            raise ValueError(f"{n_tail} tail steps cannot visit all {cfg.tail_blocks} tail blocks")
        owners += [cfg.n_blocks + min(cfg.tail_blocks - 1, (i * cfg.tail_blocks) // n_tail) for i in range(n_tail)]
    return owners


def route(n_blocks: int, n_steps: int) -> list[int]:
    """Which block evaluates each grid point, by index: min(B − 1, ⌊i·B/(N_s − 1)⌋).

    Integer arithmetic only: comparing floats against boundaries is how a public port ended up
    never calling its middle block.
    """
    if n_steps < 2:
        raise ValueError(f"the sampler needs at least 2 grid points, got {n_steps}")
    return [min(n_blocks - 1, (i * n_blocks) // (n_steps - 1)) for i in range(n_steps)]


def default_steps(cfg: ModelConfig) -> int:
    """N_s = 2B + 1: every block gets at least two evaluations, and boundaries fall on grid points."""
    return 2 * cfg.n_blocks + 1
