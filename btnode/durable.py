"""Durable writes, shared by every layer that keeps files (checkpoints, versions, datasets, caches,
aggregator state): a file is complete or absent after a crash, never half-written."""

from __future__ import annotations

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
