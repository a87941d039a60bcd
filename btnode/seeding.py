"""Stateless random streams: every draw is keyed by what it is for (seed, worker, block, step...),
so a run resumed from a checkpoint replays exactly the same windows, σ and noise."""

from __future__ import annotations

import hashlib

import torch


def stream_seed(*parts: object) -> int:
    """A 63-bit seed from a tuple of identifiers, stable across processes and hosts."""
    blob = "\x1f".join(repr(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1


def generator(*parts: object) -> torch.Generator:
    """A CPU generator for the stream named by `parts` (noise is drawn on the CPU, then moved)."""
    return torch.Generator(device="cpu").manual_seed(stream_seed(*parts))
