"""θ of a stored version read from its model file a tensor at a time (issue #25): an aggregator of a
unit over IN_FILE_BYTES holds no copy of its current version in memory; the version file it wrote is
θ, and the next version is made from it (`Applied`) and written a tensor at a time."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from btnode.codec.codecs import Codec, decode
from btnode.errors import CheckpointError

# A unit whose fp32 θ is larger than this is read from its version file, not held (BlockAggregator);
# a smaller one is held: it costs little, and each push's claims check and each Pull then read no file.
IN_FILE_BYTES = 64 << 20
_DTYPES = {"F32": torch.float32}  # a version's θ is fp32 (files.state_sha256 hashes fp32 bytes)


class FileTheta(Mapping[str, torch.Tensor]):
    """The tensors of one safetensors file, each read afresh (os.preadv into a new tensor) when asked
    for, so that a reader holds one tensor, never the file. The file is kept open: a version pruned
    from the store (`--keep`) while a reader still has it (a Pull in flight, an audit's base) stays
    readable until this object goes. It is read as written: the writer (BlockAggregator) checked it
    when it wrote it, and a resume checks the whole file first (VersionStore.latest)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDONLY)
        self._fd = fd
        weakref.finalize(self, os.close, fd)
        try:
            head = os.pread(fd, 8, 0)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            header = json.loads(os.pread(fd, size, 8)) if 0 < size < 1 << 26 else None
            if not isinstance(header, dict):
                raise ValueError("no safetensors header")
            header.pop("__metadata__", None)
            spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k, v["dtype"], tuple(v["shape"]))
                           for k, v in header.items())
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
            raise CheckpointError(f"{self.path.name} is not a readable safetensors file: {exc}") from exc
        self._at: dict[str, tuple[int, tuple[int, ...]]] = {}
        for lo, hi, name, dtype, shape in spans:
            if dtype not in _DTYPES or hi - lo != 4 * math.prod(shape):
                raise CheckpointError(f"{self.path.name}: tensor {name!r} is {dtype} {shape} in {hi - lo} bytes, "
                                      f"not fp32")
            self._at[name] = (8 + size + lo, shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        offset, shape = self._at[name]
        out = torch.empty(shape, dtype=torch.float32)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(bytearray())
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path.name}: tensor {name!r} is cut short at byte {done} of {len(view)}")
            done += got
        return out

    def gather(self, name: str, where: torch.Tensor) -> torch.Tensor:
        """Tensor `name` at the flat positions `where` (int64), read through a map of the file: only the pages
        those positions lie on, no copy of the tensor (a sparse push's claims check; issue #40)."""
        offset, shape = self._at[name]
        numel = math.prod(shape)
        if not numel or not where.numel():
            return torch.zeros(where.shape, dtype=torch.float32)
        page = mmap.ALLOCATIONGRANULARITY
        start = offset - offset % page
        with mmap.mmap(self._fd, offset - start + 4 * numel, access=mmap.ACCESS_READ, offset=start) as m:
            values = np.frombuffer(m, np.float32, count=numel, offset=offset - start)
            out = torch.from_numpy(values[where.numpy()])  # a copy: the map may close
            del values
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape, in the file's order, read from its header (no tensor is read)."""
        return {n: shape for n, (_, shape) in self._at.items()}


class Applied(Mapping[str, torch.Tensor]):
    """θ^v + a published delta, made a tensor at a time as asked for: `theta[n] + decode(raw[n])`, the
    same float operations, in the same order, that a worker applying the delta does, so each tensor is
    bit for bit the one an in-memory close makes, however often it is made (hashed, then written)."""

    def __init__(self, theta: Mapping[str, torch.Tensor], raw: Mapping[str, bytes], codec: Codec,
                 spec: Mapping[str, tuple[int, ...]]):
        self.theta, self.raw, self.codec, self.spec = theta, raw, codec, spec

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.theta[name] + decode(self.codec, self.raw[name], self.spec[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.spec)

    def __len__(self) -> int:
        return len(self.spec)
