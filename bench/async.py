"""Asynchrony benchmark (issue #5, design §6.5): CE after R rounds for 3 blocks × 2 replicas at
lockstep (100 %), 90 % and 42 % participation, in the virtual async simulator (`btnode simulate`:
the daemon's own aggregator and workers, with only the network and the clock replaced), plus the
CE of the initial model.

    .venv/bin/python -m bench.async           # ~25 min on 2 cores
    .venv/bin/python -m bench.async --quick   # a smoke run

Each participation level below 100 % runs with --seeds participation streams; the table shows
each run and the key holds their mean. CE is SCE-1 at K = 1 in nats/byte on held-out windows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.flags import QUICK_SHAPE, SHAPE, BenchParser, shape_flags
from bench.report import previous, publish, shown, table
from bench.runs import Metric
from btnode.node.launch import CLI

LEVELS = (("lockstep", 1.0), ("p90", 0.9), ("p42", 0.42))


def simulate(p: float, seed: int, args: argparse.Namespace, out: Path, eval_init: bool) -> tuple[dict, str]:
    cmd = [*CLI, "simulate", "--participation", str(p), "--rounds", str(args.rounds), "--replicas", "2",
           "--steps-per-round", str(args.h), "--step-time", "0.1", "--delay-ms", "20", "--delay-dist", "exp",
           "--batch", str(args.batch), "--eval-windows", str(args.windows), "--sim-seed", str(seed),
           "--json", str(out), *(["--eval-init"] if eval_init else []), *shape_flags(args.shape)]
    display = shown(cmd).replace(str(out), out.name)  # the temporary folder is gone afterwards
    print(f"[async] {display}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"simulate failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text()), display


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("async")
    ap.rounds(rounds=30, h=10, batch=16)
    ap.windows(128)
    ap.seeds(2, help="participation streams per level below 100 %%")
    ap.shape(SHAPE)
    ap.quick(rounds=3, h=2, batch=4, windows=8, seeds=1, shape=QUICK_SHAPE)
    ap.add_argument("--reuse", action="store_true", help="only rewrite the report from the last recorded run")
    ap.add_argument("--levels", nargs="*", help="run only these levels (lockstep, p90, p42), keeping the others "
                                                "from the last recorded run")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {}
    ce_init = None
    if args.reuse or args.levels:
        old = previous(args.results)
        runs, ce_init = old["runs"], old["ce_init"]
        runs = {k: v for k, v in runs.items() if not args.levels or k not in args.levels}
        for rs in runs.values():
            for r in rs:
                r["command"] = " ".join(a if not a.startswith("/tmp/") else Path(a).name for a in r["command"].split())
    with tempfile.TemporaryDirectory(prefix="btnode-async-") as tmp:
        for name, p in LEVELS if not args.reuse else ():
            if args.levels and name not in args.levels:
                continue
            runs[name] = []
            for seed in range(1 if p == 1.0 else args.seeds):
                res, cmd = simulate(p, seed, args, Path(tmp) / f"{name}-{seed}.json", eval_init=ce_init is None)
                ce_init = res["ce_init"] if ce_init is None else ce_init
                res["command"] = cmd
                runs[name].append(res)
                print(f"[async] {name} seed {seed}: CE {res['ce']:.4f}, versions {res['versions']}", flush=True)
    runs = {name: runs[name] for name, _ in LEVELS if name in runs}
    out = {f"ce_{name}": statistics.mean(r["ce"] for r in rs) for name, rs in runs.items()}
    out.update(ce_init=ce_init, rounds=args.rounds, h=args.h, batch=args.batch, windows=args.windows, quick=args.quick,
               runs=runs)
    out["p90_minus_lockstep"] = out["ce_p90"] - out["ce_lockstep"]
    out["p42_minus_lockstep"] = out["ce_p42"] - out["ce_lockstep"]
    publish("async", out, metrics(out), render, out=args.results)
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))


def metrics(res: dict) -> dict[str, Metric]:
    """Held-out CE (nats/byte) in lockstep and at each participation, beside the initial model's."""
    return {"CE, lockstep": res["ce_lockstep"], "CE, 90 % participation": res["ce_p90"],
            "CE, 42 % participation": res["ce_p42"], "CE, initial model": res["ce_init"]}


def render(out: dict) -> str:
    rows = [(f"{p:.0%}", r["sim"]["seed"], f"{r['ce']:.4f}", "/".join(str(x) for x in r["versions"].values()),
             r["outcomes"].get("pending", r["outcomes"].get("accepted", 0)), r["outcomes"]["late"], f"{r['virtual_seconds']:.1f}", f"`{r['command']}`")
            for name, p in LEVELS for r in out["runs"][name]]
    return "\n".join([
        "## Asynchrony: participation in the virtual async simulator (`bench/async.py`)", "",
        f"Command: `.venv/bin/python -m bench.async` (2 cores). 3 blocks × 2 replicas, d=128, L=2, N=128, "
        f"R = {out['rounds']} attempts per replica of H = {out['h']} local steps (batch {out['batch']}, int8 updates "
        f"with error feedback), 0.1 virtual s per step, one-way delays exponential with mean 20 ms, "
        f"τ = 1.5 × H × step time. A replica that sits out an attempt is away for τ. CE: SCE-1 at K = 1 on "
        f"{out['windows']} held-out windows (nats/byte).", "",
        *table(["participation", "stream", "CE after R rounds", "versions per block", "accepted", "late", "virtual s",
                "command"], rows, "lrrlrrrl"),
        "", f"Initial model: {out['ce_init']:.4f}. Means: lockstep {out['ce_lockstep']:.4f}, 90 % {out['ce_p90']:.4f} "
        f"({out['p90_minus_lockstep']:+.4f}; aim within 0.02), 42 % {out['ce_p42']:.4f} "
        f"({out['p42_minus_lockstep']:+.4f}; aim: far better than the initial model)."])


if __name__ == "__main__":
    main()
