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


def train_interval(cfg: ModelConfig, block: int) -> tuple[float, float]:
    """(lo, hi) of the σ values block `block` trains on: its cell widened by α_b = (s_b/s_{b+1})^γ."""
    if not 0 <= block < cfg.n_blocks:
        raise ValueError(f"block {block} out of range for {cfg.n_blocks} blocks")
    s = partition(cfg)
    hi, lo = s[block], s[block + 1]
    alpha = (hi / lo) ** cfg.gamma
    return max(cfg.sigma_lo, lo / alpha), min(cfg.sigma_hi, hi * alpha)


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
