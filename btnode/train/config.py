"""Local training settings: never part of the run fingerprint, free to differ between workers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from btnode.errors import ConfigError
from btnode.settings import flag


class Precision(str, Enum):
    """The arithmetic of a training step's forward pass and loss. Local, not swarm-wide: parameters,
    gradients, AdamW state and so the deltas a worker pushes stay fp32 either way, so the aggregator
    sees the same fp32 tensors from every worker and replicas of one swarm may differ."""

    FP32 = "fp32"  # the default: every step as it was before the flag existed, bit for bit
    BF16 = "bf16"  # autocast to bfloat16 around forward and loss (fp32 master weights)

    @classmethod
    def parse(cls, value: str) -> Precision:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"--precision must be one of {[p.value for p in cls]}, got {value!r}") from None


@dataclass(frozen=True)
class TrainConfig:
    batch: int = flag("--batch", "Windows per step.", default=32)  # windows per step
    lr: float = flag("--lr", "Peak AdamW learning rate (a swarm worker's inner optimizer).", default=2e-3)  # peak AdamW learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: int = flag("--warmup", "Warmup steps.", default=100)  # linear warmup, in this block's own steps
    steps: int = flag("--steps", "Optimizer steps per model (length of the LR schedule).", default=1000)  # length of the schedule, in this block's own steps
    weight_decay: float = 0.1  # on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables
    seed: int = flag("--seed", "Seed for initialisation, windows, σ and noise.", default=0)  # keys windows, σ, noise and initialisation
    # Probability of a K = 1 batch (the rest spread evenly over the other trained K); None: every K
    # equally often. 0.9 by default: K = 16 batches cost K = 1 quality (issue #10, BENCHMARKS.md notes).
    k1_share: float | None = flag("--k1-share", "Probability of a K=1 batch (the rest spread over the other trained K).",
                                  default=0.9)
    # Share of samples trained as the block's context readout (the null state z = 0 at σ_hi), which
    # the pooled readout uses: every block learns to read the context on its own (issue #10).
    ctx_share: float = flag("--ctx-share", "Share of samples trained as the block's context readout, z = 0 at σ_hi.",
                            default=0.25)
    # Share of a window's segments the noisy stream trains on per step (issue #42): the clean stream runs
    # over the whole window either way, so 0.25 cuts the noisy half of a step's cost by three quarters
    # (a block step 1.35–1.43× an AR-L step instead of 2.2–2.3×, with the head below). 1: every row.
    noisy_rows: float = flag("--noisy-rows", "Share of each window's segments the noisy stream trains on per step "
                             "(1: all; the clean stream always reads the whole window).", default=0.25)
    # Weight of the clean head's next-byte CE in a block's loss (ModelConfig.ctx_head = 1 only): 50 so that
    # it outweighs the λ(σ)-weighted noisy loss (λ ≈ 4–5); w5 / w20 / w50 / w100 at equal time: research.md.
    ctx_weight: float = flag("--ctx-weight", "Weight of the clean stream head's CE in a block's loss (--ctx-head 1).",
                             default=50.0)
    precision: Precision = flag("--precision", "Forward and loss arithmetic: fp32, or bf16 autocast (weights, optimizer "
                                "state and deltas stay fp32).", default=Precision.FP32, value=str,
                                format=lambda p: p.value)

    def __post_init__(self) -> None:
        if self.batch < 1 or self.steps < 1 or self.warmup < 0 or self.lr <= 0:
            raise ConfigError(f"invalid training settings: batch={self.batch}, steps={self.steps}, "
                              f"warmup={self.warmup}, lr={self.lr}")
        if self.k1_share is not None and not 0 <= self.k1_share <= 1:
            raise ConfigError(f"k1_share must be in [0, 1], got {self.k1_share}")
        if not 0 <= self.ctx_share < 1:
            raise ConfigError(f"ctx_share must be in [0, 1), got {self.ctx_share}")
        if not 0 < self.noisy_rows <= 1 or self.ctx_weight < 0:
            raise ConfigError(f"need 0 < noisy_rows ≤ 1 and ctx_weight ≥ 0, got {self.noisy_rows}, {self.ctx_weight}")
        try:  # a flag's or a caller's string → Precision
            object.__setattr__(self, "precision", Precision.parse(self.precision))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def segment_weights(self, segments: tuple[int, ...]) -> list[float]:
        """Sampling weight of each trained K (segments are sorted, so K = 1 comes first)."""
        if self.k1_share is None or len(segments) == 1:
            return [1.0] * len(segments)
        rest = (1 - self.k1_share) / (len(segments) - 1)
        return [self.k1_share] + [rest] * (len(segments) - 1)

    def lr_at(self, step: int) -> float:
        """Learning rate for 0-based `step`: linear warmup, then cosine to lr * min_lr_ratio."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
