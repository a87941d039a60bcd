"""Building blocks shared by the diffusion block and the autoregressive baseline:
multi-head attention projections, the MLP, and AdaLN modulation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """AdaLN: x·(1 + scale) + shift, with shift/scale broadcast over positions."""
    return x * (1 + scale) + shift


class MLP(nn.Module):
    def __init__(self, d: int, ratio: int):
        super().__init__()
        self.fc = nn.Linear(d, ratio * d)
        self.out = nn.Linear(ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x), approximate="tanh"))


class Attention(nn.Module):
    """QKV and output projections; the attention pattern is the caller's (mask or causal)."""

    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, C) → q, k, v each (B, H, T, C/H)."""
        b, t, c = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, c // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """(B, H, T, C/H) → projected (B, T, C)."""
        b, h, t, hd = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, t, h * hd))


def init_weights(module: nn.Module) -> None:
    """GPT-2 style: N(0, 0.02) weights, zero biases. Zero-initialised modulations are set after."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
