"""What every benchmark shares at its edges: run a command measuring its wall time and peak RSS, show a
command as a user would type it, render a Markdown table, and `publish` a result (its JSON, and its
section of BENCHMARKS.md between that section's markers, so that benchmarks never overwrite each other)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "bench" / "results"
HEADER = "# Benchmarks\n\nEvery row names the command that produced it. Machine: see each section.\n"


@dataclass(frozen=True)
class Measured:
    wall_s: float
    max_rss_mb: float
    stdout: str


def measure(cmd: list[str]) -> Measured:
    """Run cmd to completion; peak RSS comes from wait4 on that child alone."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
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


def result_path(section: str, *, quick: bool = False, results: Path | None = None) -> Path:
    """Where a section's result JSON lives: bench/results/<section>.json ('-' written '_'), or
    <section>_quick.json for a smoke run (ignored by git)."""
    return (results or RESULTS) / f"{section.replace('-', '_')}{'_quick' if quick else ''}.json"


def publish(section: str, result: dict, render: Callable[[dict], str] | None = None, *, out: Path | None = None,
            results: Path | None = None, benchmarks: Path | None = None) -> Path:
    """Write `result` as JSON to `out` (default: the section's result path) and, when `render` is
    given and `out` is that default, splice render(result) into BENCHMARKS.md between
    `<!-- SECTION:begin -->` and `<!-- SECTION:end -->`, leaving every other byte of the file as it
    was. A result written anywhere else (a --quick run, a scratch --out) never touches BENCHMARKS.md:
    a published table is always the default command's. Returns the JSON's path."""
    out = out or result_path(section, results=results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if render is not None and is_published(section, out, results=results):
        update_section(section, render(result), benchmarks=benchmarks)
    return out


def is_published(section: str, out: Path, *, results: Path | None = None) -> bool:
    """Whether a result written to `out` is the section's published one (its table in BENCHMARKS.md;
    a bench draws its plots for BENCHMARKS.md only then)."""
    return out.resolve() == result_path(section, results=results).resolve()


def update_section(name: str, markdown: str, *, benchmarks: Path | None = None) -> None:
    """Replace the marked section `name` of BENCHMARKS.md (appended at the end when it has none)."""
    path = benchmarks or BENCHMARKS
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else HEADER
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


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
