"""Per-request KV caches of the autoregressive chain: rows appended in exactly the groups the
caller passes (the exactness of speculative decoding rests on that), rewound to a shorter prefix
(rejected draft rows), and bounded by a session count and a byte budget, so that a flood of
request ids cannot grow a stage's memory without bound. Callers hold their own lock."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from btnode.errors import ConfigError
from btnode.model.ar import ARLayer, ByteTransformer

MAX_SESSIONS = 64  # per-request caches kept per stage (least recently used go first)
KV_BUDGET_BYTES = 256 << 20  # keys and values kept per stage, all requests together

KV = list[tuple[torch.Tensor, torch.Tensor] | None]


@dataclass
class KVSession:
    n_layers: int
    tokens: bytes = b""  # first stage and draft only: the bytes of positions 0…length−1
    length: int = 0  # positions the cache covers
    kv: KV = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kv = self.kv or [None] * self.n_layers

    def rewind(self, n: int) -> None:
        """Keep positions 0…n−1 (n ≤ length): what a request starting at position n builds on."""
        assert 0 <= n <= self.length, f"rewind to {n} of {self.length}"
        if n == 0:
            self.kv = [None] * self.n_layers
        elif n < self.length:
            self.kv = [(k[:, :, :n], v[:, :, :n]) for k, v in self.kv]  # type: ignore[misc]
        self.tokens, self.length = self.tokens[:n], n

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.kv if pair is not None for t in pair)


def embed(model: ByteTransformer, data: bytes, start: int, device: torch.device) -> torch.Tensor:
    """Input rows (T, C) of `data` at positions start…start+T−1, what `extend` takes (row-wise:
    no rounding depends on T). Shared by the chain's first stage and the draft model."""
    ids = torch.tensor(list(data), dtype=torch.long, device=device)
    return model.byte_emb(ids) + model.pos.weight[start:start + len(data)]


def extend(layers: Sequence[ARLayer], session: KVSession, h: torch.Tensor) -> torch.Tensor:
    """Rows h (T, C) at positions length…length+T−1 through `layers` as ONE batch; the cache grows
    by T. One call with T rows and T calls with one row agree only up to rounding: callers choose."""
    x = h[None]  # (1, T, C)
    kv: KV = []
    for layer, past in zip(layers, session.kv):
        x, cache = layer.forward_cached(x, past)
        kv.append(cache)
    session.kv, session.length = kv, session.length + h.shape[0]
    return x[0]


def extend_each(layers: Sequence[ARLayer], sessions: Sequence[KVSession], h: torch.Tensor) -> torch.Tensor:
    """One new row for each of R sessions (h: (R, C), row i at position sessions[i].length) through
    `layers` as ONE batch: the caches, of different lengths, padded to the longest and masked, and
    each session's cache grown by its row. Equal to R calls of `extend` with one row up to float
    rounding (continuous batching of the AR chain, serve/ar.py). Every session must hold ≥ 1 position."""
    lens = torch.tensor([s.length for s in sessions], device=h.device)
    p = int(lens.max())
    keys = torch.arange(p + 1, device=h.device)
    mask = ((keys[None, :] < lens[:, None]) | (keys[None, :] == p))[:, None, None, :]  # (R, 1, 1, P + 1)
    x = h[:, None]  # (R, 1, C)
    for j, layer in enumerate(layers):
        past = [s.kv[j] for s in sessions]
        assert all(kv is not None for kv in past), "extend_each extends sessions that hold positions"
        pk = torch.stack([F.pad(kv[0][0], (0, 0, 0, p - kv[0].shape[2])) for kv in past])  # type: ignore[index]
        pv = torch.stack([F.pad(kv[1][0], (0, 0, 0, p - kv[1].shape[2])) for kv in past])  # type: ignore[index]
        x, (k, v) = layer.forward_cached(x, (pk, pv), mask)
        for i, s in enumerate(sessions):
            ok, ov = s.kv[j]  # type: ignore[misc]
            s.kv[j] = (torch.cat([ok, k[i:i + 1, :, p:]], dim=2), torch.cat([ov, v[i:i + 1, :, p:]], dim=2))
    for s in sessions:
        s.length += 1
    return x[:, 0]


def common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KVSessions:
    """Sessions by request id, least recently used first out, within `max_sessions` and `max_bytes`.

    `max_bytes` must hold at least one full session (`full_bytes`: every layer, N positions), so
    the request being served always fits; older sessions are evicted to make room (their next
    request is a cache miss, and the entry resends its window)."""

    def __init__(self, n_layers: int, full_bytes: int, *, max_sessions: int = MAX_SESSIONS,
                 max_bytes: int = KV_BUDGET_BYTES):
        if max_sessions < 1 or max_bytes < full_bytes:
            raise ConfigError(f"a KV budget of {max_sessions} sessions and {max_bytes} bytes cannot hold one "
                             f"full session ({full_bytes} bytes)")
        self.n_layers, self.max_sessions, self.max_bytes = n_layers, max_sessions, max_bytes
        self._sessions: OrderedDict[str, KVSession] = OrderedDict()

    def get(self, rid: str) -> KVSession:
        s = self._sessions.pop(rid, None) or KVSession(self.n_layers)
        self._sessions[rid] = s
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return s

    def pop(self, rid: str) -> None:
        self._sessions.pop(rid, None)

    def trim(self) -> None:
        """Evict least recently used sessions (never the newest) until within the byte budget."""
        total = self.nbytes
        while total > self.max_bytes and len(self._sessions) > 1:
            _, old = self._sessions.popitem(last=False)
            total -= old.nbytes

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, rid: str) -> bool:
        return rid in self._sessions

    def __getitem__(self, rid: str) -> KVSession:
        return self._sessions[rid]
