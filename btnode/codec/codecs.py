"""Tensor codecs (design §3.4): fp32 (lossless), bf16, int8 with one absmax scale per 256
values, and the sparse low-bit codecs of codec/sparse.py (top-k per 4,096-value chunk, Rice-coded
positions, 8- or 2-bit values; issue #24). A codec turns an fp32 tensor into its raw representation; frames.py compresses that with
zstd level 1 (levels above 1 buy nothing on float data: the dtype choice is what matters).

Raw layouts, all little-endian:
  FP32  numel × float32
  BF16  numel × bfloat16 (round to nearest even)
  INT8  ceil(numel/256) × float32 scales, then numel × int8; value = q · scale
  SPARSE8, SPARSE2  see codec/sparse.py: a u16 `keep` (values per chunk), then variable-size sections
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from enum import IntEnum

import numpy as np
import torch

from btnode.codec import sparse
from btnode.errors import MalformedInput

GROUP = 256  # values per int8 scale

assert sys.byteorder == "little", "the raw layouts are little-endian; big-endian hosts need byte swaps"


class Codec(IntEnum):
    """Values equal the wire enum btnode.v2.Codec's numbers (rpc/convert.py checks it at import)."""

    FP32 = 1
    BF16 = 2
    INT8 = 3
    SPARSE8 = 4
    SPARSE2 = 5

    @property
    def sparse(self) -> bool:
        return self in (Codec.SPARSE8, Codec.SPARSE2)

    @property
    def two_bit(self) -> bool:
        return self is Codec.SPARSE2

    @property
    def ef_decay(self) -> float:
        """β of error feedback, acc = Δ + β·residual: 1 for the dense codecs (the residual is one rounding
        step), sparse.EF_DECAY for the sparse ones (a coordinate may wait many rounds to be sent, and
        the decay bounds what it can pile up to: the claims bound, aggregate/trust/claims.py)."""
        return sparse.EF_DECAY if self.sparse else 1.0


SPARSE_DENSITY = 0.01  # default share of values a sparse codec keeps


def keep_in(codec: Codec, raw: Mapping[str, bytes]) -> int:
    """The keep of a sparse update's frames (they share one: the first says it); CHUNK otherwise."""
    first = next(iter(raw.values()), b"")
    return sparse.keep_in(first) or sparse.CHUNK if codec.sparse else sparse.CHUNK


def raw_size(codec: Codec, numel: int) -> int:
    """The raw size of `numel` values; for a sparse codec, whose size depends on its keep and on
    where the kept values lie, an upper bound at any keep."""
    if codec.sparse:
        return sparse.max_raw_size(numel)
    if codec is Codec.FP32:
        return 4 * numel
    if codec is Codec.BF16:
        return 2 * numel
    return 4 * -(-numel // GROUP) + numel


def encode(codec: Codec, x: torch.Tensor, *, keep: int = sparse.CHUNK) -> bytes:
    """fp32 tensor (any shape, any device) → raw bytes. `keep`: values a sparse codec keeps per
    4,096-value chunk (sparse.keep_of(density)); the dense codecs ignore it."""
    flat = x.detach().to("cpu", torch.float32).contiguous().view(-1)
    if codec.sparse:
        return sparse.encode_sparse(flat, keep, codec.two_bit)
    if codec is Codec.FP32:
        return flat.numpy().tobytes()
    if codec is Codec.BF16:
        return flat.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    n = flat.numel()
    groups = -(-n // GROUP)
    padded = (flat if n == groups * GROUP else torch.nn.functional.pad(flat, (0, groups * GROUP - n))).view(groups, GROUP)
    # max |x| of each group from its min and max (two reductions, no tensor of |x|; aminmax along a dim is slower)
    scale = torch.maximum(padded.amin(dim=1).abs_(), padded.amax(dim=1).abs_()).div_(127.0)  # (G,); +0.0 for zeros
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.div(padded, safe[:, None]).round_().clamp_(-127, 127).to(torch.int8).view(-1)[:n]
    return scale.numpy().tobytes() + q.numpy().tobytes()


def decode(codec: Codec, raw: bytes, shape: tuple[int, ...], *, out: torch.Tensor | None = None) -> torch.Tensor:
    """raw bytes → fp32 CPU tensor of `shape`; MalformedInput if the size does not fit. `out`: a flat fp32 buffer
    of at least numel values a dense codec decodes into (the same values; a reader that decodes tensor after tensor
    reuses one buffer, instead of fresh memory's page faults per tensor, which cost more than the decode: issue #40)."""
    numel = 1
    for s in shape:
        numel *= s
    if codec.sparse:
        positions, values = sparse.decode_sparse(raw, numel, codec.two_bit)
        return sparse.densify(positions, values, numel).reshape(shape)
    if len(raw) != raw_size(codec, numel):
        raise MalformedInput("size", f"{codec.name} data for shape {tuple(shape)} must be "
                             f"{raw_size(codec, numel)} bytes, got {len(raw)}")
    if numel == 0:
        return torch.zeros(shape)
    if out is not None and codec in (Codec.FP32, Codec.INT8):
        return _decode_into(codec, raw, numel, out[:numel]).reshape(shape)
    if codec is Codec.FP32:  # a writable copy: torch.frombuffer on bytes warns and aliases
        flat = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    elif codec is Codec.BF16:  # (the conversions below read the bytes in place: numpy views are read-only, and new
        # arrays come out; a copy of the raw bytes first cost a third of an int8 decode)
        flat = torch.from_numpy(np.frombuffer(raw, np.int16).copy()).view(torch.bfloat16).float()
    else:
        groups = -(-numel // GROUP)
        scale = torch.from_numpy(np.frombuffer(raw, np.float32, count=groups).copy())
        flat = torch.from_numpy(np.frombuffer(raw, np.int8, offset=4 * groups).astype(np.float32))
        full = numel - numel % GROUP  # scaled in place, group by group: no numel-sized temporaries
        flat[:full].view(-1, GROUP).mul_(scale[:full // GROUP, None])
        flat[full:].mul_(scale[-1])
    return flat.reshape(shape)


def _decode_into(codec: Codec, raw: bytes, numel: int, flat: torch.Tensor) -> torch.Tensor:
    """decode's FP32 and INT8 into `flat` (numel fp32 values): the same float operations as decode's."""
    target = flat.numpy()
    if codec is Codec.FP32:
        target[:] = np.frombuffer(raw, np.float32)
        return flat
    groups = -(-numel // GROUP)
    scale = torch.from_numpy(np.frombuffer(raw, np.float32, count=groups).copy())
    np.copyto(target, np.frombuffer(raw, np.int8, offset=4 * groups), casting="unsafe")  # exact: int8 → fp32
    full = numel - numel % GROUP
    flat[:full].view(-1, GROUP).mul_(scale[:full // GROUP, None])
    flat[full:].mul_(scale[-1])
    return flat


def parse(name: str) -> Codec:
    try:
        return Codec[name.upper()]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose from {', '.join(c.name.lower() for c in Codec)}") from None
