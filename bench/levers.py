"""Model levers (issue #10): train the B blocks, each on its own for a fixed number of its own steps,
and score every readout of the same sweeps on the **tuning slice** (never the held-out test file):

- `last`: today's readout, the softmax of the last evaluation at σ_lo;
- `pool_prob` / `pool_logp`: the mean probability / mean log-probability of every evaluation of the
  sweep (the chain pooling its blocks' own predictions);
- `alone_b`: block b read alone, once, from pure noise at σ_hi;
- `self_b`: block b run alone over the whole grid with the `pool_logp` readout, so that a gain of
  pooling that is only self-ensembling over grid points is not credited to composition.

Each is SCE-1 (seed 0) and SCE-S (probabilities averaged over S seeds). Optionally the AR
baselines train for the same number of steps on the same windows. One JSON line per run is
appended to bench/results/levers.jsonl, so that every tried lever keeps its number.

    .venv/bin/python -m bench.levers --name base --steps 800
    .venv/bin/python -m bench.levers --name k1-75 --steps 800 --k1-share 0.75
    .venv/bin/python -m bench.levers --name ada-rank-16 --k1-share 0.9 --ctx-share 0.25 --ada-rank 16
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import torch

from bench.flags import BenchParser
from bench.report import RESULTS, publish, result_path
from bench.runs import Metric, slug
from btnode.data import corpus
from btnode.data.windows import WindowSampler, eval_windows
from btnode.evaluation.metrics import _noise, ar_ce, sampler_ce
from btnode.model.config import ModelConfig
from btnode.model.layout import eval_layout
from btnode.model.noise import default_steps, sigma_grid
from btnode.model.sampler import context_logits, sweep_trace
from btnode.model.targets import target_table
from btnode.store.models import init_ar, init_block
from btnode.train.config import TrainConfig
from btnode.train.trainers import ARTrainer, BlockTrainer




def nll(q: torch.Tensor, tgt: torch.Tensor) -> float:
    return float(-torch.log(q.gather(-1, tgt[..., None]).clamp_min(1e-300)).sum())


@torch.no_grad()
def readouts(blocks: list, windows: torch.Tensor, seeds: int, n_steps: int, self_sweeps: bool) -> dict[str, float]:
    cfg: ModelConfig = blocks[0].cfg
    for b in blocks:
        b.eval()
    table, grid = target_table(cfg), sigma_grid(cfg, n_steps)
    layout = eval_layout(cfg.context, 1)
    sums: dict[str, float] = {}
    count = 0

    def add(name: str, q: torch.Tensor, tgt: torch.Tensor) -> None:
        sums[name] = sums.get(name, 0.0) + nll(q, tgt)

    for lo in range(0, len(windows), 64):
        w = windows[lo:lo + 64]
        ids = torch.arange(lo, lo + len(w))
        tgt = w[:, 1:][:, layout.positions]
        caches = [b.encode_context(w[:, :-1]) for b in blocks]
        acc: dict[str, torch.Tensor] = {}
        for j in range(seeds):
            z0 = grid[0] * _noise(j, ids, len(layout.positions), cfg.d_model)
            runs = {"chain": sweep_trace(blocks, caches, z0, grid, layout, table)}
            if self_sweeps:
                for b in range(len(blocks)):
                    runs[f"self_{b}"] = sweep_trace([blocks[b]] * len(blocks), [caches[b]] * len(blocks), z0, grid,
                                                    layout, table)
            probs = {}
            for name, trace in runs.items():
                logp = torch.stack([torch.log_softmax(lg.double(), -1) for _, lg in trace])  # (E, W, T, V)
                if name == "chain":
                    probs["last"] = logp[-1].exp()
                    probs["pool_prob"] = logp.exp().mean(0)
                    probs["pool_logp"] = torch.softmax(logp.mean(0), -1)
                    firsts = [next(i for i, (b, _) in enumerate(trace) if b == k) for k in range(len(blocks))]
                    probs["pool_first_logp"] = torch.softmax(logp[firsts].mean(0), -1)
                else:
                    probs[name] = torch.softmax(logp.mean(0), -1)
            sig = torch.full((len(w),), grid[0])
            ctx_logp = []
            for b, blk in enumerate(blocks):
                probs[f"alone_{b}"] = torch.softmax(blk.denoise(z0, sig, caches[b], layout).double(), -1)
                ctx_logp.append(torch.log_softmax(context_logits(blk, caches[b], layout).double(), -1))
                probs[f"ctx_{b}"] = ctx_logp[-1].exp()
            probs["pool_ctx"] = torch.softmax(torch.stack(ctx_logp).mean(0), -1)
            probs["pool_ctx_prob"] = torch.stack(ctx_logp).exp().mean(0)
            last = torch.log_softmax(runs["chain"][-1][1].double(), -1)
            probs["pool_ctx_last"] = torch.softmax(torch.stack([*ctx_logp, last]).mean(0), -1)
            for name, p in probs.items():
                if j == 0:
                    add(name + "@1", p, tgt)
                acc[name] = acc.get(name, 0) + p / seeds
        for name, q in acc.items():
            add(name + f"@{seeds}", q, tgt)
        count += tgt.numel()
    return {k: v / count for k, v in sums.items()}


def step_ratio(cfg: ModelConfig, tc: TrainConfig, sampler: WindowSampler, n: int = 12) -> float:
    """Seconds of a block-0 step over seconds of an AR-L step (L = the block's layers), measured side by
    side on throwaway models: steps interleaved, 3 warm-ups, the ratio of the medians."""
    dev = torch.device("cpu")
    block = BlockTrainer(init_block(cfg, 0, 0), tc, block=0, table=target_table(cfg), device=dev)
    ar = ARTrainer(init_ar(cfg, cfg.n_layers, 0), tc, dev)
    times: dict[str, list[float]] = {"block": [], "ar": []}
    for i in range(n + 3):
        x = sampler.batch(tc.seed + 1000, 0, i, tc.batch)
        for name, tr in (("block", block), ("ar", ar)):
            t0 = time.perf_counter()
            tr.train_step(x, 0)
            times[name].append(time.perf_counter() - t0)
    return statistics.median(times["block"][3:]) / statistics.median(times["ar"][3:])


def metrics(row: dict) -> dict[str, Metric]:
    """Held-out CE of the last block and of the pool at each K, and of each AR model trained beside. An
    --equal-time run: the chain's SCE-S with the default readout (its blocks' context readouts pooled with
    the last evaluation), its best block's context readout, the step-time ratio and the AR models."""
    ar = {k: v for k, v in row.items() if k.startswith("ar") and isinstance(v, float)}
    if "block_step_over_ar_block_step" in row:
        seeds = row["args"]["seeds"]
        best = min(v for k, v in row.items() if k.startswith("ctx_") and k.endswith(f"@{seeds}"))
        return {f"chain SCE-{seeds}": row[f"pool_ctx_last@{seeds}"], "best block's readout": best,
                "block step / AR-L step": row["block_step_over_ar_block_step"], "block steps": row["block_steps"],
                **{f"chain SCE-{seeds}, K = {k[7:k.index('@')]}": v for k, v in row.items()
                   if k.startswith("chain_k") and k.endswith(f"@{seeds}")}, **ar}
    return {k: v for k, v in row.items() if k.startswith(("last@", "pool_prob@")) and isinstance(v, float)} | ar


