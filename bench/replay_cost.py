"""What a replay audit costs against the training it re-runs (issue #23: "the auditor's compute ≤ p ×
a worker's"). One replica of one block of the default model trains R rounds of H steps in the
simulator with every update audited (p = 1, no probation); each audit's replay time (model set-up,
loading the start state, the H steps, encoding, hashing) is compared with the worker's time in those
H training steps. The auditor's share of a worker's compute is then p × this ratio.

    .venv/bin/python -m bench.replay_cost            # default model, H = 50, batch 32
    .venv/bin/python -m bench.replay_cost --quick
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from bench.flags import BenchParser
from bench.report import publish, table
from bench.runs import Metric
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.data.corpus import bundled
from btnode.model.config import ModelConfig
from btnode.sim.simulator import SimConfig, Simulation
from btnode.train.config import TrainConfig


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("replay-cost")
    ap.rounds(rounds=6, h=50, batch=32)
    ap.quick(rounds=3, h=5, batch=4, shape=ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32))
    ap.shape(replace(ModelConfig(), n_blocks=1), "d_model", "n_layers", "context")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (worker and auditor)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tc = TrainConfig(batch=args.batch, steps=args.rounds * args.h, warmup=args.h)
    acfg = AggregatorConfig(claims=ClaimConfig.of(tc, args.h))
    with tempfile.TemporaryDirectory(prefix="btnode-replay-") as tmp:
        sim = Simulation(args.shape, tc, acfg, SimConfig(rounds=args.rounds, replicas=1, steps_per_round=args.h,
                                                         audit=1.0, probation=0),
                         bundled().train, Path(tmp), device=torch.device("cpu"))
        sim.run()
    worker = sim.replicas[0].worker.stats
    per_update = worker.train_seconds / worker.pushes
    replays = [v.seconds for v in sim.verdicts]
    assert all(v.passed for v in sim.verdicts), "an honest replay failed"
    ratios = [r / per_update for r in replays[1:]]  # the first replay also warms up the auditor's allocator
    out = {"model": args.shape.to_dict(), "h": args.h, "batch": args.batch, "rounds": args.rounds,
           "threads": args.threads, "train_s_per_update": per_update, "replay_s": replays,
           "ratio_median": statistics.median(ratios), "ratios": ratios, "quick": args.quick}
    publish("replay-cost", out, metrics(out), render, out=args.results)
    print(f"training {per_update:.3f} s per update; replays {[round(r, 3) for r in replays]} s; "
          f"ratio median {out['ratio_median']:.3f}")


def metrics(res: dict) -> dict[str, Metric]:
    """A replay's time over the training it checks (median), and the training time per update."""
    return {"replay / training time (median)": res["ratio_median"], "training s per update": res["train_s_per_update"]}


def render(out: dict) -> str:
    m = out["model"]
    return "\n".join([
        "## What a replay audit costs (`bench/replay_cost.py`)", "",
        f"Command: `.venv/bin/python -m bench.replay_cost` (2 cores, {out['threads']} torch threads). One replica of "
        f"one block (d={m['d_model']}, L={m['n_layers']}, N={m['context']}) trains {out['rounds']} rounds of "
        f"H = {out['h']} (batch {out['batch']}) in the simulator, every update audited (p = 1, no probation). Ratio: "
        "one replay's time (set-up, state loading, the H steps, encoding, hashing) over the worker's time in the H "
        "training steps of that update; the auditor's share of a worker's compute is p × this ratio (the first "
        "replay, which warms up, is left out).", "",
        *table(["training per update (s)", "replay per update (s, median)", "replay / training (median)",
                "per replay"],
               [(f"{out['train_s_per_update']:.3f}", f"{statistics.median(out['replay_s'][1:]):.3f}",
                 f"{out['ratio_median']:.3f}", " ".join(f"{r:.3f}" for r in out["ratios"]))], "rrrl")])


if __name__ == "__main__":
    main()
