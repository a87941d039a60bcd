"""What the root keeps per worker for its Join alone (issue #25): one in-process SwarmAggregator of the
load test's shape and claims (bench/scale.py), N workers joined one after another with the terms the
simulated workers state, and Python's own allocations (tracemalloc) retained by those N joins, split
by the line that made them. The process's RSS is not used: N small objects move it by less than its
noise. What it cannot see: memory outside Python's allocator (gRPC's per-connection buffers, which
bench/conn_memory.py measures on a real process).

    python -m bench.join_memory --n 1000
"""

from __future__ import annotations

import json
import tempfile
import tracemalloc
from pathlib import Path

from bench.flags import BenchParser
from bench.report import publish
from bench.runs import Metric
from bench.scale import BATCH, H, LR, SHAPE
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.train.config import TrainConfig
from btnode.train.terms import TrainingTerms


def retained(n: int, state_dir: Path, top: int) -> dict:
    tc = TrainConfig(batch=BATCH, lr=LR)
    agg = SwarmAggregator(SHAPE, AggregatorConfig(claims=ClaimConfig.of(tc, H)), state_dir)
    terms, config = TrainingTerms(tc, H).to_json(), json.dumps(SHAPE.to_dict())
    agg.join("warm-up", 0, SHAPE.fingerprint(), config, training_json=terms)  # first-use caches out of the count
    tracemalloc.start(1)
    before = tracemalloc.take_snapshot()
    for i in range(n):
        agg.join(f"worker-{i:05d}", 0, SHAPE.fingerprint(), config, training_json=terms)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    diff = after.compare_to(before, "lineno")
    total = sum(d.size_diff for d in diff)
    return {"n_workers": n, "bytes_per_worker": round(total / n, 1),
            "by_line": [{"where": str(d.traceback[0]).replace(str(Path.cwd()) + "/", ""),
                         "bytes_per_worker": round(d.size_diff / n, 1)} for d in diff[:top]]}


def metrics(res: dict) -> dict[str, Metric]:
    """Python's bytes retained per joined worker (the by-line split stays in the run's detail)."""
    return {"bytes per worker": res["bytes_per_worker"]}


def main() -> None:
    p = BenchParser(__doc__)
    p.result("join-memory")
    p.add_argument("--n", type=int, default=1000, help="workers joined")
    p.add_argument("--top", type=int, default=8, help="lines shown")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = retained(args.n, Path(d), args.top)
    print(json.dumps(out, indent=1))
    publish("join-memory", out, metrics(out), out=args.results)


if __name__ == "__main__":
    main()
