"""What a push may claim (docs/security.md): its weight and the size of its delta follow from the
swarm's training settings, never from numbers the worker sends unchecked.

Weight. A push states the step of each batch it trained (`PushHeader.steps`). They must be
distinct and increasing (a worker's steps only grow; a jump is allowed, since a worker that catches
up moves its schedule to version × H), at least one and at most `max_steps` = 2H: an accepted
update holds exactly H steps, and one refused update folds into the next with at most H wait steps
(swarm.fold.Fold.refused drops a fold that would exceed it). Its `samples` must equal
len(steps) × batch, and that is its weight. A push without steps (an older worker) is refused.

Size. An element-wise bound from the settings alone, so it holds from round 0 with no history:

AdamW (torch's, decoupled) moves a coordinate per step by −lr·(m̂/(√v̂+ε) + wd·θ). With
m_t = (1−β1)Σ_k β1^(t−k) g_k and v_t = (1−β2)Σ_k β2^(t−k) g_k², Cauchy–Schwarz over k gives
(Σ β1^j |g|)² ≤ Σ (β1²/β2)^j · Σ β2^j g², hence, bias corrections included,
|m̂_t/√v̂_t| ≤ (1−β1)/(1−β1^t) · √((1−β2^t)/(1−β2)) · √((1−γ^t)/(1−γ)), γ = β1²/β2 < 1.
That grows with t (1 at t = 1) towards c = (1−β1)/√((1−β2)(1−γ)): 1.165 for β = (0.9, 0.95).
ε > 0 only shrinks it; clipping scales g, which the ratio does not see. So the Adam part of K
steps is at most c·S with S = Σ lr_t ≤ K·lr (the peak: the schedule's position is local).
Weight decay (matrices only, as train.trainers.make_optimizer) adds lr_t·wd·|θ| per step, with
|θ| ≤ |θ^now| + (2 + s)·cS, θ^now the block's current version (the one the aggregator holds):
the update's own moves, one round's published move (≤ cS under plain averaging) for the fold's
carry measured on the previous trajectory, and s more for an update based s versions back. A lossy codec adds the error-feedback residual of the previous update: at most
half a quantisation step of a frame that was itself within bound, ≤ B/254 for int8 (absmax/127
per group), less for bf16; and decoding may round the largest value up by 2⁻⁸ (bf16).
A sparse codec (codec/sparse.py) sends only the top of Δ + β·e and keeps the rest, so a coordinate
may wait many rounds and then be sent with all it piled up: with decay β the residual is at most
β/(1−β) rounds' bounds (19 at β = 0.95), and that much more is allowed. It is a wide bound; the
screen's norm band (aggregate/round/block.py) is what keeps such an update's size honest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from btnode.codec.codecs import Codec
from btnode.codec.sparse import SparseTensor
from btnode.errors import ConfigError, MalformedInput
from btnode.protocol import PushHeader, RoundSize, format_steps
from btnode.settings import flag, same_flag
from btnode.train.config import TrainConfig
from btnode.train.terms import TrainingTerms

Tensors = Mapping[str, torch.Tensor]
SWARM_WIDE = ("batch", "lr", "steps_per_round", "beta1", "beta2", "weight_decay")  # what Join compares
LOSSY_SLACK = 1 / 254  # the residual a lossy codec carries: half an int8 step of the largest value
ROUNDING = 2.0**-8  # a decoded bf16 value may exceed its source by this share
# A relay's combined update is bounded as the loosest dense child could be: a weighted mean of
# values each within its own bound stays within the largest (relays take dense codecs only).
RELAYED_CODEC = Codec.INT8
CHECK_AT_ONCE = 1 << 20  # values bounded and compared at a time: two 4 MiB buffers, whatever the tensor


@dataclass(frozen=True)
class ClaimConfig:
    """The swarm's training settings the aggregator judges claims by: the same flags a worker trains
    with (`btnode swarm` hands both the same values), so an honest worker's claims always fit."""

    batch: int = same_flag(TrainConfig, "batch")
    lr: float = same_flag(TrainConfig, "lr")
    steps_per_round: int = same_flag(RoundSize, "steps_per_round")  # H
    beta1: float = TrainConfig.beta1  # AdamW's: no flag sets them, so every worker has these
    beta2: float = TrainConfig.beta2
    weight_decay: float = TrainConfig.weight_decay
    enforce: bool = flag("--check-claims/--believe-claims",
                         "Derive each push's weight from the steps it lists and the swarm's --batch, and bound its "
                         "delta by --lr and --steps-per-round from round 0 (rejected/claim, rejected/bound; "
                         "docs/security.md); refuse at Join a worker that trains with other values of the three "
                         "(join_refused/training). --believe-claims: take the weight a push states.",
                         default=True)

    def __post_init__(self) -> None:
        if self.batch < 1 or self.steps_per_round < 1 or not self.lr > 0 or not self.beta1**2 < self.beta2 < 1:
            raise ConfigError(f"invalid claim settings: {self}")

    def differences(self, terms: TrainingTerms) -> list[tuple[str, object, object]]:
        """The swarm-wide training settings in which a worker's stated terms differ from the swarm's,
        as (name, ours, theirs): each would make its honest claims fail."""
        theirs = {n: getattr(terms, n) if n == "steps_per_round" else getattr(terms.train, n) for n in SWARM_WIDE}
        return [(n, getattr(self, n), theirs[n]) for n in SWARM_WIDE if getattr(self, n) != theirs[n]]

    @property
    def max_steps(self) -> int:
        """The most steps one update may hold: H, plus H wait steps of one refused update folded in."""
        return 2 * self.steps_per_round

    @property
    def adam_ratio(self) -> float:
        """c: the most AdamW's |m̂/(√v̂+ε)| can be at any step (module doc)."""
        gamma = self.beta1**2 / self.beta2
        return (1 - self.beta1) / math.sqrt((1 - self.beta2) * (1 - gamma))

    def weight(self, header: PushHeader) -> float:
        """The update's weight, len(steps) × batch, once its claim holds; MalformedInput("claim") if not."""
        steps = header.steps
        if not steps:
            raise MalformedInput("claim", f"{header.worker_id} states no steps: its weight cannot be derived")
        if not 1 <= len(steps) <= self.max_steps or steps[0] < 0 or any(b <= a for a, b in zip(steps, steps[1:])):
            raise MalformedInput("claim", f"{header.worker_id} claims steps {format_steps(steps)}: they must be 1 to "
                                          f"{self.max_steps} distinct increasing step numbers (H = {self.steps_per_round})")
        samples = len(steps) * self.batch
        if header.samples != samples:
            raise MalformedInput("claim", f"{header.worker_id} claims {header.samples:g} samples for {len(steps)} steps; "
                                          f"the swarm's batch of {self.batch} makes {samples}")
        return float(samples)

    def manifest_weight(self, header: PushHeader) -> float:
        """A relay's combined push: each child's weight at most what a claim allows (max_steps × batch),
        and the header's weight their sum. Which children may be listed is the root's check
        (aggregate/trust/manifests.py); this one needs only the swarm's settings."""
        top = self.max_steps * self.batch
        for e in header.manifest:
            if e.weight > top:
                raise MalformedInput("manifest", f"{header.worker_id} lists {e.worker_id} with weight {e.weight:g}; a "
                                                 f"claim allows at most {top} ({self.max_steps} steps of {self.batch})")
        return header.samples

    def manifest_steps(self, header: PushHeader) -> int:
        """The most steps any listed child may have trained: its weight over the batch, rounded up."""
        return max(min(self.max_steps, math.ceil(e.weight / self.batch - 1e-9)) for e in header.manifest)

    def bound(self, steps: int, theta: Tensors, codec: Codec, *, drift: int = 2) -> dict[str, torch.Tensor]:
        """The most each coordinate of an update of `steps` steps may move, θ the block's current
        version and `drift` the rounds of moves |θ| may be away from it (module doc)."""
        slack = self._slack(theta_ranges(theta), codec, drift)
        if codec.sparse:
            return {n: self._sparse_bound(steps, t.reshape(-1), t.ndim >= 2, slack, drift, codec).view(t.shape)
                    for n, t in theta.items()}
        return {n: self._bound_into(torch.empty_like(t), steps, t, slack, drift) for n, t in theta.items()}

    def _sparse_bound(self, steps: int, theta_at: torch.Tensor, matrix: bool, slack: float, drift: int,
                      codec: Codec) -> torch.Tensor:
        """A sparse codec's bound at the values `theta_at` of one tensor (a matrix's or not; flat): this
        update's limit plus the residual it may have piled up, β/(1−β) rounds' limits (module doc)."""
        piled = codec.ef_decay / (1 - codec.ef_decay)
        t = theta_at.view(1, -1) if matrix else theta_at  # _limit tells matrices (weight decay) by ndim
        limit = self._limit(steps, t, drift) + piled * self._limit(self.max_steps, t, drift)
        return ((limit + slack) * (1 + ROUNDING)).reshape(-1)

    def _slack(self, ranges: Mapping[str, Range], codec: Codec, drift: int) -> float:
        """What a lossy codec may add to any coordinate: LOSSY_SLACK of the largest matrix entry's limit."""
        if codec is Codec.FP32:
            return 0.0
        top = max((max(-r.lo, r.hi) for r in ranges.values() if r.matrix and r.numel), default=0.0)
        return LOSSY_SLACK * float(self._limit(self.max_steps, torch.tensor([[top]]), drift).max())

    def _bound_into(self, out: torch.Tensor, steps: int, theta: torch.Tensor, slack: float, drift: int) -> torch.Tensor:
        """(_limit + slack) × (1 + ROUNDING) for one tensor, written into `out`: the same float operations
        in the same order, without a temporary per operation (at 50 MB a tensor, fresh memory's page
        faults cost more than the arithmetic)."""
        adam = self.adam_ratio * steps * self.lr
        if theta.ndim < 2:
            out.fill_(adam)
        else:
            torch.abs(theta, out=out).add_(drift * adam).mul_(self.weight_decay * steps * self.lr).add_(adam)
        return out.add_(slack).mul_(1 + ROUNDING)

    def _least(self, steps: int, r: Range, slack: float, drift: int) -> float:
        """The smallest of one tensor's bounds: its bound at min |θ|, as every operation of the bound is
        monotone in |θ| (float rounding too: adds and multiplies by non-negative constants)."""
        if not r.matrix:  # the bound does not depend on θ (its value is unused)
            return float(self._bound_into(torch.empty(1), steps, torch.zeros(1), slack, drift))
        least = r.lo if r.lo > 0 else -r.hi if r.hi < 0 else 0.0
        return float(self._bound_into(torch.empty(1, 1), steps, torch.tensor([[least]]), slack, drift))

    def _limit(self, steps: int, theta: torch.Tensor, drift: int) -> torch.Tensor:
        """Adam's part plus weight decay's (matrices only) for one tensor, before any codec."""
        adam = self.adam_ratio * steps * self.lr
        if theta.ndim < 2:
            return torch.full_like(theta, adam)
        return adam + self.weight_decay * steps * self.lr * (theta.abs() + drift * adam)

    def check(self, header: PushHeader, delta: Mapping[str, torch.Tensor | SparseTensor], theta: Tensors, *,
              drift: int = 2, ranges: Mapping[str, Range] | None = None) -> float:
        """The update's weight if its claim and its size hold; MalformedInput("claim" / "bound") if not.
        Not enforced (`--believe-claims`): the weight the header states. A tensor whose largest move is
        within its least bound passes without the coordinate-wise check, and without reading θ; the
        others have their bounds built in one buffer reused for all (as `bound` computes them).
        `ranges`: `theta_ranges(theta)`, which a block keeps per version (None: taken here)."""
        if not self.enforce:
            return header.samples
        codec = header.codec
        if header.manifest:  # a relay's combined update: a weighted mean of dense children (aggregate/relay/forward.py)
            weight, steps, codec = self.manifest_weight(header), self.manifest_steps(header), RELAYED_CODEC
        else:
            weight, steps = self.weight(header), len(header.steps)
        ranges = theta_ranges(theta) if ranges is None else ranges
        slack = self._slack(ranges, codec, drift)
        limit_buf = over_buf = None
        known = getattr(delta, "stat", None)  # a LazyDelta's (max |v|, ‖v‖₂), taken when it was checked
        for n in delta:
            if codec.sparse:  # only the sent coordinates moved, by up to a piled-up residual
                self._check_sparse(header, n, delta[n], theta, ranges[n].matrix, slack, drift)
                continue
            stat = known(n) if known is not None else None
            if ranges[n].numel == 0 or (stat[0] if stat is not None else _absmax(delta[n])) <= self._least(
                    steps, ranges[n], slack, drift):
                continue  # (a lazy delta's tensor is not decoded for its largest move)
            d = delta[n]
            theta_n = theta[n]  # once: θ may be read from its file a tensor at a time (store/theta.py)
            at_once = min(theta_n.numel(), CHECK_AT_ONCE)
            if limit_buf is None or over_buf is None or limit_buf.numel() < at_once:  # grown to the largest tensor
                limit_buf, over_buf = torch.empty(at_once), torch.empty(at_once)
            flat_d, flat_t = d.reshape(-1), theta_n.reshape(-1)
            for lo in range(0, d.numel(), CHECK_AT_ONCE):  # a slice at a time: the same float operations per value
                t = flat_t[lo:lo + CHECK_AT_ONCE]
                t = t.view(1, -1) if theta_n.ndim >= 2 else t  # _bound_into tells matrices by ndim
                k = t.numel()
                limit = self._bound_into(limit_buf[:k].view(t.shape), steps, t, slack, drift)
                over = torch.abs(flat_d[lo:lo + k].view(t.shape), out=over_buf[:k].view(t.shape)).sub_(limit)
                if bool((over > 0).any()):
                    j = int(over.argmax())
                    raise MalformedInput("bound", f"{header.worker_id}: {n}[{lo + j}] moved {float(flat_d[lo + j]):.4g}, "
                                                  f"over the {float(limit.flatten()[j]):.4g} that {steps} AdamW steps "
                                                  f"at lr {self.lr:g} can move it")
        return weight

    def _check_sparse(self, header: PushHeader, name: str, d: torch.Tensor | SparseTensor, theta: Tensors,
                      matrix: bool, slack: float, drift: int) -> None:
        """θ is read at the sent positions only (`at`): a θ held in its file is not read whole per push."""
        if isinstance(d, SparseTensor):
            moved, where = d.values, d.positions
            theta_at = at(theta, name, where)
        else:
            moved, where = d.reshape(-1), None
            theta_at = theta[name].reshape(-1)
        limit = self._sparse_bound(len(header.steps), theta_at, matrix, slack, drift, header.codec)
        over = moved.abs() - limit
        if bool((over > 0).any()):
            j = int(over.argmax())
            i = j if where is None else int(where[j])
            raise MalformedInput("bound", f"{header.worker_id}: {name}[{i}] moved {float(moved[j]):.4g}, over the "
                                          f"{float(limit[j]):.4g} that {len(header.steps)} AdamW steps at lr "
                                          f"{self.lr:g} and a sparse codec's residual can move it")

    @classmethod
    def of(cls, tc: TrainConfig, steps_per_round: int, *, enforce: bool = True) -> ClaimConfig:
        """The claims a worker with these settings makes, checked: what tests and in-process swarms pass."""
        return cls(batch=tc.batch, lr=tc.lr, steps_per_round=steps_per_round, beta1=tc.beta1, beta2=tc.beta2,
                   weight_decay=tc.weight_decay, enforce=enforce)


