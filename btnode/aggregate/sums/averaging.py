"""How accepted deltas become one step (design §3.3): weighted mean (in mode "screened", the
default, of the updates the screen kept: round/screen.py), or a robust coordinate-wise trimmed mean /
median, then the outer step θ^{v+1} = θ^v + η·Δ̄, optionally with Nesterov momentum (a --model ar run:
η = 1, μ = 0.3, DILOCO_OUTER).

Deltas are combined in a fixed order (the caller sorts them by worker id) in fp32, so anyone
holding the same decoded updates can recompute the new version bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from btnode.errors import ConfigError
from btnode.settings import fill, flag

Tensors = dict[str, torch.Tensor]
ROBUST_MODES = ("mean", "screened", "trimmed", "median")


@dataclass(frozen=True)
class OuterConfig:
    lr: float = flag("--outer-lr", "η of the outer step (default 1, with --model ar too).", default=1.0,
                     optional=True)  # η: 1 with no momentum is plain averaging
    momentum: float = flag("--outer-momentum", "μ of Nesterov outer momentum, 0 = none (default 0; 0.3 with --model ar). "
                                               "Plain averaging: --outer-lr 1 --outer-momentum 0; the DiLoCo paper's "
                                               "step: --outer-lr 0.7 --outer-momentum 0.9.", default=0.0,
                           optional=True)  # μ: Nesterov outer momentum when > 0
    robust: str = flag("--robust", "screened | mean | trimmed | median (docs/security.md).",
                       default="screened")  # robust modes need ≥ 3 updates, else mean; screened: see round/screen.py screen
    trim: float = 0.2  # trimmed mode: fraction of updates dropped at each end, per coordinate

    def __post_init__(self) -> None:
        if self.robust not in ROBUST_MODES:
            raise ConfigError(f"robust mode must be one of {ROBUST_MODES}, got {self.robust!r}")
        if not (self.lr > 0 and 0 <= self.momentum < 1 and 0 <= self.trim < 0.5):
            raise ConfigError(f"need lr > 0, 0 ≤ momentum < 1, 0 ≤ trim < 0.5; got {self.lr}, {self.momentum}, {self.trim}")

    @classmethod
    def from_flags(cls, values: Mapping[str, Any]) -> OuterConfig:
        """Plain averaging (η = 1, μ = 0) for a block run, DILOCO_OUTER for --model ar;
        --outer-lr / --outer-momentum override either."""
        return fill(cls, values, base=DILOCO_OUTER if values.get("model") == "ar" else cls())


# The outer step of a --model ar run, where every worker pushes the delta of a full replica after H inner
# steps: Nesterov with η = 1, μ = 0.3. DiLoCo's own (Douillard et al. 2023: η = 0.7, μ = 0.9, the default
# until #40) was tuned at H = 500; in `python -m bench.comms` (30 rounds of H = 5, seeds 0-4) it left int8 at
# CE 2.68-2.85 against 2.56-2.60 with this step, 0.10-0.26 worse in every seed, and every sparse row +0.5 or
# worse, where this step keeps sparse2 at 2 % up / 4 % published within +0.02 of int8 (docs/tuning.md).
DILOCO_OUTER = OuterConfig(lr=1.0, momentum=0.3)
DILOCO_PAPER_OUTER = OuterConfig(lr=0.7, momentum=0.9)  # one flag away: --outer-lr 0.7 --outer-momentum 0.9


def weighted_mean(deltas: Sequence[Tensors], weights: Sequence[float]) -> Tensors:
    total = float(sum(weights))
    out = {}
    for name in deltas[0]:
        acc = torch.zeros_like(deltas[0][name])
        for d, w in zip(deltas, weights):
            acc += (w / total) * d[name]
        out[name] = acc
    return out


def trimmed_mean(deltas: Sequence[Tensors], trim: float) -> Tensors:
    """Per coordinate: sort the n values, drop ⌊trim·n⌋ (at least 1) from each end, average the rest."""
    n = len(deltas)
    k = max(1, int(trim * n))
    if n - 2 * k < 1:
        k = (n - 1) // 2
    return {name: torch.stack([d[name] for d in deltas]).sort(dim=0).values[k:n - k].mean(dim=0) for name in deltas[0]}


def median(deltas: Sequence[Tensors]) -> Tensors:
    """Coordinate-wise median (mean of the two middle values when n is even)."""
    n = len(deltas)
    out = {}
    for name in deltas[0]:
        s = torch.stack([d[name] for d in deltas]).sort(dim=0).values
        out[name] = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
    return out


def combine(deltas: Sequence[Tensors], weights: Sequence[float], cfg: OuterConfig) -> tuple[Tensors, str]:
    """(Δ̄, rule used). Robust rules apply only with at least 3 updates; trimmed and median ignore
    the weights; screened is the weighted mean (its screen ran before)."""
    if not deltas:
        raise ValueError("nothing to combine")
    if len(deltas) >= 3 and cfg.robust == "median":
        return median(deltas), "median"
    if len(deltas) >= 3 and cfg.robust == "trimmed":
        return trimmed_mean(deltas, cfg.trim), "trimmed"
    if len(deltas) >= 3 and cfg.robust == "screened":
        return weighted_mean(deltas, weights), "screened"
    return weighted_mean(deltas, weights), "mean"


class OuterOptimizer:
    """The outer step. State (momentum buffers) is saved with every version."""

    def __init__(self, cfg: OuterConfig):
        self.cfg = cfg
        self.buffers: Tensors = {}

    def step(self, mean_delta: Tensors) -> Tensors:
        """The step to add to θ^v."""
        lr, mu = self.cfg.lr, self.cfg.momentum
        if mu == 0:
            return {n: lr * d for n, d in mean_delta.items()}
        out = {}
        for n, d in mean_delta.items():
            m = self.buffers.get(n)
            m = d.clone() if m is None else mu * m + d
            self.buffers[n] = m
            out[n] = lr * (d + mu * m)  # Nesterov: look ahead along the updated momentum
        return out

    def state_dict(self) -> Tensors:
        return {n: b.clone() for n, b in self.buffers.items()}

    def load_state_dict(self, state: Tensors) -> None:
        self.buffers = {n: b.clone() for n, b in state.items()}
