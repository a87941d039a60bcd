"""Tensor codecs (design §3.4): fp32 (lossless), bf16, and int8 with one absmax scale per 256
values. A codec turns an fp32 tensor into its raw representation; frames.py compresses that with
zstd level 1 (levels above 1 buy nothing on float data: the dtype choice is what matters).

Raw layouts, all little-endian:
  FP32  numel × float32
  BF16  numel × bfloat16 (round to nearest even)
  INT8  ceil(numel/256) × float32 scales, then numel × int8; value = q · scale
"""

from __future__ import annotations

import sys
from enum import IntEnum

import torch

from btnode.errors import MalformedInput

GROUP = 256  # values per int8 scale

assert sys.byteorder == "little", "the raw layouts are little-endian; big-endian hosts need byte swaps"


class Codec(IntEnum):
    """Values equal the wire enum btnode.v1.Codec."""

    FP32 = 1
    BF16 = 2
    INT8 = 3


def raw_size(codec: Codec, numel: int) -> int:
    if codec is Codec.FP32:
        return 4 * numel
    if codec is Codec.BF16:
        return 2 * numel
    return 4 * -(-numel // GROUP) + numel


def encode(codec: Codec, x: torch.Tensor) -> bytes:
    """fp32 tensor (any shape, any device) → raw bytes."""
    flat = x.detach().to("cpu", torch.float32).contiguous().view(-1)
    if codec is Codec.FP32:
        return flat.numpy().tobytes()
    if codec is Codec.BF16:
        return flat.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    n = flat.numel()
    groups = -(-n // GROUP)
    padded = torch.nn.functional.pad(flat, (0, groups * GROUP - n)).view(groups, GROUP)
    scale = padded.abs().amax(dim=1) / 127.0  # (G,)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / safe[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)[:n]
    return scale.numpy().tobytes() + q.numpy().tobytes()


def decode(codec: Codec, raw: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """raw bytes → fp32 CPU tensor of `shape`; MalformedInput if the size does not fit."""
    numel = 1
    for s in shape:
        numel *= s
    if len(raw) != raw_size(codec, numel):
        raise MalformedInput("size", f"{codec.name} data for shape {tuple(shape)} must be "
                             f"{raw_size(codec, numel)} bytes, got {len(raw)}")
    buf = bytearray(raw)  # writable copy: torch.frombuffer on bytes warns and aliases
    if codec is Codec.FP32:
        flat = torch.frombuffer(buf, dtype=torch.float32) if numel else torch.zeros(0)
    elif codec is Codec.BF16:
        flat = torch.frombuffer(buf, dtype=torch.int16).view(torch.bfloat16).float() if numel else torch.zeros(0)
    else:
        groups = -(-numel // GROUP)
        if numel == 0:
            flat = torch.zeros(0)
        else:
            scale = torch.frombuffer(buf, dtype=torch.float32, count=groups)
            q = torch.frombuffer(buf, dtype=torch.int8, offset=4 * groups)
            flat = q.float()  # scaled in place, group by group: no numel-sized temporaries
            full = numel - numel % GROUP
            flat[:full].view(-1, GROUP).mul_(scale[:full // GROUP, None])
            flat[full:].mul_(scale[-1])
    return flat.reshape(shape)


def parse(name: str) -> Codec:
    try:
        return Codec[name.upper()]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose from {', '.join(c.name.lower() for c in Codec)}") from None
