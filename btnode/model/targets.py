"""The fixed target table E (design §2.1): Gaussian rows from the run seed, each of unit L2 norm.

E is never trained and is identical on every host, so no parameter is shared between blocks.
It is generated on the CPU in float32 so that every host, GPU or not, gets the same bits.
"""

from __future__ import annotations

import hashlib

import torch

from btnode.model.config import ModelConfig


def target_table(cfg: ModelConfig) -> torch.Tensor:
    """(V, d) float32 CPU tensor with unit-norm rows."""
    g = torch.Generator(device="cpu").manual_seed(cfg.target_seed)
    e = torch.randn(cfg.vocab, cfg.d_model, generator=g, dtype=torch.float32)
    return e / e.norm(dim=1, keepdim=True)


def table_sha256(e: torch.Tensor) -> str:
    """Hash of E's little-endian float32 bytes, recorded in checkpoints to catch RNG drift."""
    return hashlib.sha256(e.detach().cpu().contiguous().float().numpy().tobytes()).hexdigest()
