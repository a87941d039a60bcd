"""Fixed-length byte windows: random training windows keyed by (seed, worker, step), and the
evenly spread, deterministic held-out windows every evaluation scores. Both are drawn over a
ByteSource's whole stream (all shards of a split) and gather only the windows' bytes."""

from __future__ import annotations

import torch

from btnode.data.source import ByteSource, as_source
from btnode.errors import DataError
from btnode.seeding import generator


def checked(data: ByteSource | bytes, min_len: int, what: str) -> ByteSource:
    source = as_source(data, what)
    if len(source) < min_len:
        raise DataError(f"{source.description} has {len(source)} bytes; windows need at least {min_len}")
    return source


class WindowSampler:
    """Training windows of n+1 bytes: x_0..x_{n-1} is the clean context, x_1..x_n the targets."""

    def __init__(self, data: ByteSource | bytes, n: int):
        self.n = n
        self.source = checked(data, n + 1, "training corpus")

    def batch(self, seed: int, worker: int | str, step: int, size: int) -> torch.Tensor:
        """(size, n+1) int64, a pure function of (seed, worker, step, size) and the stream's bytes."""
        g = generator("windows", seed, worker, step)
        starts = torch.randint(0, len(self.source) - self.n, (size,), generator=g)
        return self.source.windows(starts, self.n + 1).long()


def eval_windows(data: ByteSource | bytes, n: int, max_windows: int | None) -> torch.Tensor:
    """(W, n+1) int64 windows at stride n/2 (their scored halves tile the text), thinned evenly to
    at most max_windows so that a smaller evaluation still spans the whole held-out split."""
    source = checked(data, n + 1, "held-out corpus")
    starts = torch.arange(0, len(source) - n, n // 2)
    if max_windows is not None and max_windows < len(starts):
        pick = torch.linspace(0, len(starts) - 1, max_windows).round().long()
        starts = starts[pick]
    return source.windows(starts, n + 1).long()
