"""Memory at scale (issue #12, item 3): peak RSS and training-state bytes of a process training one
block against a process training the whole model, at several widths, with `btnode plan`'s
prediction beside each measurement.

"The whole model" is the B·L-layer autoregressive model (`btnode train-ar`): what a lab trains
instead, and what every DiLoCo worker holds a replica of. Each run is its own child measured with
wait4, twice: the btnode command itself (which writes a checkpoint with optimizer state at the end)
and a bare training loop without checkpoints (what a swarm worker's steps need). This process
never imports torch, so it stays small and measures nothing of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS, ROOT, measure, shown, update_section  # noqa: E402

# One thread: this benchmark measures bytes, not speed, and the machine is shared; the children inherit it.
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

BTNODE = str(Path(sys.executable).with_name("btnode"))
BLOCKS, LAYERS, CONTEXT, BATCH, STEPS = 4, 2, 128, 2, 2
# (d_model, heads, batch). Head width 64; the largest AR model has 310 M parameters. The first row is
# the project's default width at its default batch, where activations, not the state, dominate.
SIZES = [(128, 4, 32), (512, 8, BATCH), (1024, 16, BATCH), (1792, 28, BATCH)]
QUICK_SIZES = [(64, 2, 8), (96, 2, BATCH), (128, 2, BATCH)]
GB, MB = 1e9, 2**20


def shape(d: int, heads: int) -> list[str]:
    return ["--d-model", str(d), "--heads", str(heads), "--layers", str(LAYERS), "--blocks", str(BLOCKS),
            "--context", str(CONTEXT), "--segments", "1,16"]


def parameters(folder: Path, stem: str) -> int:
    """Parameter count of a written checkpoint, from its safetensors header (no torch needed)."""
    with open(folder / f"{stem}.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, spec in header.items():
        if name != "__metadata__":
            count = 1
            for s in spec["shape"]:
                count *= s
            total += count
    return total


def train_loop(kind: str, d: int, heads: int, steps: int, batch: int) -> None:
    """Child: `steps` training steps of block 0 or of the AR model, no checkpoint (a swarm worker's steps)."""
    import torch

    from btnode.data import corpus
    from btnode.data.windows import WindowSampler
    from btnode.model.config import ModelConfig
    from btnode.model.targets import target_table
    from btnode.store.models import init_ar, init_block
    from btnode.train.config import TrainConfig
    from btnode.train.trainers import ARTrainer, BlockTrainer

    cfg = ModelConfig(d_model=d, n_heads=heads, n_layers=LAYERS, n_blocks=BLOCKS, context=CONTEXT, segments=(1, 16))
    tc = TrainConfig(batch=batch, steps=steps, warmup=0)
    cpu = torch.device("cpu")
    trainer = (BlockTrainer(init_block(cfg, 0, 0), tc, block=0, table=target_table(cfg), device=cpu) if kind == "block"
               else ARTrainer(init_ar(cfg, BLOCKS * LAYERS, 0), tc, cpu))
    sampler = WindowSampler(corpus.load(None).train, cfg.context)
    for step in range(steps):
        trainer.train_step(sampler.batch(0, 0, step, batch), 0)


def plan_mb(doc: dict, part: str, key: str) -> float:
    return doc[part][key] / MB


def one_size(d: int, heads: int, out: Path, steps: int, batch: int) -> dict:
    sh = shape(d, heads)
    common = ["--steps", str(steps), "--batch", str(batch), "--warmup", "0", "--checkpoint-every", str(steps)]
    cmds = {
        "block": [BTNODE, "train-local", "--out", str(out / "block"), *common, "--block", "0", *sh],
        "full": [BTNODE, "train-ar", "--out", str(out / "full"), *common, "--ar-layers", str(BLOCKS * LAYERS), *sh],
        "block_train": [sys.executable, __file__, "--child", "block", "--d-model", str(d), "--heads", str(heads),
                        "--steps", str(steps), "--batch", str(batch)],
        "full_train": [sys.executable, __file__, "--child", "ar", "--d-model", str(d), "--heads", str(heads),
                       "--steps", str(steps), "--batch", str(batch)],
        "plan": [BTNODE, "plan", "--json", "--batch", str(batch), *sh],
    }
    rss, walls = {}, {}
    for name in ("block", "full", "block_train", "full_train"):  # one at a time: the big ones never overlap
        m = measure(cmds[name])
        rss[name], walls[name] = m.max_rss_mb, m.wall_s
        print(f"[memory] d={d} {name}: peak RSS {m.max_rss_mb:,.0f} MB in {m.wall_s:.0f} s", flush=True)
    n_block, n_full = parameters(out / "block", "block-0"), parameters(out / "full", "ar")
    shutil.rmtree(out)  # gigabytes of checkpoints, read for their headers only
    p = measure(cmds["plan"])
    doc = json.loads(p.stdout)
    row = {
        "d_model": d, "heads": heads, "batch": batch, "block_params": n_block, "full_params": n_full,
        # training state: fp32 parameters, gradients and AdamW's two moments, 16 bytes per parameter
        "block_state_gb": 16 * n_block / GB, "full_state_gb": 16 * n_full / GB,
        "block_rss_mb": rss["block"], "full_rss_mb": rss["full"],
        "block_train_rss_mb": rss["block_train"], "full_train_rss_mb": rss["full_train"],
        "plan_block_mb": plan_mb(doc, "worker", "peak_bytes"), "plan_full_mb": plan_mb(doc, "end_to_end", "peak_bytes"),
        "plan_block_train_mb": plan_mb(doc, "worker", "train_peak_bytes"),
        "plan_full_train_mb": plan_mb(doc, "end_to_end", "train_peak_bytes"),
        "plan_block_params": doc["worker"]["parameters"], "plan_full_params": doc["end_to_end"]["parameters"],
        "plan_s": p.wall_s, "wall_s": walls,
        "commands": {k: shown(v) for k, v in cmds.items()},
    }
    for part in ("block", "full", "block_train", "full_train"):
        row[f"error_{part}"] = abs(row[f"plan_{part}_mb"] - row[f"{part}_rss_mb"]) / row[f"{part}_rss_mb"]
    print(f"[memory] d={d}: plan {row['plan_block_mb']:,.0f} / {row['plan_full_mb']:,.0f} MB, errors "
          f"{row['error_block']:.1%} / {row['error_full']:.1%} (training only {row['error_block_train']:.1%} / "
          f"{row['error_full_train']:.1%})", flush=True)
    return row


def render(res: dict) -> str:
    def mb(x: float) -> str:
        return f"{x:,.0f}"

    rows = res["sizes"]
    c = rows[-1]["commands"]
    lines = [
        "## Memory at scale (`bench/memory.py`)",
        "",
        f"Command: `.venv/bin/python bench/memory.py` ({res['date']}, {res['machine']}; OMP/MKL threads 1 in every "
        f"child). B={BLOCKS} blocks × L={LAYERS} layers, N={CONTEXT}, {STEPS} steps at the batch shown, fp32, AdamW. "
        f"**Block**: `btnode train-local --block 0` (one worker's block). **Full**: `btnode train-ar --ar-layers "
        f"{BLOCKS * LAYERS}`, the B·L-layer AR model a lab would train instead (and what each DiLoCo worker holds). "
        "Training state = 16 bytes per parameter (parameters, gradients, two AdamW moments), the parameter count "
        "read from the checkpoint each run wrote. Peak RSS from wait4 on each child; the plan column is "
        "`btnode plan --json --batch <batch>` of the same shape (`peak_bytes` of its worker and end-to-end parts: "
        "measured runtime + 16 bytes per parameter + the larger of saved activations and AdamW's temporary + heap "
        "glibc keeps + the checkpoint write, 20 bytes per parameter; see btnode/train/plan.py). MB = MiB.",
        "",
        "| d / heads / batch | block params | full params | block state GB | full state GB | block peak RSS | plan "
        "| error | full peak RSS | plan | error | block / full RSS |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['d_model']} / {r['heads']} / {r['batch']} | {r['block_params'] / 1e6:,.1f} M | {r['full_params'] / 1e6:,.1f} M "
                     f"| {r['block_state_gb']:.2f} | {r['full_state_gb']:.2f} | {mb(r['block_rss_mb'])} | "
                     f"{mb(r['plan_block_mb'])} | {r['error_block']:.1%} | {mb(r['full_rss_mb'])} | "
                     f"{mb(r['plan_full_mb'])} | {r['error_full']:.1%} | {r['block_rss_mb'] / r['full_rss_mb']:.3f} |")
    lines += [
        "",
        "The same steps without the checkpoint write (a bare loop of `BlockTrainer` / `ARTrainer` steps, "
        "`python bench/memory.py --child block|ar ...`), against plan's `train_peak_bytes`:",
        "",
        "| d / heads / batch | block peak RSS | plan | error | full peak RSS | plan | error | block / full RSS |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['d_model']} / {r['heads']} / {r['batch']} | {mb(r['block_train_rss_mb'])} | {mb(r['plan_block_train_mb'])} | "
                     f"{r['error_block_train']:.1%} | {mb(r['full_train_rss_mb'])} | {mb(r['plan_full_train_mb'])} | "
                     f"{r['error_full_train']:.1%} | {r['block_train_rss_mb'] / r['full_train_rss_mb']:.3f} |")
    lines += [
        "",
        f"Largest size: full-model training state **{res['largest_full_state_gb']:.2f} GB**; block worker peak RSS / "
        f"full-model peak RSS **{res['largest_block_over_full_rss']:.3f}** (aim ≤ 2/B = {2 / BLOCKS:.3f}); plan error "
        f"**{res['plan_error_largest']:.1%}** (the worse of block and full; aim ≤ 15 %). Python + torch + btnode "
        f"imported, nothing built: {res['runtime_rss_mb']:,.0f} MB.",
        "",
        "Commands of the largest row (the other rows: the same with their `--d-model`, `--heads` and `--batch`):",
        "",
        *[f"- {k}: `{v}`" for k, v in c.items()],
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="Tiny widths: a smoke test of the benchmark itself.")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-memory")
    ap.add_argument("--json", type=Path, default=RESULTS / "memory.json", help="Where the results go.")
    ap.add_argument("--no-report", action="store_true", help="Leave BENCHMARKS.md alone.")
    ap.add_argument("--child", choices=("block", "ar"), help=argparse.SUPPRESS)
    ap.add_argument("--d-model", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        train_loop(args.child, args.d_model, args.heads, args.steps, args.batch)
        return
    t0 = time.perf_counter()
    rows = [one_size(d, h, args.out / f"d{d}-b{b}", STEPS, b) for d, h, b in (QUICK_SIZES if args.quick else SIZES)]
    base = measure([sys.executable, "-c", "import torch, btnode.train.loops; print(torch.__version__)"])
    big = rows[-1]
    res = {
        "config": {"n_blocks": BLOCKS, "n_layers": LAYERS, "context": CONTEXT, "steps": STEPS,
                   "threads": 1, "full_model": f"AR, {BLOCKS * LAYERS} layers (btnode train-ar)",
                   "block_worker": "btnode train-local --block 0"},
        "sizes": rows,
        "largest_full_state_gb": big["full_state_gb"],
        "largest_block_over_full_rss": big["block_rss_mb"] / big["full_rss_mb"],
        "plan_error_largest": max(big["error_block"], big["error_full"]),
        "plan_error_largest_training_only": max(big["error_block_train"], big["error_full_train"]),
        "capped_full_replica_refused": None,
        "notes": "capped_full_replica_refused is filled by issue #12 item 4 (memory-capped workers), not by this benchmark.",
        "runtime_rss_mb": base.max_rss_mb,
        "machine": f"{platform.machine()}, torch {base.stdout.strip()}",
        "date": time.strftime("%Y-%m-%d"),
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps({k: v for k, v in res.items() if k != "sizes"}, indent=1))
    if args.quick:
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1) + "\n")
    if not args.no_report:
        update_section("memory", render(res))


if __name__ == "__main__":
    main()
