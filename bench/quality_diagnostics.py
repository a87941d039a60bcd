"""Where does the blockwise model lose? Two diagnostics on a trained block checkpoint, scored on
the tuning slice (never the held-out test):

1. SCE-1/SCE-8 at K=1 as the number of sampler steps N_s grows;
2. each block's CE when given the true target noised at a fixed σ (σ = 10 ≈ no target information,
   so it measures the block's own reading of the context).

    .venv/bin/python -m bench.quality_diagnostics runs/bench-quality/blocks --windows 64
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from bench.flags import BenchParser

from btnode.data import corpus
from btnode.data.windows import eval_windows
from btnode.evaluation.metrics import sampler_ce
from btnode.model.readout import Readout
from btnode.model.layout import eval_layout
from btnode.model.targets import target_table
from btnode.store.models import load_blocks


def main() -> None:
    ap = BenchParser(__doc__)
    ap.add_argument("checkpoint", type=Path)
    ap.windows(64, help="windows of the tuning slice scored")
    args = ap.parse_args()
    cfg, blocks = load_blocks(args.checkpoint)
    w = eval_windows(corpus.bundled().tune, cfg.context, args.windows)
    dev = torch.device("cpu")
    for n_steps in (cfg.n_blocks + 1, 2 * cfg.n_blocks + 1, 4 * cfg.n_blocks + 1, 8 * cfg.n_blocks + 1):
        r = sampler_ce(blocks, w, k=1, seeds=range(8), n_steps=n_steps, device=dev, readout=Readout.LAST)
        print(f"N_s={n_steps:<3d} SCE-1 {r.sce1:.4f}  SCE-8 {r.sce:.4f}", flush=True)
    table = target_table(cfg)
    layout = eval_layout(cfg.context, 1)
    tgt = w[:, 1:][:, layout.positions]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for b, blk in enumerate(blocks):
            blk.eval()
            cache = blk.encode_context(w[:, :-1])
            row = []
            for sigma in (10.0, 4.0, 2.0, 1.3, 1.0):
                z = table[tgt] + sigma * torch.randn(tgt.shape + (cfg.d_model,), generator=g)
                logits = blk.denoise(z, torch.full((len(w),), sigma), cache, layout)
                row.append(f"σ={sigma:g}: {F.cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1)).item():.4f}")
            print(f"block {b} given its noised target  " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
