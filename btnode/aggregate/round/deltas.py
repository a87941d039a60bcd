"""A published delta as one compressed bundle kept in a file, not in memory (issue #25): after a publish
every worker fetches the same delta, so it is read, hash-checked and compressed once, and each fetch
sends it chunk by chunk from the file (its pages are the kernel's cache, not the process's RSS). A Pull's
fp32 bundle of the current θ is kept the same way (BlockAggregator.theta_frames)."""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from btnode.codec.bundles import BundleHeader, bundle_order, compressed, frames_digest
from btnode.codec.codecs import Codec, raw_size
from btnode.codec.frames import CHUNK_BYTES, ZSTD_LEVEL, ChunkData
from btnode.errors import UnknownBlock
from btnode.protocol import VersionInfo


@dataclass(frozen=True)
class StoredFrame:
    """A bundle whose payload lies in a DeltaFrames file."""

    header: BundleHeader
    owner: DeltaFrames
    offset: int
    raw_bytes: int
    payload_bytes: int

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[ChunkData]:
        size = self.payload_bytes
        for lo in range(0, size, chunk_bytes):
            yield ChunkData(self.header if lo == 0 else None, self.owner.read(self.offset + lo, min(chunk_bytes, size - lo)))


class DeltaFrames:
    """The bundle of one version's delta, in an unnamed file in `folder` (gone when this object is, or
    the process). `pieces`: (tensor name, raw codec bytes), one at a time (VersionStore.delta_pieces);
    the bundle follows `spec`'s order (a piece that comes early waits in memory for its turn)."""

    def __init__(self, info: VersionInfo, codec: Codec, pieces: Iterable[tuple[str, bytes]],
                 spec: Mapping[str, tuple[int, ...]], folder: Path):
        self.info = info
        self._file = tempfile.TemporaryFile(dir=folder)
        names, early, sha = bundle_order(spec), {}, {}

        def ordered() -> Iterator[bytes]:
            """The pieces in bundle order, each hashed (one that comes early waits for its turn)."""
            for name, raw in pieces:
                if name not in spec or name in sha or name in early:
                    raise UnknownBlock("version", f"the stored delta of version {info.version} holds {name!r} "
                                                  f"twice or outside the block")
                early[name] = raw
                del raw
                while len(sha) < len(names) and names[len(sha)] in early:
                    r = early.pop(names[len(sha)])
                    sha[names[len(sha)]] = hashlib.sha256(r).digest()
                    yield r
            if len(sha) != len(names):
                raise UnknownBlock("version", f"the stored delta of version {info.version} lacks "
                                              f"{sorted(set(spec) - set(sha))[:3]}")

        try:
            if codec.sparse:  # its size is known only once read: its raw bytes (a few % of θ) wait, then go in
                raw = list(ordered())
                sizes, total = tuple(map(len, raw)), sum(map(len, raw))
                stream: Iterable[bytes] = raw
            else:  # the spec fixes its size: streamed to the file as it is read
                sizes, total = (), sum(raw_size(codec, math.prod(s)) for s in spec.values())
                stream = ordered()
            for out in compressed(stream, total, ZSTD_LEVEL):
                self._file.write(out)
            self._file.flush()
        except BaseException:
            self._file.close()
            raise
        header = BundleHeader(codec, len(names), sizes, bytes.fromhex(frames_digest(sha)))
        self.frames = [StoredFrame(header, self, 0, total, self._file.tell())]

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self._file.fileno(), size, offset)  # no shared file position: safe across threads

    def close(self) -> None:
        self._file.close()