def main() -> None:
    ap = BenchParser(__doc__)
    ap.add_argument("--name", required=True)
    ap.add_argument("--steps", type=int, default=800, help="optimizer steps per block (and per AR model)")
    ap.shape(ModelConfig(d_model=64, context=64), "d_model", "n_heads", "n_layers", "n_blocks", "context", "segments",
             "ada_rank", "ctx_head")
    ap.add_argument("--k1-share", type=float)
    ap.add_argument("--ctx-share", type=float, default=0.0)
    ap.add_argument("--noisy-rows", type=float, default=TrainConfig.noisy_rows,
                    help="share of a window's segments the noisy stream trains on (default: btnode's)")
    ap.add_argument("--ctx-weight", type=float, default=TrainConfig.ctx_weight,
                    help="weight of the clean head's CE (--ctx-head 1; default: btnode's)")
    ap.add_argument("--equal-time", action="store_true",
                    help="--steps are the AR models' steps; each block gets as many steps as take the AR-L model's time "
                         "for --steps (the step-time ratio measured here, side by side, before training)")
    ap.batch(32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0, help="training seed (initialisation, windows, σ, noise)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.windows(256, help="windows of the tuning slice scored")
    ap.seeds(8)
    ap.add_argument("--ar", default="", help="comma-separated AR depths to train for the same steps, e.g. 2,6")
    ap.add_argument("--ar-only", action="store_true", help="train and score only the --ar models (a point of their "
                    "learning curve at --steps, to set a block's numbers beside per step)")
    ap.add_argument("--kmax", action="store_true", help="also the chain's SCE-S at the largest trained K (default readout)")
    ap.add_argument("--self-sweeps", action="store_true", help="also run each block alone over the whole grid")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    cfg = args.shape
    tc = TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed, warmup=max(10, args.steps // 20),
                     weight_decay=args.weight_decay, k1_share=args.k1_share,
                     ctx_share=args.ctx_share, noisy_rows=args.noisy_rows, ctx_weight=args.ctx_weight)
    data = corpus.bundled()
    sampler = WindowSampler(data.train, cfg.context)
    table = target_table(cfg)
    ratio = step_ratio(cfg, tc, sampler) if args.equal_time else None
    block_steps = round(args.steps / ratio) if ratio else args.steps
    if ratio:
        tc = dataclasses.replace(tc, steps=block_steps, warmup=max(10, block_steps // 20))
        print(f"block step / AR-{cfg.n_layers} step = {ratio:.3f}: {block_steps} block steps", flush=True)
    t0 = time.perf_counter()
    blocks = []
    for b in range(0 if args.ar_only else cfg.n_blocks):
        tr = BlockTrainer(init_block(cfg, b, args.seed), tc, block=b, table=table, device=torch.device("cpu"))
        for step in range(block_steps):
            tr.train_step(sampler.batch(tc.seed, b, step, tc.batch), b)
        blocks.append(tr.model)
    train_s = time.perf_counter() - t0
    windows = eval_windows(data.tune, cfg.context, args.windows)
    res = readouts(blocks, windows, args.seeds, default_steps(cfg), args.self_sweeps) if blocks else {}
    if blocks and args.kmax:
        k = max(cfg.segments)
        s = sampler_ce(blocks, windows, k=k, seeds=range(args.seeds), n_steps=default_steps(cfg), device=torch.device("cpu"))
        res[f"chain_k{k}@1"], res[f"chain_k{k}@{args.seeds}"] = s.sce1, s.sce
    tc_ar = dataclasses.replace(tc, steps=args.steps, warmup=max(10, args.steps // 20))
    for depth in filter(None, args.ar.split(",")):
        tr = ARTrainer(init_ar(cfg, int(depth), args.seed), tc_ar, torch.device("cpu"))
        for step in range(args.steps):
            tr.train_step(sampler.batch(tc.seed, 0, step, tc.batch))
        res[f"ar{depth}"] = ar_ce(tr.model, windows, device=torch.device("cpu"))
    row = {"name": args.name, "note": args.note, "args": {k: v for k, v in vars(args).items() if k != "shape"},
           "train_s": round(train_s, 1), "block_steps": block_steps,
           **({"block_step_over_ar_block_step": round(ratio, 3)} if ratio else {}),
           "date": time.strftime("%Y-%m-%d %H:%M"), **{k: round(v, 4) for k, v in res.items()}}
    print(json.dumps(row), flush=True)
    # equal-time and AR-curve runs (issue #42) are kept beside, unrendered (BENCHMARKS.md's word budget);
    # docs/research.md tables them
    aside = args.equal_time or args.ar_only
    publish("levers", row, metrics(row), out=RESULTS / "levers" / "equal-time" / f"{slug(args.name)}.json" if aside
            else result_path("levers", slug(args.name)))


if __name__ == "__main__":
    main()
