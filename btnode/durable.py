"""Durable writes, shared by every layer that keeps files (checkpoints, versions, datasets, caches,
aggregator state): a file is complete or absent after a crash, never half-written."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename, a new or removed file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | Iterable[bytes | memoryview]) -> None:
    """Write to a temp file in the same folder, fsync, rename over `path`, fsync the folder. `data`
    may come in pieces (a large file written without ever being whole in memory). The temp file is
    named per thread: two threads writing the same file at once (two Joins) each rename their own."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_native_id()}")
    with open(tmp, "wb") as f:
        for piece in ([data] if isinstance(data, (bytes, bytearray, memoryview)) else data):
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class Journal:
    """A durable map from names to JSON values that grows by appending: each `put` appends one line
    and fsyncs it, so a change costs its own bytes, not the whole map's (a map rewritten whole on
    every change costs O(N²) bytes as N workers join). On open, the last line of each name wins; a
    torn last line (a crash mid-append) is dropped; the file is rewritten compactly (atomically)
    when it holds more than twice the lines it needs. `legacy`: a JSON object file of the same map
    written whole by earlier versions, read first and then folded into the journal."""

    def __init__(self, path: Path, *, legacy: Path | None = None):
        self.path = path
        self.values: dict[str, object] = {}
        self._lock = threading.Lock()
        if legacy is not None and legacy.exists():
            self.values.update(json.loads(legacy.read_bytes()))
        lines = self.path.read_bytes().splitlines() if self.path.exists() else []
        torn = False
        for i, line in enumerate(lines):
            try:
                name, value = json.loads(line)
            except ValueError:
                if i == len(lines) - 1:  # torn by a crash while it was appended: that change never happened
                    torn = True
                    break
                raise ValueError(f"{self.path}: line {i + 1} is not a journal entry") from None
            self.values[name] = value
        folding = legacy is not None and legacy.exists()
        if torn or folding or not self.path.exists() or len(lines) > 2 * len(self.values):
            atomic_write(self.path, b"".join(_entry(n, v) for n, v in self.values.items()))
            if folding:
                legacy.unlink()
                fsync_dir(legacy.parent)
        self._file = open(self.path, "ab")  # noqa: SIM115 - held for the life of the map

    def put(self, name: str, value: object) -> None:
        with self._lock:
            self._file.write(_entry(name, value))
            self._file.flush()
            os.fsync(self._file.fileno())
            self.values[name] = value


def _entry(name: str, value: object) -> bytes:
    return json.dumps([name, value], separators=(",", ":"), sort_keys=True).encode() + b"\n"
