"""What verification costs in round time, with real processes (issue #39, "Latency"): an aggregator and
N worker processes of one block, each enrolled with its own join code (the default swarm), R rounds;
drawn updates and those on probation are held out of their round until their verdict. Modes: the
shipped configuration (`delegated`: the other workers replay them while they wait for the round), the
aggregator replaying every audit itself (`aggregator_only`, `--verify-min-workers 0`), and no audits.
Per mode: the seconds between published versions in the probation rounds (0–1: every update held) and
after (a share p drawn), median. On a 2-core host N + 1 processes share the cores: the numbers compare
modes side by side, they are not a WAN figure.

    .venv/bin/python -m bench.verify_rounds            # N = 4, 6 rounds, d = 64
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.flags import BenchParser
from bench.report import publish, table
from bench.runs import Metric
from btnode.node.launch import one_thread_env, spawn_node, stop_processes, wait_port
from btnode.rpc.client import SwarmClient
from btnode.rpc.enroll import SwarmAuthority, identity_security

SHAPE = ["--d-model", "64", "--heads", "2", "--layers", "1", "--blocks", "1", "--context", "64", "--segments", "1,8"]
MODES = {"delegated": [], "aggregator_only": ["--verify-min-workers", "0"], "no_audits": ["--audit", "0"]}


def run(mode: str, n: int, rounds: int, h: int, batch: int, work: Path) -> dict:
    d = work / mode
    training = ["--steps-per-round", str(h), "--batch", str(batch)]
    agg = spawn_node(["join", "--role", "aggregator", "--listen", "127.0.0.1:0", "--port-file", str(d / "port"),
                      "--state-dir", str(d / "state"), "--deadline", "120", *training, *SHAPE, *MODES[mode]],
                     log=d / "agg.log", env=one_thread_env())
    procs = [agg]
    try:
        address = f"127.0.0.1:{wait_port(d / 'port', agg)}"
        authority = SwarmAuthority(d / "state")
        t0 = time.monotonic()
        for i in range(n):
            code, _ = authority.mint(name=f"w{i}", host="127.0.0.1")
            procs.append(spawn_node(["join", "--role", "worker", "--block", "0", "--peer", address, "--rounds",
                                     str(rounds), "--warmup", "1", *training, *SHAPE, "--stats-file",
                                     str(d / f"w{i}.json")], log=d / f"w{i}.log",
                                    env=one_thread_env(BTNODE_JOIN_CODE=str(code), BTNODE_IDENTITY=str(d / f"id{i}"))))
        for p in procs[1:]:
            if p.wait(timeout=900) != 0:
                raise SystemExit(f"a worker of mode {mode} failed: see {d}")
        wall = time.monotonic() - t0
        ops = SwarmClient(address, timeout_s=30, security=identity_security(authority.operator))
        try:
            status = ops.status_dict()
        finally:
            ops.close()
    finally:
        stop_processes(procs)
    recent = sorted(status["blocks"][0]["recent"], key=lambda r: r["version"])
    closed = [r["closed_at_unix"] for r in recent]
    gaps = [b - a for a, b in zip(closed, closed[1:])]  # version v → v + 1: round v's time, from version 1 on
    stats = [json.loads((d / f"w{i}.json").read_text()) for i in range(n)]
    return {"mode": mode, "n_workers": n, "versions": recent[-1]["version"] if recent else 0, "wall_s": wall,
            "round_s": gaps, "probation_round_s": gaps[:1], "later_round_s": gaps[1:],
            "closed_by": sorted({r["closed_by"] for r in recent}),
            "verified": sum(s.get("verified", 0) for s in stats),
            "train_s": sum(s["train_seconds"] for s in stats)}


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("verify-rounds")
    ap.rounds(rounds=6, h=10, batch=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="btnode-verify-rounds-") as tmp:
        for mode in args.modes:
            r = run(mode, args.workers, args.rounds, args.h, args.batch, Path(tmp))
            runs.append(r)
            print(f"{mode:16s} rounds {[round(g, 2) for g in r['round_s']]} s; wall {r['wall_s']:.1f} s; "
                  f"verified by workers {r['verified']}; closed by {r['closed_by']}", flush=True)
    out = {"runs": runs, "shape": SHAPE, "h": args.h, "batch": args.batch, "rounds": args.rounds}
    publish("verify-rounds", out, metrics(out), render, out=args.results)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def metrics(out: dict) -> dict[str, Metric]:
    return {f"round s after probation, {r['mode']}": median(r["later_round_s"]) for r in out["runs"]}


def render(out: dict) -> str:
    return "\n".join([
        "## Verification in round time, real processes (`bench/verify_rounds.py`)", "",
        f"Command: `.venv/bin/python -m bench.verify_rounds`. An aggregator and {out['runs'][0]['n_workers']} enrolled "
        f"worker processes of one block (d = 64, L = 1), {out['rounds']} rounds of H = {out['h']} (batch "
        f"{out['batch']}), all on the 2-core host. Drawn and probation updates are held until their verdict. "
        "Round 1 (version 1 → 2) is the second probation round: every update held.", "",
        *table(["mode", "probation round (s)", "later rounds (s, median)", "rounds (s)", "wall (s)",
                "replays by workers", "closed by"],
               [(r["mode"], " ".join(f"{g:.2f}" for g in r["probation_round_s"]), f"{median(r['later_round_s']):.2f}",
                 " ".join(f"{g:.2f}" for g in r["round_s"]), f"{r['wall_s']:.1f}", r["verified"],
                 ", ".join(r["closed_by"])) for r in out["runs"]], "lrrlrrl")])


if __name__ == "__main__":
    main()
