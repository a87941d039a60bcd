"""Fixed-length byte windows: random training windows keyed by (seed, worker, step), and the
evenly spread, deterministic held-out windows every evaluation scores."""

from __future__ import annotations

import torch

from btnode.errors import DataError
from btnode.seeding import generator


def as_tensor(data: bytes, min_len: int, what: str) -> torch.Tensor:
    if len(data) < min_len:
        raise DataError(f"{what} has {len(data)} bytes; windows need at least {min_len}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class WindowSampler:
    """Training windows of n+1 bytes: x_0..x_{n-1} is the clean context, x_1..x_n the targets."""

    def __init__(self, data: bytes, n: int):
        self.n = n
        self.tokens = as_tensor(data, n + 1, "training corpus")

    def batch(self, seed: int, worker: int, step: int, size: int) -> torch.Tensor:
        """(size, n+1) int64, a pure function of (seed, worker, step, size)."""
        g = generator("windows", seed, worker, step)
        starts = torch.randint(0, len(self.tokens) - self.n, (size,), generator=g)
        idx = starts[:, None] + torch.arange(self.n + 1)[None, :]
        return self.tokens[idx].long()


def eval_windows(data: bytes, n: int, max_windows: int | None) -> torch.Tensor:
    """(W, n+1) int64 windows at stride n/2 (their scored halves tile the text), thinned evenly to
    at most max_windows so that a smaller evaluation still spans the whole held-out file."""
    tokens = as_tensor(data, n + 1, "held-out corpus")
    starts = torch.arange(0, len(tokens) - n, n // 2)
    if max_windows is not None and max_windows < len(starts):
        pick = torch.linspace(0, len(starts) - 1, max_windows).round().long()
        starts = starts[pick]
    return tokens[starts[:, None] + torch.arange(n + 1)[None, :]].long()
