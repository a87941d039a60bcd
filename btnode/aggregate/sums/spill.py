"""Where a round keeps the raw codec bytes of its accepted updates (issue #25): an unnamed file in
the block's folder, so that an update summed on arrival (aggregate/sums/accumulate.py) can still be taken
out again, exactly, if an audit fails or the screen drops it at close, without the aggregator
holding N updates in memory. The bytes sit in the page cache, which the kernel may write out; the
file vanishes with the round (or the process). Nothing here is durable, and need not be: an open
round is lost with the process anyway (BlockAggregator.drain publishes it on a clean stop)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

Where = dict[str, tuple[int, int]]  # tensor name → (offset, length)


class Spill:
    def __init__(self, folder: Path, *, name: str | None = None, reopen: bool = False):
        """`name`: a named file in `folder` instead (a relay's round, kept across a restart:
        aggregate/relay/roundlog.py), new and empty unless `reopen`."""
        folder.mkdir(parents=True, exist_ok=True)
        if name is None:
            self._file = tempfile.TemporaryFile(dir=folder, prefix=".spill-")
        else:
            self._file = open(folder / name, "r+b" if reopen else "w+b")  # noqa: SIM115 - closed with the round
        self._fd = self._file.fileno()
        self._end = os.fstat(self._fd).st_size

    def sync(self) -> None:
        """Make what was put so far durable (a named spill)."""
        os.fsync(self._fd)

    def put(self, raw: Mapping[str, bytes]) -> Where:
        where = {}
        for n, b in raw.items():
            view = memoryview(b)
            done = 0
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], self._end + done)
            where[n] = (self._end, len(b))
            self._end += len(b)
        return where

    def get(self, where: Where) -> dict[str, bytes]:
        out = {}
        for n, (offset, length) in where.items():
            b = os.pread(self._fd, length, offset)
            if len(b) != length:
                raise OSError(f"spill file: read {len(b)} of {length} bytes of {n} at {offset}")
            out[n] = b
        return out

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` (a slice of one tensor's bytes: a column of the round's updates)."""
        b = os.pread(self._fd, length, offset)
        if len(b) != length:
            raise OSError(f"spill file: read {len(b)} of {length} bytes at {offset}")
        return b

    @property
    def size(self) -> int:
        return self._end

    def close(self) -> None:
        self._file.close()
