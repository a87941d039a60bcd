"""Tail blocks (issue #11, item 2): does continuing the sweep below σ_lo commit a segment jointly?

Takes the scoring blocks of a trained model, trains T tail blocks on [σ_gen, σ_lo] (K > 1 only,
on their own, as a worker would), then generates 256 new bytes after each fixed judge prompt at
K = 16 (temperature 1 and greedy) with n_tail ∈ --n-tail tail steps, and scores the continuations
with the judge (judge CE, distinct 4-grams, repeat fraction, word rate) beside the real text.

    .venv/bin/python -m bench.tail --main runs/bench-quality/deployed --judge runs/judge --steps 700

Writes <out>/tail.json (one row per setting); the BENCHMARKS notes quote it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from bench.flags import BenchParser
from bench.report import publish
from bench.runs import Metric

from btnode.data import corpus
from btnode.data.windows import WindowSampler
from btnode.model.config import ModelConfig
from btnode.model.layout import generation_layout
from btnode.model.sampler import generation_sweep
from btnode.model.targets import target_table
from btnode.seeding import generator
from btnode.serve.readouts import sample_bytes
from btnode.serve.stages import max_prompt
from btnode.serve.window import keep_bytes, window_start
from btnode.store.models import block_stem, init_block, load_ar, load_block, load_blocks
from btnode.train.config import TrainConfig
from btnode.train.trainers import BlockTrainer


def train_tail(cfg: ModelConfig, steps: int, out: Path, lr: float) -> list:
    """Tail blocks B … B+T−1 trained one after another, each alone (one worker per block)."""
    from btnode.store import files
    from btnode.store.models import model_meta

    tc = TrainConfig(steps=steps, batch=32, lr=lr, warmup=max(1, steps // 20))
    sampler = WindowSampler(corpus.bundled().train, cfg.context)
    table = target_table(cfg)
    tails = []
    for b in range(cfg.n_blocks, cfg.total_blocks):
        if (out / f"{block_stem(b)}.json").exists():
            tails.append(load_block(out, b, expected=cfg).model)
            print(f"[tail] block {b}: reusing {out}", flush=True)
            continue
        tr = BlockTrainer(init_block(cfg, b, 0), tc, block=b, table=table, device=torch.device("cpu"))
        t0 = time.perf_counter()
        for step in range(steps):
            stats = tr.train_step(sampler.batch(tc.seed, b, step, tc.batch), b)
            if step % 50 == 0 or step == steps - 1:
                print(f"[tail] block {b} step {step} ce {stats.ce:.3f} K={stats.k} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        optim, groups = files.optimizer_tensors(tr.opt)
        files.save(out, block_stem(b), tensors=tr.model.state_dict(), optim=optim,
                   meta={**model_meta(cfg), "kind": "block", "block": b, "step": tr.step,
                         "train": dataclasses.asdict(tc), "optim_groups": groups})
        tails.append(tr.model.eval())
    return tails


def write_served(cfg: ModelConfig, blocks: list, main_dir: Path, tail_dir: Path, served: Path) -> None:
    """One train-local folder holding the B + T blocks under the tailed configuration. The scoring
    blocks' weights are unchanged: their training never depends on the tail fields."""
    from btnode.store import files
    from btnode.store.models import model_meta

    served.mkdir(parents=True, exist_ok=True)
    for b, blk in enumerate(blocks):
        src = load_block(main_dir if b < cfg.n_blocks else tail_dir, b)
        files.save(served, block_stem(b), tensors=blk.state_dict(), optim=None,
                   meta={**src.meta, **model_meta(cfg), "kind": "block", "block": b,
                         "source": str(main_dir if b < cfg.n_blocks else tail_dir)})
    print(f"[tail] wrote the served model (B={cfg.n_blocks} + T={cfg.tail_blocks}) to {served}", flush=True)


