"""Updates summed as they arrive (issues #24, #25): one running sum per tensor, plus, for the
"senders" rule with sparse updates, the weight that reached each coordinate, whatever the number of
updates. A round of N updates then costs 8 bytes a parameter for the sum (4 more per parameter for
the "senders" weights once a sparse update is in), not 4·N for the updates held.

**Exact, so arrival order cannot matter.** Floating-point addition is not associative: a running
fp32 sum of the same updates in another order gives other bits, and every replica must apply the
one published version bit for bit, whoever pushed first. So each weighted value is rounded once, on
its own, to a fixed-point grid (2^-FRACTION_BITS of a weight unit) and summed as int64: integer
addition is exact and associative, the sum is the same in any order, and taking an update out again
(a failed audit, a drop at close) subtracts exactly what it added. The rounding error of one term is
below 2^-39 units; the mean's is below that over the mean weight, far below an fp32 ulp of any value
a delta holds. The grid bounds what one term may be (|value| · weight/unit ≤ MAX_TERM) and how many
terms a sum may take (MAX_TERMS): an update over either is refused before it touches the sum.

The mean of coordinate c, with w_i the update weights and S_c = Σ_i w_i·u_i,c:
  "all"      S_c / Σ_i w_i            every update counts at every coordinate, sent or not
  "senders"  S_c / Σ_{i sent c} w_i   only the updates that sent c (SparseLoCo's scatter-reduce mean)
For dense updates the two are the same. Which one a swarm uses, and whether updates are clipped to
the median norm first, is measured in bench/comms.py (docs/tuning.md).

`Sketcher`: what the robust screen (aggregate/round/block.py) keeps of each update instead of the update:
a SKETCH_SIZE-value random projection, in which inner products, and so cosines, are kept in
expectation (a count sketch: coordinate c adds ±u_c to bucket c mod SKETCH_SIZE, the sign drawn per
row from a per-round key the workers do not know).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping

import torch

from btnode.codec.frames import LazyDelta, absmax, each
from btnode.codec.sparse import SparseTensor
from btnode.errors import MalformedInput, Refused

Delta = Mapping[str, "torch.Tensor | SparseTensor"]
SPARSE_MEANS = ("senders", "all")
FRACTION_BITS = 38  # the sum's grid: 2^-38 of a weight unit
MAX_TERM = 2.0**10  # |value| · weight/unit of one term
MAX_TERMS = 2**13  # updates one sum may hold: MAX_TERM · 2^38 · 2^13 = 2^61 < 2^63
REACHED_BITS = 16  # the "senders" weights' grid (int32): 2^-16 of a unit, N · weight/unit < 2^15
SKETCH_SIZE = 4096
TERMS_AT_ONCE = 1 << 16  # values turned into terms at a time: 1 MiB of float64 and int64 buffers (cache-sized), whatever the tensor


def is_sparse(delta: Delta) -> bool:
    return any(isinstance(t, SparseTensor) for t in delta.values())


def dense(delta: Delta) -> dict[str, torch.Tensor]:
    return {n: t.dense() if isinstance(t, SparseTensor) else t for n, t in delta.items()}


def _stat(delta: Delta, n: str) -> tuple[float, float]:
    """(max |v|, ‖v‖₂) of tensor n, from what a LazyDelta took when it checked it (no decode again)."""
    known = delta.stat(n) if isinstance(delta, LazyDelta) else None
    if known is not None:
        return known
    t = delta[n]
    v = t.values if isinstance(t, SparseTensor) else t  # as the norm was always taken: same bits
    return absmax(v), float(torch.linalg.vector_norm(v))


def norm(delta: Delta) -> float:
    return math.sqrt(sum(_stat(delta, n)[1] ** 2 for n in delta))


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


def weight_unit(largest: float) -> float:
    """The power of two at or above the largest weight an honest update has: weights over it are
    exact dyadic fractions of it (samples × 0.5^staleness), so dividing by it rounds nothing."""
    return 2.0 ** math.ceil(math.log2(max(largest, 1.0)))


def _values(t: torch.Tensor | SparseTensor) -> torch.Tensor:
    return t.values if isinstance(t, SparseTensor) else t.reshape(-1)


class Accumulator:
    """Σ w·u over the updates added so far, exactly (fixed point), and the weight that reached each
    coordinate. `unit`: a power of two near the largest weight (weight_unit)."""

    def __init__(self, spec: Mapping[str, tuple[int, ...]], rule: str, *, unit: float = 1.0):
        if rule not in SPARSE_MEANS:
            raise ValueError(f"sparse mean must be one of {SPARSE_MEANS}, got {rule!r}")
        if unit <= 0 or math.frexp(unit)[0] != 0.5:
            raise ValueError(f"the weight unit must be a power of two, got {unit}")
        self.spec, self.rule, self.unit = dict(spec), rule, unit
        self.sum: dict[str, torch.Tensor] = {}  # int64, flat, 2^-FRACTION_BITS units
        self.reached: dict[str, torch.Tensor] = {}  # int32, flat, the sparse updates' weights ("senders")
        self.total = 0  # Σ weights, 2^-FRACTION_BITS units (exact: a Python int)
        self.dense_reached = 0  # Σ weights of dense updates, 2^-REACHED_BITS units
        self.count = 0

    def _scale(self, weight: float) -> float:
        return weight / self.unit * 2.0**FRACTION_BITS

    def check(self, delta: Delta, weight: float) -> None:
        """Refuse, before anything is added, an update the grid cannot hold."""
        if not 0 < weight / self.unit <= MAX_TERM:
            raise MalformedInput("range", f"weight {weight:g} is outside (0, {MAX_TERM:g}] × the unit {self.unit:g}")
        largest = max((_stat(delta, n)[0] for n in delta), default=0.0)
        if largest * weight / self.unit > MAX_TERM:
            raise MalformedInput("range", f"a value of {largest:.4g} at weight {weight:g} is over the sum's range "
                                          f"({MAX_TERM:g} × the unit {self.unit:g})")
        if self.count >= MAX_TERMS:
            raise Refused("round_full", f"a round sums at most {MAX_TERMS} updates")

    def add(self, delta: Delta, weight: float, *, also: Callable[[str, torch.Tensor | SparseTensor], None] | None = None
            ) -> None:
        """`also`: called with each tensor as it is summed (the screen's sketch: a lazy delta decoded once for both)."""
        self.check(delta, weight)
        self._apply(delta, weight, 1, also)

    def sub(self, delta: Delta, weight: float) -> None:
        """Take out an update added before with the same values and weight: exactly what it added."""
        self._apply(delta, weight, -1)

    def _apply(self, delta: Delta, weight: float, sign: int,
               also: Callable[[str, torch.Tensor | SparseTensor], None] | None = None) -> None:
        scale = self._scale(weight)
        sparse = False
        # one pair of slice buffers for the whole update, filled in place: fresh temporaries per slice cost
        # more than the arithmetic (allocation and page faults; issue #40)
        real = torch.empty(TERMS_AT_ONCE, dtype=torch.float64)
        whole = torch.empty(TERMS_AT_ONCE, dtype=torch.int64)
        for n, t in each(delta):  # a lazy delta's tensors decoded one at a time into one buffer
            if also is not None:
                also(n, t)
            acc = self.sum.get(n)
            if acc is None:
                acc = self.sum[n] = torch.zeros(math.prod(self.spec[n]), dtype=torch.int64)
            values = _values(t)
            for lo in range(0, values.numel(), TERMS_AT_ONCE):  # temporaries of a slice, not of the tensor
                hi = min(lo + TERMS_AT_ONCE, values.numel())
                x, terms = real[:hi - lo], whole[:hi - lo]
                x.copy_(values[lo:hi]).mul_(scale).round_()  # one rounding per term, order-free
                terms.copy_(x)
                if sign < 0:
                    terms.neg_()
                if isinstance(t, SparseTensor):
                    acc.index_add_(0, t.positions[lo:hi], terms)
                else:
                    acc[lo:hi].add_(terms)
            if isinstance(t, SparseTensor):
                sparse = True
                if self.rule == "senders":
                    reached = self.reached.get(n)
                    if reached is None:
                        reached = self.reached[n] = torch.zeros(math.prod(self.spec[n]), dtype=torch.int32)
                    reached.index_add_(0, t.positions, torch.full_like(t.positions, sign * self._reach(weight),
                                                                       dtype=torch.int32))
        self.total += sign * round(scale)
        if not sparse:  # known from the loop: asking is_sparse would read (decode) the delta again
            self.dense_reached += sign * self._reach(weight)
        self.count += sign

    def _reach(self, weight: float) -> int:
        return round(weight / self.unit * 2.0**REACHED_BITS)

    def mean_of(self, n: str, *, release: bool = False) -> torch.Tensor:
        """Tensor `n` of the weighted mean under the rule; 0 where nothing was sent. `release`: free
        that tensor's sum as it is read (a close that goes tensor by tensor holds one sum, not two)."""
        if not self.count:
            raise ValueError("nothing to combine")
        shape = self.spec[n]
        s = self.sum.pop(n, None) if release else self.sum.get(n)
        if s is None:
            return torch.zeros(shape)
        out = torch.empty(s.numel())
        reached = None
        if self.rule != "all" and n in self.reached:
            reached = self.reached.pop(n) if release else self.reached[n]
        for lo in range(0, s.numel(), TERMS_AT_ONCE):  # float64 temporaries of a slice, not of the tensor
            hi = lo + TERMS_AT_ONCE
            if reached is None:
                out[lo:hi] = (s[lo:hi].double() / float(self.total)).float()
                continue
            r = reached[lo:hi].double().add_(self.dense_reached).mul_(2.0 ** (FRACTION_BITS - REACHED_BITS))
            out[lo:hi] = torch.where(r > 0, s[lo:hi].double() / r.clamp(min=1.0),
                                     torch.zeros((), dtype=torch.float64)).float()
        return out.reshape(shape)

    def mean(self) -> dict[str, torch.Tensor]:
        return {n: self.mean_of(n) for n in self.spec}


class Sketcher:
    """Count sketches of updates under one key (aggregate/round/block.py keys one per round)."""

    def __init__(self, spec: Mapping[str, tuple[int, ...]], key: bytes, size: int = SKETCH_SIZE):
        self.size = size
        self.signs: dict[str, torch.Tensor] = {}
        for n, shape in spec.items():
            rows = -(-math.prod(shape) // size)
            seed = int.from_bytes(hashlib.sha256(key + n.encode()).digest()[:8], "little") & (2**63 - 1)
            g = torch.Generator().manual_seed(seed)
            self.signs[n] = torch.randint(0, 2, (rows,), generator=g).float().mul_(2).sub_(1)

    def empty(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float64)

    def of(self, delta: Delta) -> torch.Tensor:
        out = self.empty()
        for n, t in each(delta):
            self.add_into(out, n, t)
        return out

    def add_into(self, out: torch.Tensor, n: str, t: torch.Tensor | SparseTensor) -> None:
        """Tensor `n` of an update into its sketch `out` (`of`, a tensor at a time)."""
        k = self.size
        signs = self.signs[n]
        if isinstance(t, SparseTensor):
            out.index_add_(0, t.positions % k, (signs[t.positions // k] * t.values).double())
            return
        flat = t.reshape(-1)
        full = flat.numel() // k
        if full:
            out += (signs[:full] @ flat[:full * k].view(full, k)).double()
        if flat.numel() > full * k:
            rest = flat[full * k:]
            out[:rest.numel()] += (signs[full] * rest).double()
