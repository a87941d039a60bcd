"""Where the aggregator's fixed memory goes (issue #25): bench/scale.py's unit row (one real
aggregator process, a 43 M-parameter block, N = 8 simulated int8 workers, 2 rounds), with the
root's VmRSS sampled every 20 ms and each sample set beside the root's log line before it, so the
peak is named by the phase it happened in (join pulls, a push being judged, a close, the delta
fetches after it). Prints one line per phase: its peak RSS and that peak over the unit P, less
the idle runtime (bench/scale.py's fixed_rss_over_unit is the same ratio at the row's VmHWM).

Not a published table: a tool to find the peak. `--runs K` repeats the row. Each run appends a line
to bench/results/fixed-memory.jsonl (label, commit, root flags, idle, P, VmHWM, fixed over P, and
the peak of each phase), the record BENCHMARKS.md's scale notes quote.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from bench import scale
from bench.flags import BenchParser
from bench.report import ROOT, publish, result_path
from bench.runs import Metric, slug

MB = 2**20


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _root_pid(state: str) -> int | None:
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"aggregator" in cmd and state.encode() in cmd:
                return int(p.name)
    return None


class Sampler(threading.Thread):
    def __init__(self, state: str):
        super().__init__(daemon=True)
        self.state, self.samples, self.stop = state, [], threading.Event()

    def run(self) -> None:
        pid = None
        while not self.stop.is_set():
            pid = pid or _root_pid(self.state)
            rss = _rss_mb(pid) if pid else None
            if rss is not None:
                self.samples.append((time.time(), rss))
            time.sleep(0.02)


def phases(log: Path, samples: list[tuple[float, float]]) -> list[tuple[str, float]]:
    """(the root's log message that opened the phase, the peak RSS sampled in it)."""
    marks = [(0.0, "start")]
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            ts = rec["ts"]
            t = time.mktime(time.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone + float(ts[19:-1] or 0)
            marks.append((t, rec.get("msg", "")[:90]))
    out = []
    for (t0, msg), (t1, _) in zip(marks, marks[1:] + [(float("inf"), "")]):
        inside = [r for t, r in samples if t0 <= t < t1]
        if inside:
            out.append((msg, max(inside)))
    return out


def metrics(record: dict) -> dict[str, Metric]:
    """The root's fixed memory over the unit P (the figure the levers moved), its VmHWM, and the round."""
    return {"fixed / unit": record["fixed_over_unit"], "VmHWM (MB)": record["vmhwm_mb"], "close (s)": record["close_s"],
            "lost": record["lost"]}


def main() -> None:
    ap = BenchParser(__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--root-args", default="", help="more flags for the root, e.g. '--decode-slots 1'")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-fixed-memory")
    args = ap.parse_args()
    idle, unit = scale.idle_rss(), 4 * scale.block_params(scale.UNIT_SHAPE) / MB
    if args.root_args:
        command = scale.root_command
        scale.root_command = lambda *a, **k: [*command(*a, **k), *args.root_args.split()]
    for k in range(args.runs):
        out = args.work / f"run-{k}"
        sampler = Sampler(str(out / "root"))
        sampler.start()
        row = scale.run_row(scale.UNIT_SHAPE, scale.UNIT_N, "flat", out, rounds=2, deadline=300.0)
        sampler.stop.set()
        sampler.join()
        print(f"[fixed-memory] {args.label} run {k}: idle {idle:.0f} MB, P {unit:.0f} MiB")
        for msg, peak in phases(out / "root.log", sampler.samples):
            print(f"  {peak:7.0f} MB {(peak - idle) / unit:5.2f} P  after: {msg}")
        record = {"label": args.label, "root_args": args.root_args, "idle_mb": idle, "unit_mb": unit, "vmhwm_mb": row["root_peak_rss_mb"],
                  "fixed_over_unit": (row["root_peak_rss_mb"] - idle) / unit, "lost": row["lost"],
                  "close_s": row["close_s"], "phases": [{"after": m, "peak_mb": p} for m, p in phases(out / "root.log",
                                                                                                  sampler.samples)]}
        publish("fixed-memory", record, metrics(record),
                out=result_path("fixed-memory", slug(args.root_args) if args.root_args else "default"))
        print(f"[fixed-memory] {args.label} VmHWM {row['root_peak_rss_mb']:.0f} MB → fixed "
              f"{(row['root_peak_rss_mb'] - idle) / unit:.2f} P; lost {row['lost']}, close {row['close_s']}", flush=True)


if __name__ == "__main__":
    main()
