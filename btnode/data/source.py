"""Where a split's bytes live: in memory (the bundled corpus) or in shard files on disk (a prepared
dataset, a user's file), behind one interface that gathers windows and reads bounded slices, so that
no reader holds a whole split in RAM and the windows do not depend on where the bytes are."""

from __future__ import annotations

import bisect
import itertools
import math
import os
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
        """Bytes this source holds in process memory (what it reads from files is page cache: not counted)."""
        return 0

    def chunks(self, size: int | None = None) -> Iterator[tuple[int, bytes]]:
        """(offset, bytes) over the whole stream in pieces of at most `size` (READ_CHUNK) bytes."""
        size = size or READ_CHUNK
        for offset in range(0, len(self), size):
            yield offset, self.read(offset, size)


def positions(starts: torch.Tensor, length: int, total: int) -> torch.Tensor:
    """(k, length) int64 stream positions of the windows; every window must lie inside the stream."""
    idx = starts[:, None] + torch.arange(length)[None, :]
    assert idx.numel() == 0 or (int(idx.min()) >= 0 and int(idx.max()) < total), (starts, length, total)
    return idx


class MemoryBytes(ByteSource):
    """Bytes held in memory (the bundled corpus): one tensor over one copy of them."""

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


class _OpenShards:
    """The shard files one gather touches, each opened (its size checked) once, closed at the end."""

    def __init__(self, source: ShardedBytes):
        self.source, self.fds = source, {}

    def fd(self, i: int) -> int:
        if i not in self.fds:
            shard = self.source.split.shards[i]
            path = self.source.locate(shard)
            verify_shard(path, shard, self.source.description)
            try:
                self.fds[i] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise DataError(f"shard {shard.path} of {self.source.description} ({path}) cannot be opened: "
                                f"{exc.strerror or exc}") from exc
        return self.fds[i]

    def __enter__(self) -> _OpenShards:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            os.close(fd)


class ShardedBytes(ByteSource):
    """A split's stream as its shards concatenated, read with positioned reads of just the bytes asked for.

    Not memory-mapped: on kernels whose page cache holds large folios (ext4 from Linux 6.16), one
    fault maps a whole folio into the process, so each window drawn from a mapping added up to 2 MB
    to the resident set (measured), until it held the dataset. Positioned reads leave the bytes in
    the page cache, which the kernel reclaims, and a worker's memory does not grow with the corpus.
    `locate(shard)` gives the local file of a shard (a dataset folder's, or a download cache's); it is
    asked again each time a shard is opened, so a cache may have evicted and fetched it in between."""

    def __init__(self, split: Split, locate: Callable[[Shard], Path], description: str = ""):
        self.split, self.locate = split, locate
        self.description = description or f"the {split.name} split"
        self._ends = list(itertools.accumulate(s.bytes for s in split.shards))  # shard i holds [end(i-1), end(i))

    @classmethod
    def file(cls, path: Path, size: int, description: str) -> ShardedBytes:
        """One file as a one-shard stream (a user's corpus file; its sha256 is not known, so empty)."""
        split = Split(name="train", bytes=size, documents=1, shards=(Shard(path=path.name, bytes=size, sha256=""),))
        return cls(split, lambda _: path, description)

    def __len__(self) -> int:
        return self.split.bytes

    def _fill(self, files: _OpenShards, start: int, out: memoryview) -> None:
        """Read the stream's bytes from `start` into all of `out`, across shard boundaries."""
        while out:
            i = bisect.bisect_right(self._ends, start)  # never an empty shard
            shard, lo = self.split.shards[i], start - (self._ends[i - 1] if i else 0)
            take = min(len(out), shard.bytes - lo)
            try:
                got = os.preadv(files.fd(i), [out[:take]], lo)
            except OSError as exc:
                raise DataError(f"shard {shard.path} of {self.description} cannot be read: "
                                f"{exc.strerror or exc}") from exc
            if got != take:
                raise DataError(f"shard {shard.path} of {self.description} ended {take - got} bytes early: "
                                "it was truncated while in use")
            start, out = start + take, out[take:]

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        out = np.empty((len(starts), length), dtype=np.uint8)
        assert len(starts) == 0 or (int(starts.min()) >= 0 and int(starts.max()) + length <= len(self)), \
            (starts, length, len(self))
        with _OpenShards(self) as files:
            for row, start in zip(out, starts.tolist()):
                self._fill(files, start, memoryview(row))
        return torch.from_numpy(out)

    def read(self, start: int, length: int) -> bytes:
        out = bytearray(max(0, min(start + length, len(self)) - start))
        with _OpenShards(self) as files:
            self._fill(files, start, memoryview(out))
        return bytes(out)


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
