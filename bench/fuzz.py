"""Fuzzing benchmark (issue #7): at least 10,000 cases of frame decoding and of every RPC handler
of a live aggregator and stage, with random and mutated messages (lab/fuzz.py). A case
that ends in anything but a result or a refusal with a status code counts as a crash, with its
seed. Writes bench/results/fuzz.json and a BENCHMARKS.md row.

    .venv/bin/python -m bench.fuzz                  # 10,000 cases, a few minutes on 2 cores
    .venv/bin/python -m bench.fuzz --cases 200      # a smoke run
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.flags import BenchParser
from bench.report import Progress, publish, result_path, table
from bench.runs import Metric


def main() -> None:
    ap = BenchParser(__doc__)
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--first-seed", type=int, default=1_000_000, help="seeds first-seed … first-seed+cases-1")
    ap.result("fuzz")
    args = ap.parse_args()
    if args.cases < 10_000:  # a smoke run is never part of the record
        args.results = result_path("fuzz", quick=True, results=args.results_dir)
    logging.disable(logging.WARNING)  # every refused case logs a warning; the counts are the result
    from btnode.rpc.client import SwarmClient
    from lab.fuzz import fuzz_frames, fuzz_rpc, start_target

    outcomes: dict[str, Counter] = {"frames": Counter(), "rpc": Counter()}
    crashes: list[dict] = []
    t0 = time.perf_counter()
    progress = Progress(args.cases, "fuzz")
    with tempfile.TemporaryDirectory(prefix="btnode-fuzz-") as tmp:
        target = start_target(Path(tmp))
        try:
            for i in range(args.cases):
                seed = args.first_seed + i
                kind = "frames" if i % 2 == 0 else "rpc"
                try:
                    outcomes[kind][fuzz_frames(seed) if kind == "frames" else fuzz_rpc(target, seed)] += 1
                except Exception as exc:  # noqa: BLE001 - a crash is the finding
                    crashes.append({"kind": kind, "seed": seed, "error": f"{type(exc).__name__}: {exc}"[:500]})
                progress(i + 1)
                if (i + 1) % 1000 == 0:
                    print(f"[fuzz] {i + 1}/{args.cases} cases, {len(crashes)} crashes", flush=True)
            client = SwarmClient(target.address, timeout_s=10)
            alive = bool(client.status().fingerprint)
            client.close()
            changed = target.model_changed()
        finally:
            target.shutdown()
    seconds = time.perf_counter() - t0
    out = {"cases": args.cases, "crashes": len(crashes), "crash_cases": crashes[:50], "node_alive_after": alive,
           "model_changed_without_accepted_update": changed, "seconds": seconds,
           "outcomes": {k: dict(v) for k, v in outcomes.items()}, "first_seed": args.first_seed}
    publish("fuzz", out, metrics(out), render, out=args.results)
    print(json.dumps({k: v for k, v in out.items() if k != "crash_cases"}, indent=1))
    if crashes:
        raise SystemExit(f"{len(crashes)} crashes; first: {crashes[0]}")


def metrics(res: dict) -> dict[str, Metric]:
    """Cases run and crashes, and whether the node lived and its model stayed put."""
    return {"cases": res["cases"], "crashes": res["crashes"], "node alive after": res["node_alive_after"],
            "model changed without an accepted update": res["model_changed_without_accepted_update"]}


def render(out: dict) -> str:
    f, r = out["outcomes"]["frames"], out["outcomes"]["rpc"]
    return "\n".join(["## Fuzzing (`bench/fuzz.py`)", "", *table(
        ["cases", "crashes", "frame cases: accepted / refused", "RPC cases: answers by status", "node alive after",
         "model changed by bad input", "seconds", "command"],
        [(out["cases"], out["crashes"], f"{f.get('ok', 0)} / {sum(n for k, n in f.items() if k != 'ok')}",
          ", ".join(f"{k} {v}" for k, v in sorted(r.items())), "yes" if out["node_alive_after"] else "NO",
          "YES" if out["model_changed_without_accepted_update"] else "no", f"{out['seconds']:.0f}",
          "`.venv/bin/python -m bench.fuzz`")], "rrllllrl")])


if __name__ == "__main__":
    main()