@torch.no_grad()
def continue_prompts(blocks: list, prompts: list[bytes], *, n_bytes: int, k: int, n_steps: int, n_tail: int,
                     seed: int, temperature: float) -> list[bytes]:
    """All prompts as one batch (they share a length, so their windows restart together); the
    window rule and the seeded streams are the serving chain's."""
    cfg: ModelConfig = blocks[0].cfg
    table = target_table(cfg)
    texts = [bytearray(p) for p in prompts]
    limit = max_prompt(cfg.context, k)
    keep, start, produced, segment = keep_bytes(limit, cfg.context), 0, 0, 0
    used = blocks if n_tail else blocks[:cfg.n_blocks]
    while produced < n_bytes:
        start = window_start(start, len(texts[0]), limit, keep)
        ctx = torch.tensor([list(t[start:]) for t in texts], dtype=torch.long)
        caches = [b.encode_context(ctx) for b in used]
        layout = generation_layout(ctx.shape[1], k)
        grid0 = cfg.sigma_hi
        z = torch.stack([grid0 * torch.randn(k, cfg.d_model, generator=generator("gen-noise", seed + i, segment))
                         for i in range(len(texts))])
        logits = generation_sweep(used, caches, z, n_steps, n_tail, layout, table)
        for i, t in enumerate(texts):
            ids = sample_bytes(logits[i], temperature, generator("gen-sample", seed + i, segment))
            t += bytes(ids.tolist())
        produced += k
        segment += 1
    return [bytes(t[len(p):len(p) + n_bytes]) for t, p in zip(texts, prompts)]


def main() -> None:
    ap = BenchParser(__doc__)
    ap.add_argument("--main", type=Path, required=True, help="train-local folder with the B scoring blocks")
    ap.add_argument("--judge", type=Path, required=True, help="judge checkpoint (AR folder)")
    ap.add_argument("--out", type=Path, default=Path("runs/tail"))
    ap.add_argument("--served", type=Path, help="also write every block (scoring + tail) under the tailed "
                                               "configuration into this folder, for bench.serving")
    ap.add_argument("--steps", type=int, default=700, help="steps per tail block")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--tail-blocks", type=int, default=1)
    ap.add_argument("--sigma-gen", type=float, default=0.1)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--n-steps", type=int, default=7)
    ap.add_argument("--n-tail", default="0,4,8,16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--bytes", type=int, default=256)
    args = ap.parse_args()

    from btnode.evaluation import judge as J

    base_cfg, main_blocks = load_blocks(args.main)
    cfg = dataclasses.replace(base_cfg, tail_blocks=args.tail_blocks, sigma_gen=args.sigma_gen)
    if args.k not in cfg.segments:
        raise SystemExit(f"K={args.k} is not trained by {args.main} (segments {cfg.segments})")
    main = []
    for blk in main_blocks[:base_cfg.n_blocks]:  # the same weights under the tailed configuration
        m = type(blk)(cfg)
        m.load_state_dict(blk.state_dict())
        main.append(m.eval())
    args.out.mkdir(parents=True, exist_ok=True)
    tails = train_tail(cfg, args.steps, args.out, args.lr)
    blocks = main + tails
    if args.served:
        write_served(cfg, blocks, args.main, args.out, args.served)

    judge = load_ar(args.judge).model.eval()
    words = J.english_words()
    prompts = J.fixed_prompts(corpus.bundled().test, args.prompts)

    def score(pairs: list) -> dict:
        return J.score_samples(judge, pairs, words=words).to_dict(per_sample=False)

    rows = [{"setting": "real", **score([(p.prompt, p.reference[:args.bytes]) for p in prompts])}]
    for n_tail in [int(x) for x in args.n_tail.split(",")]:
        for temperature in (1.0, 0.0):
            t0 = time.perf_counter()
            conts = continue_prompts(blocks, [p.prompt for p in prompts], n_bytes=args.bytes, k=args.k,
                                     n_steps=args.n_steps, n_tail=n_tail, seed=0, temperature=temperature)
            row = {"setting": f"K={args.k} N_s={args.n_steps} n_tail={n_tail} T={temperature:g}", "k": args.k,
                   "n_steps": args.n_steps, "n_tail": n_tail, "temperature": temperature,
                   "gen_s": time.perf_counter() - t0,
                   **score([(p.prompt, c) for p, c in zip(prompts, conts)]),
                   "sample": conts[0].decode("utf-8", "replace")}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "samples"}), flush=True)
    res = {"main": str(args.main), "steps": args.steps, "sigma_gen": args.sigma_gen, "tail_blocks": args.tail_blocks,
           "rows": rows}
    publish("tail", res, metrics(res))


def metrics(res: dict) -> dict[str, Metric]:
    """The judge's CE of real text and of each tail setting's continuations."""
    return {f"{r['setting']}: judge CE": r["judge_ce"] for r in res["rows"]}


if __name__ == "__main__":
    main()
