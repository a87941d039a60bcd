"""Quality benchmark (issue #2, design §6.1–6.2): the blockwise model against two autoregressive
baselines at equal wall-clock, scored on the same held-out windows and positions.

    .venv/bin/python bench/quality.py                 # ~50 min on 2 cores: 15 min of training per model
    .venv/bin/python bench/quality.py --budget 30 --windows 32 --out /tmp/q   # a smoke run

Each model trains through the real CLI in its own process for `--budget` seconds of training
(the step count is calibrated from measured step times first), then `btnode eval` scores it.
Peak RSS is measured with wait4 on processes training one block and the B·L-layer baseline.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS, ROOT, measure, shown, update_section  # noqa: E402

from btnode.model.config import ModelConfig  # noqa: E402  (no torch: this process must stay small)

BTNODE = str(Path(sys.executable).with_name("btnode"))
BATCH, LR = 32, 2e-3
# default: the CPU-sized comparison. serving: the model the serving benchmark runs, with
# N = 256 so that a segment of K = 256 fits, trained on every K it serves.
PROFILES = {
    "default": dict(context=128, segments=(1, 16), budget=900.0, windows=512, out="bench-quality",
                    result="quality.json", section="quality", full=True),
    "serving": dict(context=256, segments=(1, 16, 64, 256), budget=600.0, windows=128, out="bench-quality-serving",
                    result="quality_serving.json", section="quality-serving", full=False),
}
PROFILE = "default"
CFG = ModelConfig(d_model=128, n_heads=4, n_layers=2, n_blocks=3, context=128, segments=(1, 16))
SHAPE: list[str] = []


def use_profile(name: str) -> dict:
    global PROFILE, CFG, SHAPE
    p = PROFILES[name]
    PROFILE = name
    CFG = ModelConfig(d_model=128, n_heads=4, n_layers=2, n_blocks=3, context=p["context"], segments=p["segments"])
    SHAPE = ["--d-model", "128", "--heads", "4", "--layers", "2", "--blocks", "3", "--context", str(p["context"]),
             "--segments", ",".join(map(str, p["segments"]))]
    return p


use_profile("default")


def step_seconds(kind: str, n: int = 8) -> float:
    """Median seconds of one optimizer step of every model the run trains (after 3 warm-ups).

    Runs in a child process: the orchestrator never loads torch, so that wait4's peak RSS of
    each child is not inflated by the parent's pages copied at fork."""
    m = measure([sys.executable, __file__, "--profile", PROFILE, "--calibrate", kind])
    return float(m.stdout.strip().splitlines()[-1])


