"""`Intake`: a pushed update's chunks made into checked tensors and raw codec bytes, with the decode
slots that bound how many pushes are decoded at once (--decode-slots) and the bytes counted as they come."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from btnode.codec.codecs import Codec
from btnode.codec.frames import ChunkData, FrameAssembler
from btnode.protocol import Meter

# A push of a unit larger than this in fp32 is judged from its raw codec bytes, decoded a tensor at a time
# (each read decodes again: CPU for memory); a smaller one is decoded whole once, as the cheaper way.
LAZY_DECODE_BYTES = 64 << 20
# Such a push holds its raw bytes and a tensor's temporaries while it is judged, about half its unit in
# fp32: one at a time (whatever --decode-slots), so that a large unit's aggregator stays under 3 × the
# unit (issue #25; bench/fixed_memory.py measures one slot against two).
LAZY_DECODE_SLOTS = 1


class Intake:
    """One per aggregator: its decode slots are shared by every block's pushes and start states."""

    def __init__(self, decode_slots: int, meter: Meter):
        self.meter = meter
        self.slots = threading.BoundedSemaphore(decode_slots)  # pushes decoded and judged at once
        self.lazy_slots = threading.BoundedSemaphore(LAZY_DECODE_SLOTS)  # of those, a large unit's

    def assemble(self, spec: Mapping[str, tuple[int, ...]], codec: Codec, chunks: Iterable[ChunkData], *,
                 gate: contextlib.ExitStack | None = None,
                 defer_dir: Path | None = None) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
        """The tensors of a chunk stream, each frame checked against `spec` and `codec`, and their raw
        codec bytes; its bytes are counted as far as it got. With a `gate`, the upload is received
        compressed (frame headers checked as they come), and decoded only once one of the
        `--decode-slots` is free, which `gate` then holds: however many pushes arrive at once, only a
        few are ever decoded (4 bytes a parameter, plus their raw bytes) at the same time. With a
        `defer_dir`, the compressed frames wait in a file there, not in memory (issue #25). A push of a
        unit over LAZY_DECODE_BYTES in fp32 is checked frame by frame and kept as its raw codec bytes
        (codec/frames.LazyDelta): judging and summing it decodes one tensor at a time, a decode per read;
        LAZY_DECODE_SLOTS of those at once (taken before a decode slot, so a large push waiting for its
        turn holds no slot a small one could use)."""
        lazy = gate is not None and 4 * sum(math.prod(s) for s in spec.values()) > LAZY_DECODE_BYTES
        asm = FrameAssembler.for_spec(spec, [codec], keep_sparse=True, defer=gate is not None,  # sparse stays sparse
                                      defer_dir=defer_dir, lazy=lazy)
        try:
            for chunk in chunks:
                asm.add(chunk)
            if gate is not None:
                if lazy:
                    gate.enter_context(self.lazy_slots)
                gate.enter_context(self.slots)
            return asm.finish(), asm.raw
        finally:
            asm.close()
            self._received(asm)

    def _received(self, asm: FrameAssembler) -> None:
        """Count the tensor bytes a push or a state upload brought in (as far as it got)."""
        self.meter.count(("received", "wire"), asm.wire_bytes)
        self.meter.count(("received", "raw"), sum(len(b) for b in asm.raw.values()))
