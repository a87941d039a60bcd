"""The end-to-end autoregressive byte transformer used as the baseline (design §2.7): same width,
heads and MLP as a block, trained with ordinary backprop on next-byte prediction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from btnode.model.config import ModelConfig
from btnode.model.layers import MLP, Attention, init_weights


class ARLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg.d_model, cfg.n_heads)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.mlp_ratio)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn.heads(self.norm1(h))
        h = h + self.attn.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return h + self.mlp(self.norm2(h))

    def forward_cached(self, h: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Rows h (B, T, C) following `past` keys/values (B, H, P, hd): causal over past + new rows.
        Returns the new rows' outputs and the keys/values of all P + T positions (the KV cache).
        `mask` (B, 1, T, P + T) bool, when given, says which keys each row sees instead (rows of
        several requests whose pasts of different lengths are padded to P)."""
        q, k, v = self.attn.heads(self.norm1(h))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        t, total = q.shape[2], k.shape[2]
        if mask is None and t > 1:  # row i (absolute total − t + i) sees keys j ≤ its own position
            rows = torch.arange(total - t, total, device=h.device)
            mask = torch.arange(total, device=h.device)[None, :] <= rows[:, None]
        h = h + self.attn.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        return h + self.mlp(self.norm2(h)), (k, v)


class ByteTransformer(nn.Module):
    """x: (B, T) byte ids → next-byte logits (B, T, V); `n_layers` overrides cfg.n_layers."""

    def __init__(self, cfg: ModelConfig, n_layers: int):
        super().__init__()
        self.cfg = cfg
        self.n_layers = n_layers
        self.byte_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.layers = nn.ModuleList(ARLayer(cfg) for _ in range(n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        assert t <= self.cfg.context, f"{t} bytes, context is {self.cfg.context}"
        h = self.byte_emb(x) + self.pos.weight[:t]  # (B, T, C)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))
