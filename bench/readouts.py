"""Where the pooled chain's gain comes from (issue #10): score one block checkpoint's readouts at
K = 1 on the same held-out windows and rows as `btnode eval`:

- `last`: the sweep's last evaluation (the design's readout), SCE-S;
- `pool`: the default, every block's context readout pooled with the last evaluation, SCE-S;
- `ctx_pool`: the B context readouts alone, pooled the same way (no sweep at all: a plain
  log-linear ensemble of the blocks' own readings of the context);
- `ctx_b`: block b's context readout alone.

If `pool` ≈ `ctx_pool`, the chain's gain over its best block is ensembling, not the sweep.

    .venv/bin/python -m bench.readouts runs/bench-quality/deployed --windows 512
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.flags import BenchParser

from btnode.data import corpus
from btnode.data.windows import eval_windows
from btnode.evaluation.metrics import sampler_ce
from btnode.model.layout import eval_layout
from btnode.model.noise import default_steps
from btnode.model.sampler import context_logits, log_probs, pool
from btnode.store.models import load_blocks


@torch.no_grad()
def context_readouts(blocks: list, windows: torch.Tensor, batch: int = 64) -> dict[str, float]:
    layout = eval_layout(blocks[0].cfg.context, 1)
    sums = {f"ctx_{b}": 0.0 for b in range(len(blocks))} | {"ctx_pool": 0.0}
    count = 0
    for lo in range(0, len(windows), batch):
        w = windows[lo:lo + batch]
        tgt = w[:, 1:][:, layout.positions][..., None]
        ctx = [context_logits(b, b.encode_context(w[:, :-1]), layout) for b in blocks]
        for name, logits in [*((f"ctx_{i}", c) for i, c in enumerate(ctx)), ("ctx_pool", pool(ctx))]:
            sums[name] -= float(log_probs(logits).double().gather(-1, tgt).sum())
        count += tgt.numel()
    return {k: v / count for k, v in sums.items()}


def main() -> None:
    ap = BenchParser(__doc__)
    ap.add_argument("checkpoint", type=Path)
    ap.windows(512)
    ap.seeds(8)
    ap.add_argument("--version", type=int, help="a version of an aggregator state folder")
    args = ap.parse_args()
    cfg, blocks = load_blocks(args.checkpoint, args.version)
    for b in blocks:
        b.eval()
    w = eval_windows(corpus.bundled().test, cfg.context, args.windows)
    res: dict = {"checkpoint": str(args.checkpoint), "windows": len(w), "seeds": args.seeds}
    for readout in ("last", "pool"):
        r = sampler_ce(blocks, w, k=1, seeds=range(args.seeds), n_steps=default_steps(cfg), device=torch.device("cpu"),
                       readout=readout)
        res[readout] = r.sce
    res.update(context_readouts(blocks, w))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
