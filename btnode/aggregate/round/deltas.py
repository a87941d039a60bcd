"""A published delta as compressed frames kept in a file, not in memory (issue #25): after a publish
every worker fetches the same delta, so it is read, hash-checked and compressed once, and each fetch
sends it chunk by chunk from the file (its pages are the kernel's cache, not the process's RSS). A Pull's
fp32 frames of the current θ are kept the same way (BlockAggregator.theta_frames)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import zstandard

from btnode.codec.codecs import Codec
from btnode.codec.frames import CHUNK_BYTES, ZSTD_LEVEL, ChunkData, FrameHeader, frame_from_raw
from btnode.errors import UnknownBlock
from btnode.protocol import VersionInfo


@dataclass(frozen=True)
class StoredFrame:
    """One frame whose payload lies in a DeltaFrames file."""

    header: FrameHeader
    owner: DeltaFrames
    offset: int

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[ChunkData]:
        size = self.header.payload_bytes
        for lo in range(0, size, chunk_bytes):
            yield ChunkData(self.header if lo == 0 else None, self.owner.read(self.offset + lo, min(chunk_bytes, size - lo)))


class DeltaFrames:
    """The frames of one version's delta, in an unnamed file in `folder` (gone when this object is, or
    the process). `pieces`: (tensor name, raw codec bytes), one at a time (VersionStore.delta_pieces);
    whatever their order, the frames follow `spec`'s."""

    def __init__(self, info: VersionInfo, codec: Codec, pieces: Iterable[tuple[str, bytes]],
                 spec: Mapping[str, tuple[int, ...]], folder: Path):
        self.info = info
        self._file = tempfile.TemporaryFile(dir=folder)
        compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        at, found = 0, {}
        try:
            for name, raw in pieces:
                if name not in spec or name in found:
                    raise UnknownBlock("version", f"the stored delta of version {info.version} holds {name!r} "
                                                  f"twice or outside the block")
                frame = frame_from_raw(name, spec[name], codec, raw, compressor)
                del raw
                self._file.write(frame.payload)
                found[name] = StoredFrame(frame.header, self, at)
                at += frame.header.payload_bytes
            self._file.flush()
        except BaseException:
            self._file.close()
            raise
        if set(found) != set(spec):
            self._file.close()
            raise UnknownBlock("version", f"the stored delta of version {info.version} lacks "
                                          f"{sorted(set(spec) - set(found))[:3]}")
        self.frames = [found[n] for n in spec]

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self._file.fileno(), size, offset)  # no shared file position: safe across threads

    def close(self) -> None:
        self._file.close()