def calibrate(kind: str, n: int = 8) -> float:
    import torch

    from btnode.data import corpus
    from btnode.data.windows import WindowSampler
    from btnode.model.targets import target_table
    from btnode.store.models import init_ar, init_block
    from btnode.train.config import TrainConfig
    from btnode.train.trainers import ARTrainer, BlockTrainer

    tc = TrainConfig(steps=1000, batch=BATCH, lr=LR)
    data = WindowSampler(corpus.bundled().train, CFG.context)
    dev = torch.device("cpu")
    if kind == "blocks":
        trainers = [BlockTrainer(init_block(CFG, b, 0), tc, block=b, table=target_table(CFG), device=dev)
                    for b in range(CFG.n_blocks)]
    else:
        trainers = [ARTrainer(init_ar(CFG, int(kind[2:]), 0), tc, dev)]
    times = []
    for i in range(n + 3):
        t0 = time.perf_counter()
        for tr in trainers:
            tr.train_step(data.batch(99, 0, i, BATCH), 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="default")
    ap.add_argument("--budget", type=float, help="training seconds per model (default: the profile's)")
    ap.add_argument("--windows", type=int, help="held-out windows for evaluation (default: the profile's)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--out", type=Path, help="run folder (default: runs/<profile's folder>)")
    ap.add_argument("--no-report", action="store_true", help="do not write results/quality.json or BENCHMARKS.md")
    ap.add_argument("--reuse", action="store_true", help="keep models already trained and scored in --out")
    ap.add_argument("--calibrate", help=argparse.SUPPRESS)
    args = ap.parse_args()
    prof = use_profile(args.profile)
    args.budget = args.budget or prof["budget"]
    args.windows = args.windows or prof["windows"]
    args.out = args.out or ROOT / "runs" / prof["out"]
    if args.calibrate:
        print(calibrate(args.calibrate))
        return
    ar_total = f"ar{CFG.n_blocks * CFG.n_layers}"
    # name → (command, depth): the last one trains the B·L-layer AR for as many steps as each block got
    # (equal optimizer steps per parameter owner), beside the equal-wall-clock runs.
    models = {"blocks": ("train-local", 0), ar_total: ("train-ar", CFG.n_blocks * CFG.n_layers),
              f"ar{CFG.n_layers}": ("train-ar", CFG.n_layers), f"{ar_total}-equal-steps": ("train-ar", CFG.n_blocks * CFG.n_layers)}
    if not prof["full"]:
        models = {name: models[name] for name in ("blocks", ar_total)}
    runs: dict[str, dict] = {}
    for name, (command, depth) in models.items():
        out = args.out / name
        saved = out / "bench-run.json"
        if args.reuse and saved.exists() and (out / "eval.json").exists():
            runs[name] = {**json.loads(saved.read_text()), "eval": json.loads((out / "eval.json").read_text())}
            print(f"[quality] {name}: reusing {out}", flush=True)
            continue
        if name.endswith("-equal-steps"):
            per_step, steps = float("nan"), runs["blocks"]["steps"]
        else:
            per_step = step_seconds("blocks" if command == "train-local" else f"ar{depth}")
            steps = max(20, int(args.budget / per_step))
        cmd = [BTNODE, command, "--out", str(out), "--steps", str(steps), "--batch", str(BATCH), "--lr", str(LR),
               "--warmup", str(max(10, steps // 20)), "--checkpoint-every", str(steps), "--log-every",
               str(max(1, steps // 10)), *SHAPE]
        if command == "train-ar":
            cmd += ["--ar-layers", str(depth)]
        print(f"[quality] {name}: {per_step:.3f} s/step calibrated -> {steps} steps", flush=True)
        m = measure(cmd)
        tokens = steps * BATCH * CFG.context * (CFG.n_blocks if name == "blocks" else 1)
        ev = out / "eval.json"
        measure([BTNODE, "eval", "--checkpoint", str(out), "--windows", str(args.windows), "--seeds",
                 str(args.seeds), "--json", str(ev)])
        runs[name] = {"steps": steps, "wall_s": m.wall_s, "tokens_per_s": tokens / m.wall_s,
                      "max_rss_mb": m.max_rss_mb, "command": shown(cmd)}
        saved.write_text(json.dumps(runs[name], indent=1))
        runs[name]["eval"] = json.loads(ev.read_text())
        print(f"[quality] {name}: {m.wall_s:.0f} s, {tokens / m.wall_s:.0f} tokens/s", flush=True)

    if not prof["full"]:
        return report_serving_profile(args, prof, runs)
    probe = args.out / "rss"
    rss_block = measure([BTNODE, "train-local", "--out", str(probe / "block"), "--steps", "30", "--block", "0",
                         "--batch", str(BATCH), *SHAPE])
    rss_ar = measure([BTNODE, "train-ar", "--out", str(probe / "ar"), "--steps", "30", "--batch", str(BATCH),
                      "--ar-layers", ar_total[2:], *SHAPE])
    rss_base = measure([sys.executable, "-c", "import torch, btnode.train.loops"])
    threads = measure([sys.executable, "-c", "import torch; print(torch.get_num_threads(), torch.__version__)"])

    blocks = runs["blocks"]["eval"]
    kmax = max(CFG.segments)
    seeds = args.seeds
    res = {
        "config": {**CFG.to_dict(), "batch": BATCH, "lr": LR, "budget_s": args.budget, "windows": args.windows,
                   "seeds": seeds, "n_steps": blocks["n_steps"], "budget": "equal wall-clock per model"},
        "sce1_k1": blocks["per_k"]["1"]["sce1"], "sce8_k1": blocks["per_k"]["1"][f"sce{seeds}"],
        "sce1_kmax": blocks["per_k"][str(kmax)]["sce1"], "sce8_kmax": blocks["per_k"][str(kmax)][f"sce{seeds}"],
        "kmax": kmax, "ar_total_ce": runs[ar_total]["eval"]["ce"], "ar_block_ce": runs[f"ar{CFG.n_layers}"]["eval"]["ce"],
        "ar_total_ce_equal_steps": runs[f"{ar_total}-equal-steps"]["eval"]["ce"],
        "unigram": blocks["unigram"], "rss_block_mb": rss_block.max_rss_mb, "rss_ar_total_mb": rss_ar.max_rss_mb,
        "rss_torch_baseline_mb": rss_base.max_rss_mb,
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "eval"} for k, v in runs.items()},
        "machine": "{}, torch threads and version: {}".format(platform.machine(), threads.stdout.strip()),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(res, indent=1))
    if args.no_report:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quality.json").write_text(json.dumps(res, indent=1) + "\n")
    update_section("quality", render(res, runs))


def report_serving_profile(args: argparse.Namespace, prof: dict, runs: dict) -> None:
    """SCE per K for the serving model (and its AR baseline's CE), read by bench/serving.py."""
    blocks, ar_total = runs["blocks"]["eval"], f"ar{CFG.n_blocks * CFG.n_layers}"
    seeds = args.seeds
    res = {"config": {**CFG.to_dict(), "batch": BATCH, "lr": LR, "budget_s": args.budget, "windows": args.windows,
                      "seeds": seeds, "n_steps": blocks["n_steps"]},
           "sce": {k: {"sce1": v["sce1"], "sce8": v[f"sce{seeds}"]} for k, v in blocks["per_k"].items()},
           "ar_total_ce": runs[ar_total]["eval"]["ce"], "unigram": blocks["unigram"],
           "checkpoints": {"blocks": str(args.out / "blocks"), "ar": str(args.out / ar_total)},
           "runs": {k: {kk: vv for kk, vv in v.items() if kk != "eval"} for k, v in runs.items()},
           "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(res, indent=1))
    if args.no_report:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / prof["result"]).write_text(json.dumps(res, indent=1) + "\n")
    c = res["config"]
    lines = ["## Quality of the serving model (`bench/quality.py --profile serving`)", "",
             f"Command: `.venv/bin/python bench/quality.py --profile serving` ({res['date']}). The model "
             f"`bench/serving.py` runs: d={c['d_model']}, B={c['n_blocks']} × L={c['n_layers']}, N={c['context']} "
             f"(so that K = 256 fits), K ∈ {c['segments']}, {c['budget_s']:.0f} s of training per model on 2 cores; "
             f"{c['windows']} held-out windows, N_s = {c['n_steps']}, seeds 0..{seeds - 1}.", "",
             "| model | K | SCE-1 | SCE-8 | steps | command |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    for k, v in res["sce"].items():
        lines.append(f"| blockwise | {k} | {v['sce1']:.4f} | {v['sce8']:.4f} | {runs['blocks']['steps']} | "
                     f"`{runs['blocks']['command']}` |")
    lines += ["", f"The {ar_total[2:]}-layer autoregressive baseline served beside it: teacher-forced CE "
              f"{res['ar_total_ce']:.4f} nats/byte after {runs[ar_total]['steps']} steps "
              f"(`{runs[ar_total]['command']}`). Unigram entropy of the held-out file: {res['unigram']:.4f}."]
    update_section(prof["section"], "\n".join(lines))


def render(r: dict, runs: dict) -> str:
    ar_total, ar_block = f"ar{CFG.n_blocks * CFG.n_layers}", f"ar{CFG.n_layers}"
    c = r["config"]
    ev = f"`btnode eval --checkpoint runs/bench-quality/<model> --windows {c['windows']} --seeds {c['seeds']}`"
    gap = r["sce8_k1"] - r["ar_total_ce"]
    lines = [
        "## Quality: blockwise vs autoregressive (`bench/quality.py`)",
        "",
        f"Command: `.venv/bin/python bench/quality.py` ({r['date']}, {r['machine']}). Model: d={c['d_model']}, "
        f"{c['n_heads']} heads, B={c['n_blocks']} blocks × L={c['n_layers']} layers, N={c['context']}, "
        f"K ∈ {c['segments']}, batch {c['batch']}, AdamW lr {c['lr']}. Budget: **equal wall-clock**, "
        f"{c['budget_s']:.0f} s of training per model on the same 2 cores (the blockwise model trains all "
        f"{c['n_blocks']} blocks in that time, one after another). Held-out: {c['windows']} windows of "
        f"wiki.test.raw, rows with ≥ N/2 context; SCE uses N_s = {c['n_steps']} and seeds 0..{c['seeds'] - 1}. "
        "nats/byte.",
        "",
        "| model | metric | nats/byte | steps | wall-clock | tokens/s | command |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
        f"| blockwise, K=1 | SCE-1 | {r['sce1_k1']:.4f} | {runs['blocks']['steps']} × {c['n_blocks']} blocks "
        f"| {runs['blocks']['wall_s']:.0f} s | {runs['blocks']['tokens_per_s']:.0f} | `{runs['blocks']['command']}`, then {ev} |",
        f"| blockwise, K=1 | SCE-{c['seeds']} | {r['sce8_k1']:.4f} | | | | same |",
        f"| blockwise, K={r['kmax']} | SCE-1 | {r['sce1_kmax']:.4f} | | | | same |",
        f"| blockwise, K={r['kmax']} | SCE-{c['seeds']} | {r['sce8_kmax']:.4f} | | | | same |",
        f"| AR, {ar_total[2:]} layers (B·L) | teacher-forced CE | {r['ar_total_ce']:.4f} | {runs[ar_total]['steps']} "
        f"| {runs[ar_total]['wall_s']:.0f} s | {runs[ar_total]['tokens_per_s']:.0f} | `{runs[ar_total]['command']}`, then {ev} |",
        f"| AR, {ar_block[2:]} layers (L) | teacher-forced CE | {r['ar_block_ce']:.4f} | {runs[ar_block]['steps']} "
        f"| {runs[ar_block]['wall_s']:.0f} s | {runs[ar_block]['tokens_per_s']:.0f} | `{runs[ar_block]['command']}`, then {ev} |",
        f"| AR, {ar_total[2:]} layers, **equal steps** (as many as each block) | teacher-forced CE | "
        f"{r['ar_total_ce_equal_steps']:.4f} | {runs[ar_total + '-equal-steps']['steps']} "
        f"| {runs[ar_total + '-equal-steps']['wall_s']:.0f} s | {runs[ar_total + '-equal-steps']['tokens_per_s']:.0f} "
        f"| `{runs[ar_total + '-equal-steps']['command']}`, then {ev} |",
        f"| unigram entropy of wiki.test.raw | | {r['unigram']:.4f} | | | | |",
        "",
        f"Gap, blockwise SCE-{c['seeds']} at K=1 minus the {ar_total[2:]}-layer AR at equal wall-clock: **{gap:+.4f}** "
        f"nats/byte (aim: ≤ +0.15); at equal optimizer steps per parameter owner: "
        f"{r['sce8_k1'] - r['ar_total_ce_equal_steps']:+.4f}; against the {ar_block[2:]}-layer AR at equal wall-clock: "
        f"{r['sce8_k1'] - r['ar_block_ce']:+.4f} (aim: below 0).",
        "",
        "| peak RSS (wait4) | MB | command |",
        "| --- | ---: | --- |",
        f"| process training one block | {r['rss_block_mb']:.0f} | `btnode train-local --block 0 --steps 30 --batch 32 ...` |",
        f"| process training the {ar_total[2:]}-layer AR | {r['rss_ar_total_mb']:.0f} | `btnode train-ar --ar-layers {ar_total[2:]} --steps 30 --batch 32 ...` |",
        f"| python + torch + btnode imported, nothing trained | {r['rss_torch_baseline_mb']:.0f} | `python -c 'import torch, btnode.train.loops'` |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
