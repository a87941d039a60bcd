"""The draft of speculative decoding: a small byte transformer at the AR chain's entry that
proposes the next G bytes, which the chain then verifies in one traversal (serve/ar.py).

A draft only decides how many bytes a traversal commits, never which ones: the chain keeps a
draft byte only if it equals its own sample. Two choices make good drafts pay:
- the draft samples byte t from its own logits with the chain's stream ("ar-sample", seed, t)
  (common random numbers), so a draft close to the target proposes what the chain will sample,
  at temperature 1 as well as greedy;
- it caches its rows in the stages' grouping (a new window as one batch, then one row per byte,
  including the row of its last proposal), so the target itself used as a draft computes the
  chain's logits bit for bit and has every proposal accepted (a test holds it to that).
Any ByteTransformer with the chain's vocabulary and context can serve as the draft.
"""

from __future__ import annotations

import threading

import torch

from btnode.model.ar import ByteTransformer
from btnode.model.config import ModelConfig
from btnode.seeding import generator
from btnode.serve.kvcache import KV_BUDGET_BYTES, MAX_SESSIONS, KVSessions, common_prefix, embed, extend
from btnode.serve.readouts import sample_bytes


class ARDrafter:
    """Proposes bytes for one request at a time; per-request caches as bounded as a stage's."""

    def __init__(self, model: ByteTransformer, *, device: torch.device = torch.device("cpu"),
                 max_sessions: int = MAX_SESSIONS, kv_bytes: int = KV_BUDGET_BYTES):
        self.model = model.to(device).eval()
        self.cfg: ModelConfig = model.cfg
        self.device = device
        element = model.byte_emb.weight.element_size()
        self.sessions = KVSessions(model.n_layers, 2 * model.n_layers * self.cfg.context * self.cfg.d_model * element,
                                   max_sessions=max_sessions, max_bytes=kv_bytes)
        self._lock = threading.Lock()

    @torch.no_grad()
    def propose(self, request_id: str, tokens: bytes, n: int, *, step: int, seed: int, temperature: float) -> bytes:
        """n bytes to follow the window `tokens` (whose next byte is step `step`); len(tokens) + n ≤ N."""
        if not tokens or n < 1 or len(tokens) + n > self.cfg.context:
            raise ValueError(f"cannot draft {n} bytes after {len(tokens)} in a context of {self.cfg.context}")
        with self._lock:
            s = self.sessions.get(request_id)
            start = min(common_prefix(s.tokens, tokens), len(tokens) - 1)
            s.rewind(start)
            layers = list(self.model.layers)
            out = extend(layers, s, embed(self.model, tokens[start:], start, self.device))
            proposal = bytearray()
            for i in range(n):
                logits = self.model.head(self.model.norm(out[-1:]))  # (1, V)
                proposal += bytes(sample_bytes(logits, temperature, generator("ar-sample", seed, step + i)).tolist())
                out = extend(layers, s, embed(self.model, proposal[-1:], len(tokens) + i, self.device))
            s.tokens = tokens + bytes(proposal)
            self.sessions.trim()
        return bytes(proposal)

    def drop(self, request_id: str) -> None:
        """Forget a finished request's cache."""
        with self._lock:
            self.sessions.pop(request_id)
