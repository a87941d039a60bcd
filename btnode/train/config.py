"""Local training settings: never part of the run fingerprint, free to differ between workers."""

from __future__ import annotations

import math
from dataclasses import dataclass

from btnode.errors import ConfigError


@dataclass(frozen=True)
class TrainConfig:
    batch: int = 32  # windows per step
    lr: float = 2e-3  # peak AdamW learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: int = 100  # linear warmup, in this block's own steps
    steps: int = 1000  # length of the schedule, in this block's own steps
    weight_decay: float = 0.1  # on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables
    seed: int = 0  # keys windows, σ, noise and initialisation

    def __post_init__(self) -> None:
        if self.batch < 1 or self.steps < 1 or self.warmup < 0 or self.lr <= 0:
            raise ConfigError(f"invalid training settings: batch={self.batch}, steps={self.steps}, "
                              f"warmup={self.warmup}, lr={self.lr}")

    def lr_at(self, step: int) -> float:
        """Learning rate for 0-based `step`: linear warmup, then cosine to lr * min_lr_ratio."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
