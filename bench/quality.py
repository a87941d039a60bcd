"""Quality benchmark (issues #2 and #10, design §6.1–6.2): the blockwise model against two
autoregressive baselines, scored on the same held-out windows and positions, under budget rules
that say what a deployment gets.

    .venv/bin/python -m bench.quality                 # ~2 h on 2 cores (see BENCHMARKS.md)
    .venv/bin/python -m bench.quality --budget 40 --swarm-budget 20 --windows 32 --out /tmp/q --no-report  # smoke

Budgets are per-worker wall-clock, turned into optimizer steps with step times measured alone on
this machine first (median of 8 steps after 3 warm-ups, with the torch threads each run gets: all
cores, or under --jobs J a J-th of them each), so a row's training does not depend on what else the
machine was doing. Rows (default profile):
- deployed: one worker per block, each block trained alone for T seconds (the blocks run one after
  another here, exactly what B machines in parallel do), against each AR model trained for T;
- swarm: B blocks × 2 replicas averaging through the daemon's aggregation code (`btnode simulate`),
  each replica given T_s seconds, beside one worker per block at T_s;
- equal total compute: one worker per block at T_s = T/B is also B·T_s = T of total compute, the
  budget the AR models get.
Learning curves are checkpoints along each run (T/8, T/4, T/2, T), each scored by `btnode eval`.
Peak RSS is measured with wait4 on processes training one block and the B·L-layer baseline.

Baselines (issue #42; bench/baselines.py), per training seed at the same checkpoints: the chain, its best
block alone, AR-L on one worker (the block-sized model), AR-(B·L), DiLoCo of AR-L over B workers
(`btnode simulate --model ar`) and an ensemble of B AR-L models trained apart (probabilities averaged).
--corpus DIR runs it all on a prepared dataset (`btnode data fetch linux-doc --out DIR`).

    .venv/bin/python -m bench.quality --quick                          # smoke run of every row (minutes)
    .venv/bin/python -m bench.quality --quick --corpus data/linux-doc
    .venv/bin/python -m bench.quality --corpus data/linux-doc --jobs 2   # two runs at a time, a core each
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from bench import baselines
from bench.flags import QUICK_SHAPE, SHAPE, BenchParser, shape_flags  # no torch: this process must stay small
from bench.report import RESULTS, ROOT, is_published, measure, module_command, publish, result_path, shown
from bench.quality_render import metrics, plot_curves, render_default, render_serving

BTNODE = str(Path(sys.executable).with_name("btnode"))
BATCH, LR = 32, 2e-3
# default: the CPU-sized comparison. serving: the model the serving benchmark runs, with
# N = 256 so that a segment of K = 256 fits, trained on every K it serves.
PROFILES = {
    "default": dict(context=128, segments=(1, 16), budget=900.0, windows=512, out="bench-quality",
                    setting="default", full=True),
    "serving": dict(context=256, segments=(1, 16, 64, 256), budget=600.0, windows=128, out="bench-quality-serving",
                    setting="serving", full=False),
}
PROFILE = "default"
CFG = SHAPE
FLAGS: list[str] = []  # CFG's flags and --data, for every btnode command this run starts
DATA: list[str] = []  # --data DIR when --corpus names a prepared dataset
SWARM_H = 25  # local steps per round in the swarm rows (as `make demo`)
QUICK_RUN = False
THREADS: int | None = None  # --jobs J > 1: each child's torch threads (the cores shared out), else torch's default
QUICK = dict(budget=6.0, swarm_budget=3.0, windows=16, seeds=2, train_seeds="0")  # --quick: a smoke run


def use_profile(name: str, quick: bool = False, corpus: str = baselines.BUNDLED) -> dict:
    global PROFILE, CFG, FLAGS, DATA, QUICK_RUN
    p = PROFILES[name]
    PROFILE, QUICK_RUN = name, quick
    CFG = dataclasses.replace(QUICK_SHAPE if quick else SHAPE, context=QUICK_SHAPE.context if quick else p["context"],
                              segments=QUICK_SHAPE.segments if quick else p["segments"])
    DATA = [] if corpus == baselines.BUNDLED else ["--data", corpus]
    FLAGS = [*shape_flags(CFG), *DATA]
    return p


use_profile("default")


def step_seconds(kind: str, n: int = 8) -> float:
    """Median seconds of one optimizer step of every model the run trains (after 3 warm-ups).

    Runs in a child process: the orchestrator never loads torch, so that wait4's peak RSS of
    each child is not inflated by the parent's pages copied at fork."""
    m = measure(module_command("bench.quality", "--profile", PROFILE, *(["--quick"] if QUICK_RUN else []),
                               "--calibrate", kind), THREADS)  # with the threads each training run gets
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


