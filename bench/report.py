"""What every benchmark shares at its edges: run a command measuring its wall time and peak RSS, show a
command as a user would type it, render a Markdown table, `publish` a run (appended to the bench's record,
bench/runs.py), and `python -m bench.report [--check]`: BENCHMARKS.md generated from those records."""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.runs import RESULTS, ROOT, Metric, Run, append, code, load, load_all, machine, now, path_of

BENCHMARKS = ROOT / "BENCHMARKS.md"
NOTES = ROOT / "bench" / "notes"
NOTE_LINES = 10  # a bench's hand-written note: what the numbers mean, not a diary (that is docs/research.md)
WORD_BUDGET = 8_000  # BENCHMARKS.md as generated; tests/unit/test_bench_report.py holds it
HEADLINE_METRICS = 2  # how many of a run's first metrics the summary shows
PRIMARY = {"scale": "flat", "conn-memory": "none", "levers": "base"}  # the summary's setting where none is "default"
# Section order and headings (the headings' anchors are linked from docs/ and the README); a bench not
# named here follows, titled by its name.
TITLES = {
    "quality": "Quality: blockwise vs autoregressive",
    "transport": "Transport: a block on the wire",
    "serving": "Serving frontier: speed against judged text quality",
    "spec-accept": "How often the pooled blocks keep block 0's draft",
    "commit": "How the last stage commits a segment",
    "tail": "A tail below the lowest noise level",
    "judge": "The judge of generated text",
    "api": "The OpenAI-compatible API under load",
    "fuzz": "Fuzzing",
    "async": "Asynchrony: participation in the virtual async simulator",
    "wan-train": "Training over an emulated WAN",
    "diloco": "BlockTrain against DiLoCo over an emulated WAN",
    "comms": "Bytes on the wire: the sparse frontier",
    "codec-speed": "Codec speed: the largest block through each codec and one push",
    "dct-energy": "DCT energy of a block's update",
    "throughput": "Throughput against the hardware",
    "data": "Data at scale",
    "memory": "Memory at scale",
    "soak": "Soak runs",
    "cheats": "Cheats in the shipped configuration",
    "replay-cost": "What a replay audit costs",
    "round-memory": "One round's memory at the aggregator",
    "fixed-memory": "The aggregator's fixed memory in one round",
    "conn-memory": "The root's memory per connection",
    "join-memory": "What the root keeps per joined worker",
    "scale": "A swarm of a thousand",
    "levers": "Training levers on the tuning slice",
}


@dataclass(frozen=True)
class Measured:
    wall_s: float
    max_rss_mb: float
    stdout: str


def measure(cmd: list[str], threads: int | None = None) -> Measured:
    """Run cmd to completion; peak RSS comes from wait4 on that child alone. `threads`: the child's
    torch (OpenMP) threads, for children that run side by side."""
    t0 = time.perf_counter()
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code
    if code != 0:
        raise SystemExit(f"benchmark step failed ({code}): {shlex.join(cmd)}")
    return Measured(wall_s=wall, max_rss_mb=usage.ru_maxrss / 1024, stdout=out)


def module_command(module: str, *args: str) -> list[str]:
    """`python -m MODULE ARGS` with this interpreter: how a benchmark starts a copy of itself (a child
    that measures alone, a server, a client inside a network namespace). The child inherits the working
    folder and PYTHONPATH that let this process import `bench`."""
    return [sys.executable, "-m", module, *args]


def shown(cmd: list[str]) -> str:
    """The command as a user would paste it: venv binaries by name, paths relative to the repo."""
    def one(arg: str) -> str:
        if Path(arg).name in ("btnode", "python", "python3") and "/bin/" in arg:
            return Path(arg).name
        return arg.replace(str(ROOT) + "/", "")

    return shlex.join([one(c) for c in cmd])


