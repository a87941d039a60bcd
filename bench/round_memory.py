"""One round's memory at the aggregator, in process (issue #25, item 1): a `BlockAggregator` for
one block of a real shape takes N int8 updates through `submit` (with their raw bytes, as the RPC
layer passes them) and closes; each (rule, N) runs in a child of its own, so that its peak RSS
(VmHWM) is its own. `--against REF` runs the same rounds with git ref REF's btnode beside this
tree's, interleaved (one change at a time: the code, nothing else).

Reported per row: the child's RSS once the aggregator is built (`base_mb`: Python, torch, θ),
its peak (`peak_mb`), the close's seconds (the last update's submit, which closes the round, to
the version published), and the growth per update ((peak(N) − peak(2)) / (N − 2)). The block's
fp32 size P is the unit: `fixed_over_unit` = (peak(2) − RSS of the same child with torch loaded
but no aggregator) / P.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.codec_speed import tree_env
from bench.flags import BenchParser
from bench.report import ROOT, invoked, module_command, publish, table
from bench.runs import Metric

SHAPE = {"d_model": 512, "n_layers": 2, "n_heads": 8}  # one block: 11.0 M parameters, 44 MB in fp32
QUICK = {"d_model": 128, "n_layers": 2, "n_heads": 4}
RULES = ("mean", "screened", "median")


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def child(rule: str, n: int, shape: dict, workdir: Path) -> dict:
    """One round in this process; prints its measurements as JSON."""
    import inspect

    import torch

    from btnode.aggregate.sums.averaging import OuterConfig
    from btnode.aggregate.round.block import BlockAggregator
    from btnode.aggregate.round.config import AggregatorConfig
    from btnode.aggregate.trust.claims import ClaimConfig
    from btnode.aggregate.round.rounds import RoundConfig
    from btnode.codec.codecs import Codec, decode, encode
    from btnode.model.config import ModelConfig
    from btnode.protocol import PushHeader
    from btnode.store.models import init_unit
    from btnode.store.versions import VersionStore

    torch.set_num_threads(1)
    try:
        from btnode.node.memory import return_freed_memory  # what the aggregator process does at start
        return_freed_memory()
    except ImportError:
        pass
    cfg = ModelConfig(**shape)
    init = init_unit(cfg, 0, 0).state_dict()
    spec = {k: tuple(t.shape) for k, t in init.items()}
    params = sum(t.numel() for t in init.values())
    g = torch.Generator().manual_seed(0)
    base = {k: 1e-3 * torch.randn(s, generator=g) for k, s in spec.items()}

    def update(i: int) -> dict[str, bytes]:  # N distinct int8 updates, made one at a time as they "arrive"
        return {k: encode(Codec.INT8, base[k] * (1 + 0.01 * i) + 1e-4 * torch.randn(spec[k], generator=g))
                for k in spec}

    with_torch_mb = _rss_mb("VmRSS")
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=3600), claims=ClaimConfig(batch=1, lr=1e-3, steps_per_round=1,
                                                                                   enforce=False),
                            outer=OuterConfig(robust=rule))
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        agg = BlockAggregator(0, init, VersionStore(Path(tmp), 0), acfg)
        del init
        takes_raw = "raw" in inspect.signature(agg.submit).parameters
        workers = [f"w{i:04d}" for i in range(n)]
        for w in workers:
            agg.register(w)
        base_mb = _rss_mb("VmRSS")
        t_close = 0.0
        for i, w in enumerate(workers):
            raw = update(i)
            delta = {k: decode(Codec.INT8, raw[k], spec[k]) for k in spec}
            head = PushHeader(worker_id=w, block=0, base_version=0, samples=1.0, loss=1.0, codec=Codec.INT8,
                              update_id=f"{w}-0", steps=(0,))
            t0 = time.perf_counter()
            out = agg.submit(head, delta, raw=raw) if takes_raw else agg.submit(head, delta)
            if i == n - 1:
                t_close = time.perf_counter() - t0
            assert out.outcome.value == "pending", out
            del delta, raw
        assert agg.info.version == 1
    return {"rule": rule, "n": n, "params": params, "with_torch_mb": with_torch_mb, "base_mb": base_mb,
            "peak_mb": _rss_mb("VmHWM"), "after_mb": _rss_mb("VmRSS"), "close_s": t_close, "holds_raw": takes_raw}


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("round-memory")
    ap.quick(help="smoke run: a small block, N ≤ 8, no report", ns=[2, 8])
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[2, 16, 64, 128])
    ap.add_argument("--rules", type=lambda s: s.split(","), default=list(RULES))
    ap.add_argument("--median-ns", type=lambda s: [int(x) for x in s.split(",")], default=[2, 16, 64],
                    help="N of the trimmed and median rows (their close reads N × 4 bytes a parameter from disk)")
    ap.add_argument("--before-log", type=Path, help="a log of an earlier run's '[round-memory]' lines to show "
                                                    "beside this one's rows (marked as such)")
    ap.add_argument("--against", metavar="REF", help="also run git ref REF's btnode, interleaved")
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench-round-memory")
    ap.add_argument("--child", nargs=2, metavar=("RULE", "N"), help=__import__("argparse").SUPPRESS)
    args = ap.parse_args()
    shape = QUICK if args.quick else SHAPE
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), shape, args.workdir)))
        return
    trees = {"this tree": {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}}
    if args.against:
        trees[args.against] = tree_env(args.against, args.workdir)
    rows = []
    for rule in args.rules:
        for n in (args.median_ns if rule in ("trimmed", "median") else args.ns):
            for code, env in trees.items():
                cmd = module_command("bench.round_memory", "--child", rule, str(n), *(["--quick"] if args.quick else []))
                out = subprocess.run(cmd, env=env, cwd=args.workdir, capture_output=True, text=True)  # not ROOT: its btnode would come first
                if out.returncode != 0:
                    sys.stderr.write(out.stderr[-3000:])
                    raise SystemExit(f"child failed: {rule} N={n} ({code})")
                row = {"code": code, **json.loads(out.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(f"[round-memory] {code:>10} {rule:>8} N={n:4d}: base {row['base_mb']:.0f} MB, peak "
                      f"{row['peak_mb']:.0f} MB, close {row['close_s']:.2f} s", flush=True)
    unit_mb = 4 * rows[0]["params"] / 2**20
    for code in trees:
        for rule in args.rules:
            mine = sorted((r for r in rows if r["code"] == code and r["rule"] == rule), key=lambda r: r["n"])
            first = mine[0]
            for r in mine:
                r["fixed_over_unit"] = (first["peak_mb"] - first["with_torch_mb"]) / unit_mb
                r["per_update_mb"] = ((r["peak_mb"] - first["peak_mb"]) / (r["n"] - first["n"])
                                      if r["n"] > first["n"] else None)
    before = _before(args.before_log) if args.before_log else []
    res = {"shape": shape, "params": rows[0]["params"], "unit_mb": unit_mb, "rows": rows, "before": before,
           "command": invoked(),
           "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} cores"}
    publish("round-memory", res, metrics(res), render, out=args.results)


def _before(log: Path) -> list[dict]:
    """Rows of an earlier run, read back from its progress lines (code, rule, N, base, peak, close)."""
    import re

    out = []
    for m in re.finditer(r"\[round-memory\]\s+(.+?)\s+(mean|screened|trimmed|median) N=\s*(\d+): base (\d+) MB, "
                         r"peak (\d+) MB, close ([\d.]+) s", log.read_text()):
        out.append({"code": m[1], "rule": m[2], "n": int(m[3]), "base_mb": float(m[4]), "peak_mb": float(m[5]),
                    "close_s": float(m[6])})
    return out


def metrics(res: dict) -> dict[str, Metric]:
    """Peak RSS and close time of one round for each rule at each N, largest N first."""
    out: dict[str, Metric] = {}
    for r in sorted(res["rows"], key=lambda r: -r["n"]):
        out[f"{r['rule']} N = {r['n']}: peak (MB)"] = r["peak_mb"]
        out[f"{r['rule']} N = {r['n']}: close (s)"] = r["close_s"]
    return out


def render(r: dict) -> str:
    lines = ["## One round's memory at the aggregator (`bench/round_memory.py`)", "",
             f"Command: `{r['command']}` ({r['date']}, {r['machine']}). One block of {r['params'] / 1e6:.1f} M "
             f"parameters (P = {r['unit_mb']:.0f} MiB in fp32), N int8 updates submitted in process with their raw "
             "bytes, one child per row (peak = its VmHWM). `fixed ×P`: the peak at the smallest N less the same "
             "child's RSS with torch loaded and no aggregator, over P: θ (1 P), the exact int64 running sum "
             "(2 P), and the one update being judged (its decoded values, 1 P, and raw int8 bytes, 0.25 P). "
             "`mean` and `screened` hold nothing per update but a 4,096-value sketch; `median` holds one "
             "64 MiB column of all the updates (read from the round's spill on disk) at close.", ""]
    lines += table(["code", "rule", "N", "base MB", "peak MB", "per extra update MB", "fixed ×P", "close s"],
                   [[x["code"], x["rule"], x["n"], f"{x['base_mb']:,.0f}", f"{x['peak_mb']:,.0f}",
                     "" if x["per_update_mb"] is None else f"{x['per_update_mb']:.1f}", f"{x['fixed_over_unit']:.1f}",
                     f"{x['close_s']:.2f}"] for x in r["rows"]], "lllrrrrr")
    if r.get("before"):
        lines += ["", "Beside it, the same bench run earlier with `--against f726dd5` (both trees interleaved, "
                  "on a machine shared with other jobs); that run was stopped by its time limit at the last row "
                  "before it wrote its JSON, so these rows come from its progress lines (`--before-log`):", ""]
        lines += table(["code", "rule", "N", "base MB", "peak MB", "close s"],
                       [[x["code"], x["rule"], x["n"], f"{x['base_mb']:,.0f}", f"{x['peak_mb']:,.0f}",
                         f"{x['close_s']:.2f}"] for x in r["before"]], "lllrrr")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
