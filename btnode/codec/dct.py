"""The DCT of 64-value blocks under the sparse codecs (Codec.DCT8, Codec.DCT2; issue #24).

A block delta's energy is not spread evenly over neighbouring coordinates: measured on a real
25-step delta of the default block, the top 1 % of coordinates hold 5 % of its energy, the top 1 %
of DCT-II coefficients of its 64-value blocks 19 % (BENCHMARKS.md, comms notes). So these codecs
transform each run of 64 values (the tensor zero-padded to a multiple of 64) with the orthonormal
DCT-II, and send the coefficients through the sparse codec (codec/sparse.py, one 4,096-value chunk =
64 blocks); decoding inverts the transform. Orthonormal: norms and dot products are those of the
padded values, so the aggregator's norm screen and clip see the same numbers.

Decoding uses a matrix product, whose last bits may differ between machines and thread counts, so
these codecs are for updates (the aggregator alone decodes them) and never for published deltas,
which every replica must decode to the same bits.
"""

from __future__ import annotations

import math

import torch

BLOCK = 64


def _basis() -> torch.Tensor:
    k = torch.arange(BLOCK, dtype=torch.float64)
    d = torch.cos(math.pi / BLOCK * (k[None, :] + 0.5) * k[:, None]) * math.sqrt(2 / BLOCK)
    d[0] /= math.sqrt(2)
    return d.float()  # row k: the k-th basis vector; d @ d.T = I


BASIS = _basis()


def padded(numel: int) -> int:
    return -(-numel // BLOCK) * BLOCK


def forward(flat: torch.Tensor) -> torch.Tensor:
    """Values (n) → DCT coefficients (padded(n)), block by block."""
    x = torch.nn.functional.pad(flat, (0, padded(flat.numel()) - flat.numel()))
    return (x.view(-1, BLOCK) @ BASIS.T).reshape(-1)


def inverse(coeffs: torch.Tensor, numel: int) -> torch.Tensor:
    """DCT coefficients (padded(n)) → values (n)."""
    return (coeffs.view(-1, BLOCK) @ BASIS).reshape(-1)[:numel]
