"""Summing sparse updates as they arrive (issue #24): one dense running sum per tensor, plus, for the
"senders" rule, the weight that reached each coordinate, whatever the number of updates. A round of
N sparse updates at density d then costs 4 (or 8) bytes a parameter and 12·d·N bytes a parameter for
the updates themselves (held as SparseTensor for the screen and for audits that may drop one),
where holding them dense costs 4·N.

The mean of coordinate c, with w_i the update weights and S_c = Σ_i w_i·u_i,c:
  "all"      S_c / Σ_i w_i            every update counts at every coordinate, sent or not
  "senders"  S_c / Σ_{i sent c} w_i   only the updates that sent c (SparseLoCo's scatter-reduce mean)
For dense updates the two are the same. Which one a swarm uses, and whether updates are clipped to
the median norm first, is measured in bench/comms.py (docs/tuning.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from btnode.codec.sparse import SparseTensor

Delta = Mapping[str, "torch.Tensor | SparseTensor"]
SPARSE_MEANS = ("senders", "all")


def is_sparse(delta: Delta) -> bool:
    return any(isinstance(t, SparseTensor) for t in delta.values())


def dense(delta: Delta) -> dict[str, torch.Tensor]:
    return {n: t.dense() if isinstance(t, SparseTensor) else t for n, t in delta.items()}


def norm(delta: Delta) -> float:
    return math.sqrt(sum(float(torch.linalg.vector_norm(t.values if isinstance(t, SparseTensor) else t)) ** 2
                         for t in delta.values()))


def scaled(delta: Delta, factor: float) -> dict:
    return {n: t.scaled(factor) if isinstance(t, SparseTensor) else t * factor for n, t in delta.items()}


def dot(delta: Delta, full: Mapping[str, torch.Tensor]) -> float:
    """⟨delta, full⟩ with `full` dense: only the sent coordinates of a sparse delta are read."""
    total = 0.0
    for n, t in delta.items():
        if isinstance(t, SparseTensor):
            total += float((t.values * full[n].reshape(-1)[t.positions]).sum())
        else:
            total += float((t.reshape(-1) * full[n].reshape(-1)).sum())
    return total


class Accumulator:
    """Σ w·u over the updates added so far, and the weight that reached each coordinate."""

    def __init__(self, spec: Mapping[str, tuple[int, ...]], rule: str):
        if rule not in SPARSE_MEANS:
            raise ValueError(f"sparse mean must be one of {SPARSE_MEANS}, got {rule!r}")
        self.spec, self.rule = dict(spec), rule
        self.sum: dict[str, torch.Tensor] = {}
        self.reached: dict[str, torch.Tensor] = {}  # per coordinate ("senders"), flat
        self.total = 0.0
        self.count = 0

    def add(self, delta: Delta, weight: float) -> None:
        for n, t in delta.items():
            acc = self.sum.get(n)
            if acc is None:
                acc = self.sum[n] = torch.zeros(math.prod(self.spec[n]))
            if isinstance(t, SparseTensor):
                acc.index_add_(0, t.positions, t.values, alpha=weight)
            else:
                acc.add_(t.reshape(-1), alpha=weight)
            if self.rule == "senders":
                reached = self.reached.get(n)
                if reached is None:
                    reached = self.reached[n] = torch.zeros(math.prod(self.spec[n]))
                if isinstance(t, SparseTensor):
                    reached.index_add_(0, t.positions, torch.full_like(t.values, weight))
                else:
                    reached.add_(weight)
        self.total += weight
        self.count += 1

    def mean(self) -> dict[str, torch.Tensor]:
        """The weighted mean under the rule; 0 where nothing was sent."""
        if not self.count:
            raise ValueError("nothing to combine")
        out = {}
        for n, shape in self.spec.items():
            s = self.sum.get(n)
            if s is None:
                out[n] = torch.zeros(shape)
            elif self.rule == "all":
                out[n] = (s / self.total).reshape(shape)
            else:
                r = self.reached[n]
                out[n] = torch.where(r > 0, s / r.clamp(min=1e-30), torch.zeros_like(s)).reshape(shape)
        return out
