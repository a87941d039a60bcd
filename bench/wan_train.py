"""WAN training benchmark (issue #5, design §6.5): a real swarm (the aggregator and 3 blocks × 2
replicas, every node its own `btnode join` process) across emulated internet links, measured
with and without training while waiting (no idle waiting), side by side in one run.

Topology: a star of network namespaces. The aggregator runs in the hub h0; h1, h2 and h3 each
run two workers (replicas of one block are on different hosts) and reach the hub over their own
link of `--delay-ms` one way (40 ms round trip by default) at `--rate-mbit` (tbf), through the
userspace delay line of lab.netlab. Needs root.

    .venv/bin/python -m bench.wan_train           # ~10 min on 2 cores
    .venv/bin/python -m bench.wan_train --quick   # a smoke run

Runs, in order, on the same lab:
  idle     τ = --deadline,       workers wait idle for each version
  overlap  τ = --deadline,       workers train while waiting and fold that work in
  short-τ  τ = --short-deadline, workers train while waiting (how acceptance falls with τ)
Reported per run: bytes moved (wire bytes pushed and pulled by the workers), the fraction of
pushed updates accepted, each worker's utilisation (time inside training steps ÷ wall time of
the worker process), and CE (SCE-1 at K = 1) against rounds from the versions the aggregator kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path

from bench.flags import QUICK_SHAPE, SHAPE, BenchParser, shape_flags
from bench.report import previous, publish, result_path, table
from bench.runs import Metric
from btnode.node.launch import NodeProcess, one_thread_env, spawn_node, start_node

PORT = 7070
N_BLOCKS, REPLICAS = 3, 2


def host_of(block: int, replica: int) -> int:
    """Worker hosts 1..3; the two replicas of a block never share one."""
    return 1 + (block + replica) % 3


def start_aggregator(lab, d: Path, shape: list[str], tau: float, training: list[str]) -> NodeProcess:
    """The aggregator in the hub h0, listening on PORT, keeping every version (its log and state in d).
    `training`: the workers' --steps-per-round, --batch and --lr flags, which it checks their claims by."""
    return start_node(["join", "--role", "aggregator", "--listen", f"0.0.0.0:{PORT}", "--state-dir", str(d / "state"),
                       "--deadline", str(tau), "--keep", "100000", *training, *shape,
                       "--no-identities", "--audit", "0"],  # as measured before #38's defaults (identities, audits); docs/security.md for the defaults' costs
                      port_file=d / "port",
                      log=d / "aggregator.log", env=one_thread_env(), popen=partial(lab.popen, 0), name="aggregator")


def spawn_worker(lab, d: Path, host: int, unit: int, worker_id: str, flags: list[str]) -> subprocess.Popen:
    """A worker of `unit` on `host`, reaching the hub's aggregator over its link; stats in d/WORKER_ID.json."""
    return spawn_node(["join", "--role", "worker", "--block", str(unit), "--peer", f"{lab.hub_address(host)}:{PORT}",
                       "--worker-id", worker_id, *flags, "--stats-file", str(d / f"{worker_id}.json")],
                      log=d / f"{worker_id}.log", env=one_thread_env(), popen=partial(lab.popen, host))


