"""Where a split's bytes live: in memory (the bundled corpus) or in memory-mapped shards on disk (a
prepared dataset, a user's file), behind one interface that gathers windows and reads bounded slices,
so that no reader holds a whole split in RAM and the windows do not depend on where the bytes are."""

from __future__ import annotations

import itertools
import math
import mmap
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from btnode.data.manifest import Shard, Split
from btnode.errors import DataError

READ_CHUNK = 16 << 20  # bytes per read when a whole split is scanned (byte counts): bounded memory


class ByteSource(ABC):
    """A split's byte stream: its length, windows gathered at given starts, and bounded reads."""

    description: str  # says which data this is ("bundled WikiText-2 test", "dataset /x test split")

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """(k, length) uint8: the bytes [s, s + length) for each s of the int64 `starts`."""

    @abstractmethod
    def read(self, start: int, length: int) -> bytes:
        """The bytes [start, start + length), cut at the end of the stream (as slicing does)."""

    def in_memory(self) -> int:
        """Bytes this source holds in process memory (a mapped file's pages are page cache, not counted)."""
        return 0

    def chunks(self, size: int = READ_CHUNK) -> Iterator[tuple[int, bytes]]:
        """(offset, bytes) over the whole stream in pieces of at most `size` bytes."""
        for offset in range(0, len(self), size):
            yield offset, self.read(offset, size)


def positions(starts: torch.Tensor, length: int, total: int) -> torch.Tensor:
    """(k, length) int64 stream positions of the windows; every window must lie inside the stream."""
    idx = starts[:, None] + torch.arange(length)[None, :]
    assert idx.numel() == 0 or (int(idx.min()) >= 0 and int(idx.max()) < total), (starts, length, total)
    return idx


class MemoryBytes(ByteSource):
    """Bytes held in memory (the bundled corpus, WikiText files): one tensor over one copy of them."""

    def __init__(self, data: bytes, description: str = "bytes in memory"):
        self._buffer = bytearray(data)  # writable, so the tensor shares it without torch's warning
        self._tensor = torch.frombuffer(self._buffer, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        self.description = description

    def __len__(self) -> int:
        return len(self._buffer)

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        return self._tensor[positions(starts, length, len(self))]

    def read(self, start: int, length: int) -> bytes:
        return bytes(self._buffer[start:start + length])

    def in_memory(self) -> int:
        return len(self._buffer)


def verify_shard(path: Path, shard: Shard, what: str) -> None:
    """The shard's file exists and holds exactly the bytes the manifest lists for it."""
    try:
        found = os.stat(path).st_size
    except FileNotFoundError as exc:
        raise DataError(f"shard {shard.path} of {what} is missing ({path})") from exc
    except OSError as exc:
        raise DataError(f"shard {shard.path} of {what} ({path}) cannot be read: {exc.strerror or exc}") from exc
    if found != shard.bytes:
        raise DataError(f"shard {shard.path} of {what} ({path}) has {found} bytes but the manifest lists "
                        f"{shard.bytes}: it is truncated or altered")


def _map(path: Path, shard: Shard, what: str) -> mmap.mmap:
    """A read-only mapping of one shard's file, its size checked; pages come in as windows touch them."""
    verify_shard(path, shard, what)
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), shard.bytes, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: the file shrank since it was checked
        raise DataError(f"shard {shard.path} of {what} ({path}) cannot be mapped: {exc}") from exc
    if hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)  # windows land anywhere: read ahead nothing they do not touch
    return mm


class ShardedBytes(ByteSource):
    """A split's stream as its shards concatenated, each memory-mapped read-only when first needed.

    `locate(shard)` gives the local file of a shard (a dataset folder's, or a download cache's); it is
    asked again whenever a shard is mapped, so a cache may have evicted and fetched it in between.
    Windows may cross shard boundaries; gathering copies only the windows' bytes."""

    def __init__(self, split: Split, locate: Callable[[Shard], Path], description: str = ""):
        self.split, self.locate = split, locate
        self.description = description or f"the {split.name} split"
        self._ends = torch.tensor(list(itertools.accumulate(s.bytes for s in split.shards)), dtype=torch.int64)
        self._maps: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}

    @classmethod
    def file(cls, path: Path, size: int, description: str) -> ShardedBytes:
        """One file as a one-shard stream (a user's corpus file; its sha256 is not known, so empty)."""
        split = Split(name="train", bytes=size, documents=1, shards=(Shard(path=path.name, bytes=size, sha256=""),))
        return cls(split, lambda _: path, description)

    def __len__(self) -> int:
        return self.split.bytes

    def _start(self, i: int) -> int:
        return int(self._ends[i - 1]) if i else 0

    def _shard(self, i: int) -> tuple[mmap.mmap, torch.Tensor]:
        if i not in self._maps:
            shard = self.split.shards[i]
            mm = _map(self.locate(shard), shard, self.description)
            with warnings.catch_warnings():  # read-only by design: nothing writes into a window's source
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                self._maps[i] = mm, torch.frombuffer(mm, dtype=torch.uint8)
        return self._maps[i]

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        idx = positions(starts, length, len(self))
        which = torch.searchsorted(self._ends, idx, right=True)  # shard i holds [end(i-1), end(i))
        out = torch.empty(idx.shape, dtype=torch.uint8)
        for i in which.unique().tolist():
            here = which == i
            out[here] = self._shard(i)[1][idx[here] - self._start(i)]
        return out

    def read(self, start: int, length: int) -> bytes:
        stop = min(start + length, len(self))
        parts = []
        while start < stop:
            i = int(torch.searchsorted(self._ends, torch.tensor(start), right=True))  # never an empty shard
            lo, mm = start - self._start(i), self._shard(i)[0]
            take = min(stop - start, len(mm) - lo)
            parts.append(mm[lo:lo + take])
            start += take
        return b"".join(parts)


def as_source(data: ByteSource | bytes, description: str = "bytes in memory") -> ByteSource:
    return data if isinstance(data, ByteSource) else MemoryBytes(data, description)


def unigram_entropy(data: ByteSource | bytes) -> float:
    """Entropy of the byte distribution, nats/byte: the best any unigram model can do on it. Counted
    in bounded chunks; summed in order of each byte value's first occurrence, so that the value is
    the one the former Counter-based count gave to the last bit."""
    source = as_source(data)
    counts = np.zeros(256, dtype=np.int64)
    first = np.full(256, len(source), dtype=np.int64)  # where each byte value first occurs
    for offset, chunk in source.chunks():
        a = np.frombuffer(chunk, dtype=np.uint8)
        here = np.bincount(a, minlength=256)
        for v in np.flatnonzero((here > 0) & (counts == 0)):
            first[v] = offset + int(np.argmax(a == v))
        counts += here
    n = len(source)
    return -sum(c / n * math.log(c / n) for c in counts[np.argsort(first, kind="stable")].tolist() if c)
