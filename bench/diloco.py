"""BlockTrain against DiLoCo over the emulated WAN (issue #12, item 2): the same hosts, links,
number of workers and wall-clock, side by side in one run.

    .venv/bin/python -m bench.diloco           # ~37 min on 2 cores, root (network namespaces)
    .venv/bin/python -m bench.diloco --quick   # a smoke run (~3 min)

The lab is bench/wan_train.py's: the aggregator in the hub namespace h0, three worker hosts h1..h3,
each linked to the hub at --rate-mbit (tbf) with --delay-ms one way through the userspace delay
line. Every run has 6 `btnode join --role worker` processes, two per host, and each run gets the
same --seconds of wall-clock from the moment its workers start (SIGTERM then; a round in flight
is lost, as it would be for a user who stops a job):

  blocktrain    B = 3 blocks of L = 2 layers × 2 replicas (the replicas of a block on different hosts)
  blocktrain_lowrank  the same with --ada-rank R (default 16): every block's σ-conditioning through an
                R-wide σ-embedding instead of a full-rank AdaLN map per layer, fewer bytes per round
  diloco        6 full replicas of the B·L = 6-layer AR model (`--model ar`, DiLoCo)
  diloco_small  6 full replicas of an L = 2-layer AR model: what fits in one block worker's memory

Every run uses its own role's defaults where a user would (BlockTrain's aggregator averages,
DiLoCo's takes the outer Nesterov step, η = 0.7, μ = 0.9) and the same inner settings otherwise:
H steps of --batch windows per round, AdamW at --lr after --warmup steps and then constant (no
run knows in advance how many steps its wall-clock buys, so none gets a cosine tail), int8
updates with error feedback, deadline τ = --deadline, 1 torch thread per worker.

Held-out CE (nats/byte, on the same --windows windows of wiki.test.raw and the same rows) of the
model the aggregator had published at each of --points times: SCE-1 at K = 1 (N_s = 2B+1) for
BlockTrain, teacher-forced CE for the AR models (design §5: comparable). Also per run: wire bytes
each worker pushed and pulled per round, each worker's peak RSS (getrusage in the worker), the
fraction of pushed updates accepted, and how many rounds and steps the wall-clock bought.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.flags import QUICK_SHAPE, SHAPE, BenchParser, shape_flags
from bench.report import RESULTS, is_published, previous, publish, pyplot, result_path, table
from bench.runs import Metric, slug
from bench.wan_train import host_of, spawn_worker, start_aggregator
from btnode.model.config import ModelConfig
from btnode.node.launch import stop_processes

N_BLOCKS, REPLICAS = 3, 2
LABELS = {"blocktrain": "BlockTrain, 3 blocks × 2 replicas",
          "blocktrain_lowrank": "BlockTrain, 3 blocks × 2 replicas, low-rank σ-conditioning",
          "diloco": "DiLoCo, 6-layer AR × 6 replicas", "diloco_small": "DiLoCo, 2-layer AR × 6 replicas"}


def plan_runs(shape: ModelConfig, ada_rank: int) -> list[tuple[str, ModelConfig, list[tuple[int, int, int]]]]:
    """(name, model, workers as (unit, replica, host)) for the four runs."""
    blocks = [(b, r, host_of(b, r)) for b in range(N_BLOCKS) for r in range(REPLICAS)]
    replicas = [(0, r, 1 + r % 3) for r in range(N_BLOCKS * REPLICAS)]
    return [("blocktrain", shape, blocks), ("blocktrain_lowrank", dataclasses.replace(shape, ada_rank=ada_rank), blocks),
            ("diloco", dataclasses.replace(shape, kind="ar", ar_layers=N_BLOCKS * shape.n_layers), replicas),
            ("diloco_small", dataclasses.replace(shape, kind="ar", ar_layers=shape.n_layers), replicas)]


def run_once(lab, name: str, model: ModelConfig, who: list[tuple[int, int, int]], args: argparse.Namespace,
             work: Path, *, worker_flags: Sequence[str] = (), aggregator_flags: Sequence[str] = ()) -> dict:
    """One run of `args.seconds` of wall-clock; `worker_flags` / `aggregator_flags`: what a caller adds to
    the workers' and the aggregator's command lines (bench/comms.py: codecs)."""
    d = work / name
    d.mkdir(parents=True)
    shape = shape_flags(model)
    training = ["--steps-per-round", str(args.h), "--batch", str(args.batch), "--lr", str(args.lr)]
    agg = start_aggregator(lab, d, shape, args.deadline, [*training, *aggregator_flags])
    workers = {}
    t0 = time.time()
    for unit, r, h in who:
        wid = f"u{unit}r{r}"
        workers[wid] = spawn_worker(lab, d, h, unit, wid, [
            *training, "--warmup", str(args.warmup), "--schedule-steps", str(args.schedule_steps or 10 ** 9), *worker_flags, *shape])
    while time.time() < t0 + args.seconds:
        dead = {w: p.returncode for w, p in workers.items() if p.poll() is not None}
        if dead:
            raise SystemExit(f"{name}: workers exited early {dead}; logs in {d}")
        time.sleep(1.0)
    codes = dict(zip(workers, stop_processes(list(workers.values()), timeout_s=300)))
    agg.stop(timeout_s=60)
    if any(codes.values()):
        raise SystemExit(f"{name}: workers exited with {codes}; logs in {d}")
    stats = {w: json.loads((d / f"{w}.json").read_text()) for w in workers}
    per_round = {w: (s["bytes_pushed_wire"] + s["bytes_pulled_wire"]) / max(s["pushes"], 1) for w, s in stats.items()}
    pushes = sum(s["pushes"] for s in stats.values())
    accepted = sum(s["outcomes"].get("pending", 0) for s in stats.values())
    res = {"workers": len(workers), "seconds": args.seconds, "pushes": pushes, "accepted": accepted,
           "accept_fraction": accepted / pushes if pushes else 0.0,
           "steps_per_worker": statistics.mean(s["steps"] for s in stats.values()),
           "bytes_per_worker_round": statistics.mean(per_round.values()),
           "bytes_pushed_per_worker_round": statistics.mean(s["bytes_pushed_wire"] / max(s["pushes"], 1)
                                                            for s in stats.values()),
           "rss_mb": statistics.mean(s["peak_rss_mb"] for s in stats.values()),
           "rss_mb_max": max(s["peak_rss_mb"] for s in stats.values()),
           "utilisation": statistics.mean(s["train_seconds"] / s["wall_seconds"] for s in stats.values()),
           "compute_s_per_round": statistics.mean(s["train_seconds"] / max(s["pushes"], 1) for s in stats.values()),
           "transfer_s_per_round": statistics.mean((s["push_seconds"] + s["pull_seconds"]) / max(s["pushes"], 1)
                                                   for s in stats.values())}
    res.update(evaluate(d / "state", t0, args))
    print(f"[diloco] {name}: {res['versions']} versions, accepted {accepted}/{pushes}, "
          f"{res['bytes_per_worker_round'] / 1e6:.2f} MB per worker-round, RSS {res['rss_mb']:.0f} MB, "
          f"CE {res['ce_final']:.4f} ({res['params']:,} parameters per unit)", flush=True)
    return res


def evaluate(state: Path, t0: float, args: argparse.Namespace) -> dict:
    """CE of what the aggregator had published at each time point (the commit records' mtimes)."""
    import torch

    from btnode.data import corpus
    from btnode.evaluation.metrics import swarm_ce
    from btnode.store.models import RUN_FILE, init_unit, unit_stem
    from btnode.store.versions import VersionStore, stem

    cfg = ModelConfig.from_dict(json.loads((state / RUN_FILE).read_text())["model"])
    stores = [VersionStore(state, u, keep=100000, stem=unit_stem(cfg, u)) for u in range(cfg.total_blocks)]
    published = [{v: (s.folder / f"{stem(v)}.json").stat().st_mtime - t0 for v in s.versions()} for s in stores]
    test = corpus.load(None).test
    curve = []
    for i in range(args.points + 1):
        t = args.seconds * i / args.points
        units = []
        for u, s in enumerate(stores):
            v = max((v for v, at in published[u].items() if v == 0 or at <= t), default=0)
            m = init_unit(cfg, u, 0)
            m.load_state_dict(s.load(v).params)
            units.append(m)
        curve.append((t, swarm_ce(units, test, args.windows, torch.device("cpu"))))
    return {"ce_by_time": curve, "ce_final": curve[-1][1], "versions": min(max(p) for p in published),
            "params": sum(t.numel() for t in init_unit(cfg, 0, 0).state_dict().values())}


def plot(runs: dict, path: Path) -> Path | None:
    plt = pyplot("diloco")
    if plt is None:
        return None

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in runs.items():
        t, ce = zip(*r["ce_by_time"])
        ax.plot(t, ce, marker="o", label=f"{LABELS[name]} ({r['bytes_per_worker_round'] / 1e6:.1f} MB/worker-round)")
    ax.set_xlabel("wall-clock since the workers started (s)")
    ax.set_ylabel("held-out CE (nats/byte)")
    ax.set_title("6 workers on 3 hosts, 40 ms RTT, 100 Mbit/s (bench/diloco.py)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def record_lever(args: argparse.Namespace, run: dict) -> None:
    """Record one tried lever's run as its own setting of diloco (lever-NAME), beside the main row it was
    measured against."""
    out = previous(result_path("diloco"))
    lever = {"run": args.only, "main_row_ce": out["runs"][args.only]["ce_final"],
             "schedule_steps": args.schedule_steps, "seconds": args.seconds, **run}
    publish("diloco", lever, {"CE": run["ce_final"], "main row CE": lever["main_row_ce"]},
            out=result_path("diloco", "lever-" + slug(args.lever), results=args.results_dir))
    print(f"[diloco] lever {args.lever}: {args.only} CE {run['ce_final']:.4f} "
          f"(main row {out['runs'][args.only]['ce_final']:.4f})", flush=True)


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("diloco")
    ap.add_argument("--seconds", type=float, default=480.0, help="wall-clock of each run from the workers' start")
    ap.rounds(h=10, batch=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--deadline", type=float, default=120.0, help="τ (s)")
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.windows(256)
    ap.add_argument("--points", type=int, default=6, help="CE time points after t = 0")
    ap.shape(SHAPE)
    ap.quick(seconds=40.0, h=2, batch=4, warmup=2, windows=16, points=2, shape=QUICK_SHAPE)
    ap.add_argument("--lever", help="a tried lever: run only --only, record it under levers.LEVER in diloco.json and "
                                    "leave the main rows as they are")
    ap.add_argument("--only", default="blocktrain", help="the run a --lever changes")
    ap.add_argument("--ada-rank", type=int, default=16, help="σ-conditioning rank of the blocktrain_lowrank run")
    ap.add_argument("--schedule-steps", type=int, help="inner cosine length (default: none, constant LR)")
    args = ap.parse_args()
    from lab.netlab.topology import Star

    reason = Star.why_unavailable()
    if reason:
        raise SystemExit(f"bench/diloco.py needs network namespaces: {reason}")
    runs = {}
    chosen = [r for r in plan_runs(args.shape, args.ada_rank) if not args.lever or r[0] == args.only]
    with tempfile.TemporaryDirectory(prefix="btnode-diloco-") as tmp, \
            Star(4, delay_ms=args.delay_ms, rate_mbit=args.rate_mbit) as lab:
        for name, model, who in chosen:
            runs[name] = run_once(lab, name, model, who, args, Path(tmp))
    if args.lever:
        record_lever(args, runs[args.only])
        return
    bt, lr, dl, ds = runs["blocktrain"], runs["blocktrain_lowrank"], runs["diloco"], runs["diloco_small"]
    out = {"blocktrain_ce": bt["ce_final"], "diloco_ce": dl["ce_final"], "diloco_small_ce": ds["ce_final"],
           "blocktrain_bytes_per_worker_round": bt["bytes_per_worker_round"],
           "blocktrain_lowrank_ce": lr["ce_final"], "blocktrain_lowrank_ada_rank": args.ada_rank,
           "blocktrain_lowrank_bytes_per_worker_round": lr["bytes_per_worker_round"],
           "bytes_ratio_diloco_over_blocktrain_lowrank": dl["bytes_per_worker_round"] / lr["bytes_per_worker_round"],
           "blocktrain_lowrank_rss_mb": lr["rss_mb"],
           "diloco_bytes_per_worker_round": dl["bytes_per_worker_round"],
           "diloco_small_bytes_per_worker_round": ds["bytes_per_worker_round"],
           "bytes_ratio_diloco_over_blocktrain": dl["bytes_per_worker_round"] / bt["bytes_per_worker_round"],
           "blocktrain_rss_mb": bt["rss_mb"], "diloco_rss_mb": dl["rss_mb"], "diloco_small_rss_mb": ds["rss_mb"],
           "n_blocks": N_BLOCKS, "replicas_per_block": REPLICAS, "workers": N_BLOCKS * REPLICAS,
           "seconds": args.seconds, "h": args.h, "batch": args.batch, "lr": args.lr, "warmup": args.warmup,
           "deadline_s": args.deadline,
           "link": {"delay_ms_one_way": args.delay_ms, "rtt_ms": 2 * args.delay_ms, "rate_mbit": args.rate_mbit},
           "windows": args.windows, "quick": args.quick, "date": datetime.date.today().isoformat(), "runs": runs}
    # tried levers keep their numbers (each records the main row it was measured beside)
    out["levers"] = previous(args.results).get("levers", {})
    png = plot(runs, RESULTS / "diloco.png") if is_published(args.results) else None
    publish("diloco", out, metrics(out), lambda res: render(res, png), out=args.results)
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))


def metrics(res: dict) -> dict[str, Metric]:
    """Held-out CE of each run at the same wall-clock, and the bytes each moves per worker-round."""
    return {"BlockTrain CE": res["blocktrain_ce"], "BlockTrain low-rank CE": res.get("blocktrain_lowrank_ce"),
            "DiLoCo CE": res["diloco_ce"], "small DiLoCo CE": res["diloco_small_ce"],
            "BlockTrain MB per worker-round": res["blocktrain_bytes_per_worker_round"] / 1e6,
            "DiLoCo MB per worker-round": res["diloco_bytes_per_worker_round"] / 1e6,
            "DiLoCo / BlockTrain bytes (×)": res["bytes_ratio_diloco_over_blocktrain"]}


def render(out: dict, png: Path | None) -> str:
    runs, link = out["runs"], out["link"]
    lines = ["## BlockTrain against DiLoCo over an emulated WAN (`bench/diloco.py`)", "",
             f"Command: `.venv/bin/python -m bench.diloco` ({out['date']}, 2 cores, root). bench/wan_train.py's lab: "
             f"the aggregator in a hub namespace, 6 worker processes on 3 hosts (2 per host, 1 torch thread each), "
             f"each host {link['rate_mbit']:g} Mbit/s (tbf) and {link['delay_ms_one_way']:g} ms one way from the hub. "
             f"Every run gets {out['seconds']:g} s of wall-clock from its workers' start. d = 128, N = 128, "
             f"H = {out['h']} steps of batch {out['batch']} per round, AdamW lr {out['lr']:g} (constant after "
             f"{out['warmup']} warmup steps), int8 updates with error feedback, τ = {out['deadline_s']:g} s. BlockTrain "
             f"averages (its aggregator's default); DiLoCo takes the outer Nesterov step (η = 0.7, μ = 0.9, its "
             f"default). CE: {out['windows']} held-out windows, SCE-1 at K = 1 for BlockTrain, teacher-forced for AR, "
             f"the same rows.", "",
             *table(["run", "parameters per worker", "rounds published", "steps per worker", "accepted",
                     "MB per worker-round (pushed + pulled)", "peak RSS per worker (MB)", "held-out CE"],
                    [(LABELS[name], f"{r['params']:,}", r["versions"], f"{r['steps_per_worker']:.0f}",
                      f"{r['accepted']}/{r['pushes']} ({r['accept_fraction']:.2f})",
                      f"{r['bytes_per_worker_round'] / 1e6:.2f}", f"{r['rss_mb']:.0f}", f"{r['ce_final']:.4f}")
                     for name, r in runs.items()], "lrrrrrrr"),
             "", f"DiLoCo (6 layers) moves {out['bytes_ratio_diloco_over_blocktrain']:.2f}× the bytes of BlockTrain "
             f"per worker-round, and {out['bytes_ratio_diloco_over_blocktrain_lowrank']:.2f}× those of BlockTrain with "
             f"--ada-rank {out['blocktrain_lowrank_ada_rank']} (aim ≥ {N_BLOCKS}).", "",
             "CE against wall-clock (what the aggregator had published by then):", "",
             *table(["t (s)", *runs], [(f"{t:.0f}", *(f"{r['ce_by_time'][i][1]:.4f}" for r in runs.values()))
                                       for i, (t, _) in enumerate(out["runs"]["blocktrain"]["ce_by_time"])],
                    "r" * (len(runs) + 1))]
    if png:
        lines += ["", f"![CE against wall-clock](bench/results/{png.name})"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