def run_once(lab, name: str, tau: float, overlap: bool, args: argparse.Namespace, work: Path,
             workers_: list[tuple[int, int]] | None = None) -> dict:
    d = work / name
    d.mkdir(parents=True)
    shape = shape_flags(args.shape)
    training = ["--steps-per-round", str(args.h), "--batch", str(args.batch)]
    agg = start_aggregator(lab, d, shape, tau, training)
    t0 = time.perf_counter()
    chosen = workers_ or [(b, r) for b in range(N_BLOCKS) for r in range(REPLICAS)]
    workers = [spawn_worker(lab, d, host_of(b, r), b, f"b{b}r{r}",
                            ["--rounds", str(args.rounds), *training, "--warmup", "10", "--train-while-waiting" if overlap else "--idle-while-waiting", *shape])
               for b, r in chosen]
    codes = [w.wait(timeout=args.timeout) for w in workers]
    wall = time.perf_counter() - t0
    agg.stop(timeout_s=60)
    if any(codes):
        raise SystemExit(f"{name}: workers exited with {codes}; logs in {d}")
    stats = {f"b{b}r{r}": json.loads((d / f"b{b}r{r}.json").read_text()) for b, r in chosen}
    pushes = sum(s["pushes"] for s in stats.values())
    accepted = sum(s["outcomes"].get("pending", 0) for s in stats.values())
    util = {w: s["train_seconds"] / s["wall_seconds"] for w, s in stats.items()}
    res = {"tau_s": tau, "train_while_waiting": overlap, "wall_s": wall,
           "bytes_total": sum(s["bytes_pushed_wire"] + s["bytes_pulled_wire"] for s in stats.values()),
           "bytes_pushed": sum(s["bytes_pushed_wire"] for s in stats.values()),
           "bytes_pulled": sum(s["bytes_pulled_wire"] for s in stats.values()),
           "pushes": pushes, "accepted": accepted, "accept_fraction": accepted / pushes,
           "utilisation": statistics.mean(util.values()), "utilisation_per_worker": util,
           "steps": sum(s["steps"] for s in stats.values()), "wait_steps": sum(s["wait_steps"] for s in stats.values()),
           "outcomes": {o: sum(s["outcomes"].get(o, 0) for s in stats.values()) for o in ("pending", "late", "stale",
                                                                                          "rejected")}}
    res["ce_by_round"] = ce_by_round(d / "state", args)
    res["versions"] = max(r for r, _ in res["ce_by_round"])
    res["ce_final"] = res["ce_by_round"][-1][1]
    print(f"[wan] {name}: τ={tau:g} s, {wall:.0f} s, accepted {accepted}/{pushes}, utilisation "
          f"{res['utilisation']:.3f}, {res['bytes_total'] / 1e6:.1f} MB, CE {res['ce_final']:.4f}", flush=True)
    return res


def ce_by_round(state: Path, args: argparse.Namespace) -> list[tuple[int, float]]:
    """CE of the model with every block at version min(r, its newest), for r = 0, every, 2·every, …, last."""
    import torch

    from btnode.data import corpus
    from btnode.evaluation.metrics import sce1_k1
    from btnode.model.config import ModelConfig
    from btnode.store.models import RUN_FILE, init_block
    from btnode.store.versions import VersionStore

    cfg = ModelConfig.from_dict(json.loads((state / RUN_FILE).read_text())["model"])
    stores = [VersionStore(state, b, keep=100000) for b in range(cfg.n_blocks)]
    newest = [max(s.versions()) for s in stores]
    trained = [b for b in range(cfg.n_blocks) if newest[b] > 0]
    test = corpus.load(None).test
    rounds = sorted({*range(0, max(newest[b] for b in trained) + 1, args.ce_every), max(newest)})
    out = []
    for r in rounds:
        blocks = []
        for b, s in enumerate(stores):
            blk = init_block(cfg, b, 0)
            blk.load_state_dict(s.load(min(r, newest[b])).params)
            blocks.append(blk)
        out.append((r, sce1_k1(blocks, test, args.windows, torch.device("cpu"))))
    return out


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("wan-train")
    ap.rounds(rounds=12, h=5, batch=16)
    ap.add_argument("--deadline", type=float, default=60.0, help="τ of the main runs (s)")
    ap.add_argument("--short-deadline", type=float, default=1.0, help="τ of the short-τ run (s)")
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.windows(64)
    ap.add_argument("--ce-every", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.shape(SHAPE)
    ap.quick(rounds=2, h=2, batch=4, windows=8, ce_every=1, shape=QUICK_SHAPE)
    ap.add_argument("--only", nargs="*", help="run only these runs, keeping the others from bench/results/wan_train.json")
    args = ap.parse_args()
    from lab.netlab.topology import Star

    reason = Star.why_unavailable()
    if reason:
        raise SystemExit(f"bench/wan_train.py needs network namespaces: {reason}")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="btnode-wan-") as tmp, \
            Star(4, delay_ms=args.delay_ms, rate_mbit=args.rate_mbit) as lab:
        plan = [("idle", args.deadline, False, None), ("overlap", args.deadline, True, None),
                ("short_tau", args.short_deadline, True, None),
                # one worker per host for blocks 0 and 1: no two workers share a core, so waiting
                # shows as lost compute instead of handing the CPU to another worker
                ("idle_2w", args.deadline, False, [(0, 0), (1, 0)]), ("overlap_2w", args.deadline, True, [(0, 0), (1, 0)])]
        if args.only:
            previous_runs = previous(result_path("wan-train"))["runs"]
            runs.update({k: v for k, v in previous_runs.items() if k not in args.only})
        for name, tau, overlap, who in plan:
            if not args.only or name in args.only:
                runs[name] = run_once(lab, name, tau, overlap, args, Path(tmp), who)
        runs = {name: runs[name] for name, *_ in plan if name in runs}
    main_run = runs["overlap"]
    out = {"wan_bytes_total": main_run["bytes_total"], "wan_accept_fraction": main_run["accept_fraction"],
           "wan_ce_final": main_run["ce_final"], "wan_utilisation": main_run["utilisation"],
           "wan_utilisation_idle": runs["idle"]["utilisation"],
           **({"wan_utilisation_2w": runs["overlap_2w"]["utilisation"],
               "wan_utilisation_2w_idle": runs["idle_2w"]["utilisation"]} if "overlap_2w" in runs else {}),
           "wan_accept_by_tau": {str(r["tau_s"]): r["accept_fraction"] for r in (runs["overlap"], runs["short_tau"])},
           "link": {"delay_ms_one_way": args.delay_ms, "rtt_ms": 2 * args.delay_ms, "rate_mbit": args.rate_mbit},
           "rounds": args.rounds, "h": args.h, "batch": args.batch, "quick": args.quick, "runs": runs}
    publish("wan-train", out, metrics(out), render, out=args.results)
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))