def invoked() -> str:
    """This run's own command line as a user would paste it (`python -m bench.NAME ARGS`)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    head = ["-m", spec.name] if spec is not None else [sys.argv[0]]
    return shown([sys.executable, *head, *sys.argv[1:]])


def pyplot(tag: str):
    """matplotlib.pyplot on the file-only Agg backend, or None (with a line) when the `bench`
    extra is not installed: a benchmark still writes its numbers without it."""
    try:
        import matplotlib
    except ImportError:
        print(f"[{tag}] matplotlib missing (pip install -e '.[bench]'): no plot", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def table(head: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """A Markdown table, one string per line. `align` has a letter per column: "l" (the default for
    columns it does not reach) or "r" for a right-aligned (numeric) column."""
    align = align.ljust(len(head), "l")
    return ["| " + " | ".join(head) + " |", "| " + " | ".join("---:" if a == "r" else "---" for a in align) + " |",
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def result_path(bench: str, setting: str = "default", *, quick: bool = False, results: Path | None = None) -> Path:
    """Where a bench's runs in `setting` are recorded: bench/results/<bench>/<setting>.json, or
    <bench>/quick.json for a smoke run (ignored by git, never rendered)."""
    return path_of(bench, "quick" if quick else setting, results=results)


def publish(bench: str, result: dict[str, Any], metrics: dict[str, Metric], render: Callable[[dict], str] | None = None,
            *, out: Path | None = None, results: Path | None = None, benchmarks: Path | None = None) -> Path:
    """Append this run (its headline `metrics`, the full `result` as detail, and the code, machine, date
    and command it ran with) to its record `out` (default: the bench's default setting), print
    render(result) when given, and regenerate BENCHMARKS.md when `out` is part of the committed record
    (not a quick run, not a scratch folder). Returns the record's path."""
    out = out or result_path(bench, results=results)
    run = Run(bench=bench, setting=out.stem, code=code(), machine=machine(), date=now(), command=invoked(),
              metrics=metrics, detail=result)
    append(run, out)
    if render is not None:
        print(render(result), flush=True)
    if is_published(out, results=results):
        write(results=results, benchmarks=benchmarks)
    return out


def is_published(out: Path, *, results: Path | None = None) -> bool:
    """Whether a record at `out` is part of the committed record (BENCHMARKS.md shows it; a bench draws
    its plots for BENCHMARKS.md only then)."""
    home = (results or RESULTS).resolve()
    return out.resolve().parent.parent == home and out.stem != "quick"


def latest(out: Path) -> Run | None:
    """The newest run recorded at `out`, if any."""
    return load(out)[-1] if out.exists() else None


def previous(out: Path) -> dict[str, Any]:
    """The newest run's detail at `out`, or {}: what a bench that adds one part (a WAN pass, a lever)
    to its last result starts from."""
    run = latest(out)
    return dict(run.detail) if run else {}


# ---------------------------------------------------------------- BENCHMARKS.md from the records

class NoteTooLong(ValueError):
    """A bench's hand-written note over NOTE_LINES lines: the note says what the numbers mean; what
    was tried and when goes to docs/research.md."""


def value(v: Metric) -> str:
    """A metric as a table shows it: integers with thousands separators, other numbers to 4 significant
    digits without exponents, yes/no, and a dash for a value the run did not have."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if v is None or isinstance(v, str):
        return "—" if v is None else v
    if isinstance(v, int):
        return f"{v:,}"
    if abs(v) >= 1e4 or (v == int(v) and abs(v) >= 100):
        return f"{v:,.0f}"
    return f"{v:,.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


def before(runs: list[Run]) -> Run | None:
    """The run a change is measured against: the newest earlier run of the setting on other code."""
    new = runs[-1]
    return next((r for r in reversed(runs[:-1]) if r.code != new.code), None)


def note(bench: str, notes: Path) -> list[str]:
    path = notes / f"{bench}.md"
    if not path.exists():
        return []
    lines = path.read_text().rstrip("\n").splitlines()
    if len(lines) > NOTE_LINES:
        raise NoteTooLong(f"{path}: {len(lines)} lines, at most {NOTE_LINES}")
    return lines


def ordered(record: dict[str, dict[str, list[Run]]]) -> list[str]:
    return [*(b for b in TITLES if b in record), *sorted(b for b in record if b not in TITLES)]


def settings(runs_by_setting: dict[str, list[Run]]) -> list[str]:
    """"default" first, then the others by name."""
    return sorted(runs_by_setting, key=lambda s: (s != "default", s))


def summary(record: dict[str, dict[str, list[Run]]]) -> list[str]:
    rows = []
    for bench in ordered(record):
        setting = PRIMARY.get(bench) if PRIMARY.get(bench) in record[bench] else settings(record[bench])[0]
        new = record[bench][setting][-1]
        head = "; ".join(f"{k} {value(v)}" for k, v in list(new.metrics.items())[:HEADLINE_METRICS])
        rows.append((f"[{TITLES.get(bench, bench)}](#{bench})", head, f"`{setting}`"))
    return table(["bench", "headline", "setting"], rows)


def section(bench: str, runs_by_setting: dict[str, list[Run]], *, notes: Path, results: Path) -> list[str]:
    """A bench's section: per setting its newest run's command and provenance, its metrics, and the run
    before it on other code (before → after); then the plots and the hand-written note."""
    module = bench.replace("-", "_")
    lines = [f'<a id="{bench}"></a>', "", f"## {TITLES.get(bench, bench)} (`bench/{module}.py`)", ""]
    rows = []
    for setting in settings(runs_by_setting):
        runs = runs_by_setting[setting]
        new, old = runs[-1], before(runs)
        was = f"; before: `{old.code}`, {old.date}" if old else ""
        lines.append(f"- `{setting}` ({len(runs)} run{'s' * (len(runs) > 1)}): `{new.command}` "
                     f"on `{new.code}`, {new.date}, {new.machine}{was}")
        for k, v in new.metrics.items():
            change = f"{value(old.metrics[k])} → {value(v)}" if old and k in old.metrics else ""
            rows.append((f"`{setting}`", k, value(v), change))
    lines += ["", *table(["setting", "metric", "newest", "before → after"], rows, "llrr")]
    plots = sorted(results.glob(f"{module}*.png"))
    if plots:
        lines += ["", " ".join(f"![{p.stem}]({p.relative_to(ROOT).as_posix()})" for p in plots)]
    text = note(bench, notes)
    return [*lines, *(["", *text] if text else []), ""]


def generate(*, results: Path | None = None, notes: Path | None = None) -> str:
    """BENCHMARKS.md as the records and notes make it."""
    results, notes = results or RESULTS, notes or NOTES
    record = load_all(results)
    lines = ["# Benchmarks", "",
             "Generated by `python -m bench.report` from bench/results/<bench>/<setting>.json (every run of "
             "every bench: code, machine, date, command, metrics) and bench/notes/<bench>.md; do not edit by "
             "hand. `before → after` compares the newest run of a setting with the newest earlier run on "
             "other code. Findings and what was tried: [docs/research.md](docs/research.md).", "",
             "## Summary", "", *summary(record), ""]
    for bench in ordered(record):
        lines += section(bench, record[bench], notes=notes, results=results)
    return "\n".join(lines).rstrip() + "\n"


def write(*, results: Path | None = None, notes: Path | None = None, benchmarks: Path | None = None) -> Path:
    path = benchmarks or BENCHMARKS
    path.write_text(generate(results=results, notes=notes))
    return path


def check(*, results: Path | None = None, notes: Path | None = None, benchmarks: Path | None = None) -> list[str]:
    """The unified diff from BENCHMARKS.md to what the generator makes (empty when they agree)."""
    path = benchmarks or BENCHMARKS
    have = path.read_text() if path.exists() else ""
    want = generate(results=results, notes=notes)
    return list(difflib.unified_diff(have.splitlines(), want.splitlines(), f"{path.name} (as committed)",
                                     f"{path.name} (as generated)", lineterm=""))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 (with the diff) when BENCHMARKS.md differs from the generated one")
    args = ap.parse_args(argv)
    if not args.check:
        print(f"wrote {write().relative_to(ROOT)}")
        return 0
    diff = check()
    if diff:
        print("BENCHMARKS.md differs from what `python -m bench.report` makes (run it to regenerate):", file=sys.stderr)
        print("\n".join(diff[:80] + ([f"... {len(diff) - 80} more diff lines"] if len(diff) > 80 else [])), file=sys.stderr)
        return 1
    return 0


class Progress:
    """A live "done/total, rate, ETA" line for long benchmark loops on a terminal; silent when stderr
    is not one (a log file), where the benchmark's own result lines are what matters."""

    def __init__(self, total: int, label: str, unit: str = "cases"):
        self.total, self.label, self.unit = total, label, unit
        self.stream = sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self._shown = 0.0

    def __call__(self, done: int) -> None:
        if not self.tty:
            return
        now = time.perf_counter()
        if done < self.total and now - self._shown < 0.5:
            return
        self._shown = now
        rate = done / max(now - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        end = "\n" if done >= self.total else ""
        self.stream.write(f"\r\033[K[{self.label}] {done}/{self.total} {self.unit}, {rate:,.1f}/s, ETA {eta:,.0f} s{end}")
        self.stream.flush()


if __name__ == "__main__":
    raise SystemExit(main())
