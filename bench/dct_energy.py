"""How much of a block delta's energy the top share of its values holds, in the raw coordinates and
in the DCT-II of 64-value blocks (issue #24: does a DCT-chunked sparse codec pay?).

    .venv/bin/python -m bench.dct_energy

The delta is bench/transport.py's real update (block 1 of the default shape after --steps AdamW
steps); tensors under 4,096 values are left out, as the sparse codecs keep most of those anyway.
A DCT codec was built on this evidence (commit ef73ec5) and trained worse than sparse2 at the same
bytes (BENCHMARKS.md, comms notes), so it was taken out again; this probe stays as the record.
"""

from __future__ import annotations

import argparse
import math

import torch

from bench.report import publish
from bench.runs import Metric
from bench.transport import trained_delta

SHARES = (0.1, 0.03, 0.01, 0.003)


def dct_basis(n: int = 64) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64)
    d = torch.cos(math.pi / n * (k[None, :] + 0.5) * k[:, None]) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d.float()  # orthonormal rows


def kept_energy(x: torch.Tensor, share: float) -> float:
    v = x.reshape(-1).square()
    return float(v.topk(max(1, int(share * v.numel()))).values.sum() / v.sum())


def metrics(res: dict) -> dict[str, Metric]:
    """Share of an update's energy in its largest values, raw and after a 64-point DCT."""
    return {f"top {r['share']:.1%}, {kind}: energy share": r[kind] for r in res["rows"] for kind in ("raw", "dct64")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    _, delta, _, _ = trained_delta(args.steps)
    flat = torch.cat([t.reshape(-1) for t in delta.values() if t.numel() >= 4096])
    x = flat[:flat.numel() // 64 * 64].view(-1, 64)
    coeffs = x @ dct_basis().T
    rows = [{"share": s, "raw": kept_energy(x, s), "dct64": kept_energy(coeffs, s)} for s in SHARES]
    out = {"steps": args.steps, "values": x.numel(), "rows": rows}
    publish("dct-energy", out, metrics(out))
    for r in rows:
        print(f"top {r['share']:.1%}: raw keeps {r['raw']:.3f} of the energy, DCT-64 {r['dct64']:.3f}")


if __name__ == "__main__":
    main()