def metrics(res: dict) -> dict[str, Metric]:
    """Compute utilisation waiting idle and training while waiting, updates accepted, final CE, WAN bytes."""
    return {"utilisation, idle while waiting": res["wan_utilisation_idle"],
            "utilisation, training while waiting": res["wan_utilisation"], "accepted share": res["wan_accept_fraction"],
            "final CE": res["wan_ce_final"], "WAN MB": res["wan_bytes_total"] / 1e6}


def render(out: dict) -> str:
    runs, link = out["runs"], out["link"]
    ce = {name: dict(r["ce_by_round"]) for name, r in runs.items()}
    return "\n".join([
        "## Training over an emulated WAN (`bench/wan_train.py`)", "",
        f"Command: `.venv/bin/python -m bench.wan_train` (2 cores, root). The aggregator in a hub namespace, "
        f"3 blocks × 2 replicas as 6 `btnode join --role worker` processes on 3 worker hosts, each host linked to "
        f"the hub at {link['rate_mbit']:g} Mbit/s (tbf) with {link['delay_ms_one_way']:g} ms one way "
        f"({link['rtt_ms']:g} ms round trip, userspace delay line). d=128, L=2, N=128, H = {out['h']} steps of "
        f"batch {out['batch']} per round, {out['rounds']} rounds per worker, int8 updates, fp32 published deltas, "
        f"1 torch thread per worker (6 workers share 2 cores; the *_2w runs have one worker each for blocks 0 and 1, "
        f"so no two workers share a core).", "",
        *table(["run", "τ (s)", "train while waiting", "wall (s)", "versions", "accepted / pushed", "utilisation",
                "MB moved", "CE final"],
               [(name, f"{r['tau_s']:g}", "yes" if r["train_while_waiting"] else "no", f"{r['wall_s']:.0f}",
                 r["versions"], f"{r['accepted']}/{r['pushes']} ({r['accept_fraction']:.2f})", f"{r['utilisation']:.3f}",
                 f"{r['bytes_total'] / 1e6:.1f}", f"{r['ce_final']:.4f}") for name, r in runs.items()], "lrlrrrrrr"),
        "", "CE (SCE-1, K = 1, nats/byte) against rounds (every block at that version):", "",
        *table(["round", *runs], [(rnd, *(f"{t[rnd]:.4f}" if rnd in t else "" for t in ce.values()))
                                  for rnd in sorted({k for t in ce.values() for k in t})], "r" * (len(runs) + 1))])


if __name__ == "__main__":
    main()