FRACTIONS = (8, 4, 2, 1)  # curve points at T/8, T/4, T/2 and T: checkpoints along one run
QUICK_FRACTIONS = (2, 1)


def evaluate(out: Path, ev: Path, args: argparse.Namespace, k1_only: bool, version: int | None = None) -> dict:
    cmd = [BTNODE, "eval", "--checkpoint", str(out), "--windows", str(args.windows), "--seeds", str(args.seeds),
           "--json", str(ev), *DATA]
    if k1_only:
        cmd += ["--segments", "1"]
    if version is not None:
        cmd += ["--version", str(version)]
    measure(cmd, THREADS)
    return json.loads(ev.read_text())


def staged(name: str, base: list[str], steps: int, per_step: float, args: argparse.Namespace,
           fractions: tuple[int, ...] | None = None, *, seed: int = 0, snapshots: bool = False) -> dict:
    """Train `base` for `steps` steps in stages (--stop-after, then --resume: exact), scoring the
    checkpoint at each stage; the last stage is scored at every trained K, the others at K = 1.
    `snapshots`: each stage's checkpoint is also kept in at-STEPS/ (the ensemble is scored from them)."""
    fractions = fractions or args.fractions
    base = [*base, *(["--seed", str(seed)] if seed else [])]
    out = args.out / name
    saved = out / "bench-run.json"
    if args.reuse and saved.exists():
        print(f"[quality] {name}: reusing {out}", flush=True)
        return json.loads(saved.read_text())
    warmup = max(10, steps // 20)
    points, wall, rss = [], 0.0, 0.0
    for i, div in enumerate(fractions):
        stop = max(1, steps // div)
        done = out / f"stage-{stop}.json"
        if args.reuse and done.exists():  # a stage trained and scored before an interruption
            point = json.loads(done.read_text())
            wall, rss = wall + point["wall_s"], max(rss, point["max_rss_mb"])
            points.append(point)
            print(f"[quality] {name}: reusing stage {stop}/{steps}", flush=True)
            continue
        cmd = [*base, "--out", str(out), "--steps", str(steps), "--stop-after", str(stop), "--batch", str(BATCH),
               "--lr", str(LR), "--warmup", str(warmup), "--checkpoint-every", str(steps), "--log-every",
               str(max(1, steps // 10)), *FLAGS, *(["--resume"] if i else [])]
        m = measure(cmd, THREADS)
        wall, rss = wall + m.wall_s, max(rss, m.max_rss_mb)
        ev = evaluate(out, out / f"eval-{stop}.json", args, k1_only=div != 1)
        if snapshots:
            snapshot(out, out / f"at-{stop}")
        points.append({"steps": stop, "budget_s": stop * per_step, "eval": ev, "wall_s": m.wall_s,
                       "max_rss_mb": m.max_rss_mb})
        done.write_text(json.dumps(points[-1], indent=1))
        print(f"[quality] {name}: {stop}/{steps} steps ({stop * per_step:.0f} s per worker), "
              f"{headline(ev, args.seeds):.4f} nats/byte", flush=True)
    run = {"steps": steps, "per_step_s": per_step, "wall_s": wall, "max_rss_mb": rss, "points": points,
           "command": shown([*base, "--out", str(out), "--steps", str(steps), "--batch", str(BATCH), "--lr", str(LR),
                             "--warmup", str(warmup), *FLAGS]) + " (in stages: --stop-after, then --resume)",
           "eval": points[-1]["eval"]}
    out.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(run, indent=1))
    return run


def snapshot(folder: Path, to: Path) -> None:
    """A copy of the checkpoint files in `folder` (not its subfolders)."""
    to.mkdir(exist_ok=True)
    for f in folder.iterdir():
        if f.is_file():
            shutil.copy2(f, to / f.name)


def swarm_run(name: str, steps: int, per_step: float, args: argparse.Namespace, *, replicas: int = 2,
              model: tuple[str, ...] = (), seed: int = 0) -> dict:
    """B blocks × `replicas` through `btnode simulate` (the daemon's aggregation code, virtual clock,
    every replica taking part), each replica training `steps` steps; every version is kept so that
    the curve reads versions along the run. `model` ("--model", "ar", …): replicas of an AR model, DiLoCo."""
    out = args.out / name
    saved = out / "bench-run.json"
    if args.reuse and saved.exists():
        print(f"[quality] {name}: reusing {out}", flush=True)
        return json.loads(saved.read_text())
    h = min(SWARM_H, max(1, steps // 4))  # at least 4 rounds, and a short run is not stretched past its budget
    rounds = max(4, steps // h)
    total = rounds * h
    state = out / "state"
    cmd = [BTNODE, "simulate", "--replicas", str(replicas), "--participation", "1", "--rounds", str(rounds),
           "--steps-per-round", str(h), "--batch", str(BATCH), "--lr", str(LR), "--warmup",
           str(max(10, total // 20)), "--eval-windows", "16", "--state-dir", str(state), "--keep", str(rounds + 1),
           "--json", str(out / "simulate.json"), *model, *(["--seed", str(seed)] if seed else []), *FLAGS]
    out.mkdir(parents=True, exist_ok=True)
    m = measure(cmd, THREADS)
    points = []
    for div in args.fractions:
        v = max(1, rounds // div)
        ev = evaluate(state, out / f"eval-v{v}.json", args, k1_only=div != 1, version=v)
        points.append({"steps": v * h, "version": v, "budget_s": v * h * per_step, "eval": ev})
        print(f"[quality] {name}: version {v} ({v * h * per_step:.0f} s per worker), "
              f"{headline(ev, args.seeds):.4f} nats/byte", flush=True)
    run = {"steps": total, "rounds": rounds, "steps_per_round": h, "per_step_s": per_step, "wall_s": m.wall_s,
           "max_rss_mb": m.max_rss_mb, "points": points, "command": shown(cmd), "eval": points[-1]["eval"]}
    saved.write_text(json.dumps(run, indent=1))
    return run


def headline(ev: dict, seeds: int) -> float:
    """SCE-S at K = 1 for blocks, teacher-forced CE for AR."""
    return ev["ce"] if ev.get("kind") == "ar" else ev["per_k"]["1"][f"sce{seeds}"]


def run_default(args: argparse.Namespace) -> None:
    B, L = CFG.n_blocks, CFG.n_layers
    ar_total, ar_block = f"ar{B * L}", f"ar{L}"
    calib = args.out / "calibration.json"  # kept, so that a resumed run (--reuse) keeps its step counts
    if args.reuse and calib.exists():
        saved_times = json.loads(calib.read_text())
        t_block, t_ar = saved_times["block"], saved_times["ar"]
    else:
        t_block = step_seconds("blocks") / B  # one block's step, measured with all B side by side
        t_ar = {ar_total: step_seconds(ar_total), ar_block: step_seconds(ar_block)}
        args.out.mkdir(parents=True, exist_ok=True)
        calib.write_text(json.dumps({"block": t_block, "ar": t_ar}, indent=1))
    print(f"[quality] step times: block {t_block:.3f} s, {ar_total} {t_ar[ar_total]:.3f} s, "
          f"{ar_block} {t_ar[ar_block]:.3f} s", flush=True)
    T, Ts = args.budget, args.swarm_budget
    first = args.train_seeds[0]
    jobs = {"deployed": (B * T, lambda: staged("deployed", [BTNODE, "train-local"], int(T / t_block), t_block, args,
                                               seed=first))}
    for name in (ar_total, ar_block):
        jobs[name] = (T, partial(staged, name, [BTNODE, "train-ar", "--ar-layers", name[2:]], int(T / t_ar[name]),
                                 t_ar[name], args, seed=first, snapshots=name == ar_block))
    jobs.update(baseline_jobs(args, t_block, t_ar, set(jobs)))
    if not args.no_swarm:
        jobs["deployed-swarm-budget"] = (B * Ts, lambda: staged("deployed-swarm-budget", [BTNODE, "train-local"],
                                                                int(Ts / t_block), t_block, args, fractions=(1,)))
        jobs["swarm"] = (2 * B * Ts, lambda: swarm_run("swarm", int(Ts / t_block), t_block, args))
    runs = run_jobs(jobs, args.jobs)
    rows = baseline_rows(args, runs)

    probe = args.out / "rss"
    rss_block = measure([BTNODE, "train-local", "--out", str(probe / "block"), "--steps", "30", "--block", "0",
                         "--batch", str(BATCH), *FLAGS])
    rss_ar = measure([BTNODE, "train-ar", "--out", str(probe / "ar"), "--steps", "30", "--batch", str(BATCH),
                      "--ar-layers", ar_total[2:], *FLAGS])
    rss_base = measure([sys.executable, "-c", "import torch, btnode.train.loops"])
    threads = measure([sys.executable, "-c", "import torch; print(torch.get_num_threads(), torch.__version__)"], THREADS)

    seeds, kmax = args.seeds, max(CFG.segments)
    corpus = baselines.describe(args.corpus)
    dep = runs["deployed"]["eval"]
    curves = [{"model": model, "budget_s": p["budget_s"], "steps": p["steps"], "sce8_k1": headline(p["eval"], seeds)}
              for model in ("deployed", "swarm", ar_total, ar_block) if model in runs for p in runs[model]["points"]]
    res = {
        "config": {**CFG.to_dict(), "batch": BATCH, "lr": LR, "budget_s": T, "swarm_budget_s": Ts,
                   "windows": args.windows, "seeds": seeds, "n_steps": dep["n_steps"], "readout": dep.get("readout"),
                   "train_defaults": train_defaults(), "corpus": corpus["name"], "train_seeds": args.train_seeds,
                   "quick": args.quick},
        "budget_s": T,
        "sce8_k1_deployed": headline(dep, seeds),
        "sce1_k1_deployed": dep["per_k"]["1"]["sce1"],
        "ar_total_ce_deployed": runs[ar_total]["eval"]["ce"],
        "ar_block_ce_deployed": runs[ar_block]["eval"]["ce"],
        "best_block_alone_deployed": dep["best_block"]["ce"],
        "best_block_deployed": dep["best_block"]["block"],
        "alone_deployed": dep["alone"],
        "sce8_kmax_deployed": dep["per_k"][str(kmax)][f"sce{seeds}"],
        **({} if args.no_swarm else swarm_fields(runs, Ts, seeds, kmax)),
        "kmax": kmax, "ar_total_ce": runs[ar_total]["eval"]["ce"], "ar_block_ce": runs[ar_block]["eval"]["ce"],
        "unigram": dep["unigram"], "curves": curves, "baselines": rows,
        # one block's step over AR-L's, both calibrated above in this run with the same threads (issue #42)
        "block_step_over_ar_block_step": t_block / t_ar[ar_block],
        **({"large_corpus": corpus} if args.corpus != baselines.BUNDLED else {}),
        "rss_block_mb": rss_block.max_rss_mb, "rss_ar_total_mb": rss_ar.max_rss_mb,
        "rss_torch_baseline_mb": rss_base.max_rss_mb,
        "runs": {k: {kk: vv for kk, vv in v.items() if kk not in ("eval", "points")} for k, v in runs.items()},
        "machine": "{}, torch threads and version: {}".format(platform.machine(), threads.stdout.strip()),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(res, indent=1))
    if args.no_report:
        return
    published = is_published(args.results)
    name = "" if args.corpus == baselines.BUNDLED else f"_{baselines.slug(corpus['name'])}"  # one plot per corpus
    plot = plot_curves(res, RESULTS / f"quality_curves{name}.png") if published else None
    png = baselines.plot(rows, RESULTS / f"quality_baselines_{baselines.slug(corpus['name'])}.png") if published else None
    publish("quality", res, metrics(res), lambda r: render_default(r, runs, plot, png), out=args.results)


def swarm_fields(runs: dict, Ts: float, seeds: int, kmax: int) -> dict:
    """The swarm rows' fields (and equal total compute's: one worker per block at T_s = T/B each)."""
    eq, sw = runs["deployed-swarm-budget"]["eval"], runs["swarm"]["eval"]
    return {"swarm_budget_s": Ts, "sce8_k1_swarm": headline(sw, seeds), "best_block_alone_swarm": sw["best_block"]["ce"],
            "sce8_k1_deployed_at_swarm_budget": headline(eq, seeds),
            "sce1_k1": eq["per_k"]["1"]["sce1"], "sce8_k1": headline(eq, seeds),
            "sce1_kmax": eq["per_k"][str(kmax)]["sce1"], "sce8_kmax": eq["per_k"][str(kmax)][f"sce{seeds}"],
            "best_block_alone_equal_total": eq["best_block"]["ce"]}


def run_jobs(jobs: dict[str, tuple[float, Callable[[], dict]]], n: int) -> dict[str, dict]:
    """Every training run of `jobs` (name: (its cost in worker-seconds, the run)), `n` at a time, the
    costliest first. Each run's step count is fixed before it starts (from the step times measured
    alone), so runs side by side train exactly what they train one after another; only wall-clock
    and the machine's load differ (a run's own wall_s is then not a step time)."""
    order = sorted(jobs, key=lambda k: -jobs[k][0])
    if n <= 1:
        return {name: jobs[name][1]() for name in order}
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = {name: pool.submit(jobs[name][1]) for name in order}
        return {name: f.result() for name, f in futures.items()}


def baseline_jobs(args: argparse.Namespace, t_block: float, t_ar: dict, have: set[str]) -> dict:
    """Issue #42's runs that `have` (the first seed's deployed and AR runs) lacks, per training seed: the
    ensemble's other B − 1 AR-L members (seeds seed + 100·i), DiLoCo of AR-L over B replicas, and the later
    seeds' runs. name: (cost in worker-seconds, the run)."""
    B, L = CFG.n_blocks, CFG.n_layers
    ar_total, ar_block = f"ar{B * L}", f"ar{L}"
    ar = [BTNODE, "train-ar", "--ar-layers"]
    T, jobs = args.budget, {}
    for seed in args.train_seeds:
        sfx = "" if seed == args.train_seeds[0] else f"-s{seed}"
        plan = {"deployed": ([BTNODE, "train-local"], t_block, seed, B),
                ar_total: ([*ar, str(B * L)], t_ar[ar_total], seed, 1), ar_block: ([*ar, str(L)], t_ar[ar_block], seed, 1),
                **{f"{ar_block}-member{i}": ([*ar, str(L)], t_ar[ar_block], seed + 100 * i, 1) for i in range(1, B)}}
        for name, (base, per_step, s, workers) in plan.items():
            if name + sfx not in have:
                jobs[name + sfx] = (workers * T, partial(staged, name + sfx, base, int(T / per_step), per_step, args,
                                                         seed=s, snapshots=name.startswith(ar_block)))
        jobs["diloco_block" + sfx] = (B * T, partial(swarm_run, "diloco_block" + sfx, int(T / t_ar[ar_block]),
                                                     t_ar[ar_block], args, replicas=B,
                                                     model=("--model", "ar", "--ar-layers", str(L)), seed=seed))
    return jobs


def baseline_rows(args: argparse.Namespace, runs: dict) -> list[dict]:
    """Issue #42's rows, per training seed, at the checkpoints (T/8 … T) every model shares, from the runs
    of `baseline_jobs` and the first seed's deployed and AR runs; the ensemble scored here."""
    B, L = CFG.n_blocks, CFG.n_layers
    ar_total, ar_block = f"ar{B * L}", f"ar{L}"
    rows: list[dict] = []
    for seed in args.train_seeds:
        sfx = "" if seed == args.train_seeds[0] else f"-s{seed}"
        members = [ar_block + sfx, *(f"{ar_block}-member{i}{sfx}" for i in range(1, B))]
        ensemble = [ensemble_ce([args.out / m / f"at-{p['steps']}" for m in members], args)
                    for p in runs[ar_block + sfx]["points"]]
        rows += baselines.rows(corpus=baselines.describe(args.corpus)["name"], seed=seed, budget=args.budget,
                               fractions=args.fractions, seeds=args.seeds, chain=runs["deployed" + sfx],
                               ar_block=runs[ar_block + sfx], ar_total=runs[ar_total + sfx],
                               diloco=runs["diloco_block" + sfx], ensemble=ensemble)
    return rows


def ensemble_ce(folders: list[Path], args: argparse.Namespace) -> float:
    """The teacher-forced CE of AR checkpoints whose probabilities are averaged, scored in a child
    (this process never loads torch) on the windows and rows `btnode eval` scores."""
    m = measure(module_command("bench.quality", "--corpus", args.corpus, "--windows", str(args.windows),
                               "--score-ensemble", *map(str, folders)), THREADS)
    return float(m.stdout.strip().splitlines()[-1])


def score_ensemble(folders: list[Path], windows: int, corpus_arg: str) -> float:
    import torch

    from btnode.data import corpus
    from btnode.data.windows import eval_windows
    from btnode.evaluation.metrics import ar_ce
    from btnode.store.models import load_ar

    members = [load_ar(f) for f in folders]
    test = corpus.load(None if corpus_arg == baselines.BUNDLED else corpus_arg).test
    with torch.no_grad():
        return ar_ce([m.model for m in members], eval_windows(test, members[0].cfg.context, windows),
                     device=torch.device("cpu"))


def train_defaults() -> dict:
    from btnode.train.config import TrainConfig  # no torch in this module

    tc = TrainConfig()
    return {"k1_share": tc.k1_share, "ctx_share": tc.ctx_share}


def main() -> None:
    ap = BenchParser(__doc__)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="default")
    ap.add_argument("--budget", type=float, help="T: training seconds per worker (default: the profile's)")
    ap.add_argument("--swarm-budget", type=float, default=300.0, help="T_s: seconds per replica of the swarm rows")
    ap.windows(None, help="held-out windows for evaluation (default: the profile's)")
    ap.seeds(8)
    ap.add_argument("--out", type=Path, help="run folder (default: runs/<profile's folder>)")
    ap.add_argument("--results", type=Path, help="the record the run is appended to (default bench/results/quality/"
                                                 "<profile>.json; any other path leaves BENCHMARKS.md alone)")
    ap.add_argument("--no-report", action="store_true", help="do not write results/quality.json or BENCHMARKS.md")
    ap.add_argument("--reuse", action="store_true", help="keep models already trained and scored in --out")
    ap.add_argument("--corpus", default=baselines.BUNDLED,
                    help="bundled (WikiText-2) or a prepared dataset folder, e.g. `btnode data fetch linux-doc`'s")
    ap.add_argument("--jobs", type=int, default=1, help="training runs side by side (each with the cores shared out; "
                                                        "step counts stay those measured alone)")
    ap.add_argument("--train-seeds", default="0,1", help="training seeds of the baseline rows (comma-separated)")
    ap.add_argument("--no-swarm", action="store_true", help="leave out the swarm rows and equal total compute's "
                                                            "(2·B·T_s + B·T_s worker-seconds): issue #42's baselines only")
    ap.add_argument("--quick", action="store_true", help="a smoke run: the tiny shape, budgets of seconds, one seed, "
                                                          "two checkpoints; recorded in quality/quick.json")
    ap.add_argument("--calibrate", help=argparse.SUPPRESS)
    ap.add_argument("--score-ensemble", nargs="+", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.score_ensemble:
        print(score_ensemble(args.score_ensemble, args.windows, args.corpus))
        return
    prof = use_profile(args.profile, args.quick, args.corpus)
    for key, value in (QUICK.items() if args.quick else ()):
        if getattr(args, key) in (None, ap.get_default(key)):
            setattr(args, key, value)
    args.train_seeds = [int(x) for x in args.train_seeds.split(",")]
    global THREADS
    THREADS = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
    args.fractions = QUICK_FRACTIONS if args.quick else FRACTIONS
    args.budget = args.budget or prof["budget"]
    args.windows = args.windows or prof["windows"]
    name = baselines.slug(baselines.describe(args.corpus)["name"]) if args.corpus != baselines.BUNDLED else ""
    args.out = args.out or ROOT / "runs" / "-".join(filter(None, [prof["out"], name, "quick" if args.quick else ""]))
    args.results = args.results or result_path("quality", "-".join(filter(None, [prof["setting"], name])),
                                               quick=args.quick)
    if args.calibrate:
        print(calibrate(args.calibrate))
        return
    if prof["full"]:
        return run_default(args)
    ar_total = f"ar{CFG.n_blocks * CFG.n_layers}"
    # the serving profile: the blockwise model and the B·L-layer AR it is served beside, at equal wall-clock
    models = {"blocks": ("train-local", 0), ar_total: ("train-ar", CFG.n_blocks * CFG.n_layers)}
    runs: dict[str, dict] = {}
    for name, (command, depth) in models.items():
        out = args.out / name
        saved = out / "bench-run.json"
        if args.reuse and saved.exists() and (out / "eval.json").exists():
            runs[name] = {**json.loads(saved.read_text()), "eval": json.loads((out / "eval.json").read_text())}
            print(f"[quality] {name}: reusing {out}", flush=True)
            continue
        per_step = step_seconds("blocks" if command == "train-local" else f"ar{depth}")
        steps = max(20, int(args.budget / per_step))
        cmd = [BTNODE, command, "--out", str(out), "--steps", str(steps), "--batch", str(BATCH), "--lr", str(LR),
               "--warmup", str(max(10, steps // 20)), "--checkpoint-every", str(steps), "--log-every",
               str(max(1, steps // 10)), *FLAGS]
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

    report_serving_profile(args, prof, runs)


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
    if not args.no_report:
        publish("quality", res, metrics(res), render_serving, out=args.results)


if __name__ == "__main__":
    main()