@dataclass(frozen=True)
class Range:
    """What the claims bound needs of one tensor of θ besides its values: whether it is a matrix (weight
    decay applies), its size, and its smallest and largest entries."""

    matrix: bool
    numel: int
    lo: float
    hi: float


def theta_ranges(theta: Tensors) -> dict[str, Range]:
    """Each tensor's Range, one pass over θ. A block keeps them per version (aggregate/round/block.py): before,
    each push read θ twice for them (the lossy slack's largest entry, each tensor's least bound): with the
    delta's own pass, aminmax was a visible share of a relay's CPU (perf; docs/research.md), and for a unit with θ
    in its file, two reads of that file a push."""
    out = {}
    for n, t in theta.items():
        lo, hi = (float(v) for v in torch.aminmax(t)) if t.numel() else (0.0, 0.0)
        out[n] = Range(matrix=t.ndim >= 2, numel=t.numel(), lo=lo, hi=hi)
    return out


def at(theta: Tensors, name: str, where: torch.Tensor) -> torch.Tensor:
    """θ[name] at the flat positions `where`: from its file's pages where θ is in a file (store/theta.FileTheta
    .gather; a sparse push's claims check read 4 bytes a parameter per push before), else from memory."""
    gather = getattr(theta, "gather", None)
    return gather(name, where) if gather is not None else theta[name].reshape(-1)[where]


def _absmax(t: torch.Tensor) -> float:
    """max |t| without a tensor of |t| (NaN if t holds one)."""
    lo, hi = torch.aminmax(t)
    return max(-float(lo), float(hi)) if not (lo.isnan() or hi.isnan()) else math.nan
