"""How the last stage should commit a K-byte segment (issue #11, item 2): teacher-forced likelihood of
the segment under each readout the last stage can compute without another traversal.

For W held-out windows of wiki.test.raw, the segment is the K bytes after the first N/2 (every row
has ≥ N/2 bytes of context, as in SCE). Each readout is a generator of the segment; its likelihood
of the real bytes, averaged over S seeds of the sweep's noise (log-mean-exp of the segment's
log-likelihood over seeds: in expectation a lower bound on the generator's likelihood, so it
cannot flatter), divided by K, is the column "S-seed". The first seed alone is "1 seed".

- independent: the plain readout ("last"): all K rows of the sweep's last evaluation, sampled
  independently (what K > 1 served before the commit readout).
- commit, last evaluation: row j re-read by the last block from the same final state with the
  j real bytes before it as clean context.
- commit, pooled (the served "commit" readout): the same row pooled with the last block's own
  context readout at that context.
- last block, noise state: as "commit, last evaluation" but the state is fresh noise at σ_lo (the
  block without the chain: does the chain's state help?).
- last block, context readout: the block's z = 0 reading alone (deterministic; no state at all).
- the B·L-layer AR model, teacher-forced, on the same bytes.

    .venv/bin/python -m bench.commit --blocks runs/served --ar runs/bench-quality/ar6

Writes bench/results/commit.json and the "commit" section of BENCHMARKS.md.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from bench.flags import BenchParser
from bench.report import invoked, publish, table
from bench.runs import Metric

from btnode.data import corpus
from btnode.data.windows import eval_windows
from btnode.model.layout import generation_layout
from btnode.model.noise import default_steps, sigma_grid
from btnode.model.sampler import block_denoiser, context_logits, log_probs, pool, run_span, spans
from btnode.model.targets import target_table
from btnode.seeding import generator
from btnode.store.models import load_ar, load_blocks

READERS = ("independent", "commit, last evaluation", "commit, pooled", "last block, noise state",
           "last block, context readout")


def noise(tag: str, seed: int, n: int, k: int, d: int) -> torch.Tensor:
    return torch.stack([torch.randn(k, d, generator=generator(tag, seed, i)) for i in range(n)])


@torch.no_grad()
def measure(blocks: list, ar: torch.nn.Module, windows: torch.Tensor, k: int, seeds: int, n_steps: int) -> dict:
    cfg = blocks[0].cfg
    table, grid = target_table(cfg), sigma_grid(cfg, n_steps)
    parts = spans(len(blocks), n_steps)
    c = cfg.context // 2
    tgt = windows[:, c:c + k]
    last, n = blocks[-1], len(windows)
    sig = torch.full((n,), grid[-1])

    def score(lp: torch.Tensor, j: int) -> torch.Tensor:  # (W, V) log-probs of byte j → (W,)
        return lp.gather(-1, tgt[:, j:j + 1])[:, 0]

    caches = [b.encode_context(windows[:, :c]) for b in blocks]
    grown = [last.encode_context(windows[:, :c + j]) for j in range(k)]
    own = [log_probs(context_logits(last, grown[j], generation_layout(c + j, 1))[:, 0]).double() for j in range(k)]
    ll = {r: [] for r in READERS}
    for s in range(seeds):
        z = grid[0] * noise("commit-bench", s, n, k, cfg.d_model)
        layout = generation_layout(c, k)
        for b, (blk, cache, span) in enumerate(zip(blocks, caches, parts)):
            z, _ = run_span(block_denoiser(blk, cache, layout), z, grid, span[:-1] if b == len(blocks) - 1 else span,
                            table)
        zn = grid[-1] * noise("commit-bench-alone", s, n, k, cfg.d_model)
        tot = {r: torch.zeros(n, dtype=torch.float64) for r in READERS}
        independent = log_probs(last.denoise(z, sig, caches[-1], layout)).double()
        for j in range(k):
            rows = generation_layout(c + j, k - j)
            lp = log_probs(last.denoise(z[:, j:], sig, grown[j], rows)[:, 0]).double()
            tot["independent"] += score(independent[:, j], j)
            tot["commit, last evaluation"] += score(lp, j)
            tot["commit, pooled"] += score(pool([own[j], lp]), j)
            tot["last block, noise state"] += score(log_probs(last.denoise(zn[:, j:], sig, grown[j], rows)[:, 0]).double(), j)
            tot["last block, context readout"] += score(own[j], j)
        for r in READERS:
            ll[r].append(tot[r])
    out = {}
    for r, v in ll.items():
        v = torch.stack(v)  # (S, W)
        out[r] = {"one_seed": float(-v[0].mean() / k),
                  "mixture": float(-(torch.logsumexp(v, 0) - math.log(seeds)).mean() / k)}
    ar_ll = sum(score(log_probs(ar(windows[:, :c + j])[:, -1]).double(), j) for j in range(k))
    out["AR (teacher-forced)"] = {"one_seed": float(-ar_ll.mean() / k), "mixture": float(-ar_ll.mean() / k)}
    return out


def main() -> None:
    ap = BenchParser(__doc__)
    ap.add_argument("--blocks", type=Path, required=True)
    ap.add_argument("--ar", type=Path, required=True, help="the B·L-layer AR checkpoint, for its row")
    ap.add_argument("--ks", default="16")
    ap.windows(256)
    ap.seeds(4)
    ap.result("commit")
    args = ap.parse_args()
    cfg, blocks = load_blocks(args.blocks)
    blocks = [b.eval() for b in blocks[:cfg.n_blocks]]
    ar = load_ar(args.ar).model.eval()
    windows = eval_windows(corpus.bundled().test, cfg.context, args.windows)
    n_steps = default_steps(cfg)
    res = {"command": invoked(), "date": time.strftime("%Y-%m-%d"), "windows": args.windows,
           "seeds": args.seeds, "n_steps": n_steps, "per_k": {}}
    for k in (int(x) for x in args.ks.split(",")):
        if k not in cfg.segments:
            raise SystemExit(f"K={k} was not trained by {args.blocks} (segments {list(cfg.segments)})")
        res["per_k"][str(k)] = measure(blocks, ar, windows, k, args.seeds, n_steps)
        for r, v in res["per_k"][str(k)].items():
            print(f"[commit] K={k} {r}: 1 seed {v['one_seed']:.4f}, {args.seeds}-seed {v['mixture']:.4f}", flush=True)
    publish("commit", res, metrics(res), render, out=args.results)


def metrics(res: dict) -> dict[str, Metric]:
    """CE (nats/byte, mixture over seeds) of each way of committing, at each K."""
    return {f"K = {k}, {way}: CE": v["mixture"] for k, ways in res["per_k"].items() for way, v in ways.items()}


def render(res: dict) -> str:
    lines = ["## How the last stage commits a segment (`bench/commit.py`)", "",
             f"Command: `{res['command']}` ({res['date']}). Teacher-forced nats/byte of the K bytes after the first "
             f"N/2 of {res['windows']} held-out windows, N_s = {res['n_steps']}; \"S-seed\" is the log-mean-exp over "
             f"{res['seeds']} seeds of each segment's log-likelihood (see the script's docstring).", "",
             *table(["K", "readout", "1 seed", "S-seed"],
                    [(k, r, f"{v['one_seed']:.4f}", f"{v['mixture']:.4f}")
                     for k, rows in res["per_k"].items() for r, v in rows.items()], "rlrr")]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
