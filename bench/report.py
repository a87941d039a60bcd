"""Shared by the benchmarks: run a command while measuring its wall time and peak RSS, and
replace one marked section of BENCHMARKS.md so that benchmarks never overwrite each other."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "bench" / "results"
# The model shape the swarm benchmarks train (the project's default), and the tiny one of --quick runs
SHAPE = ["--d-model", "128", "--heads", "4", "--layers", "2", "--blocks", "3", "--context", "128", "--segments", "1,16"]
QUICK_SHAPE = ["--d-model", "32", "--heads", "2", "--layers", "1", "--blocks", "3", "--context", "32", "--segments", "1,8"]
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


def shown(cmd: list[str]) -> str:
    """The command as a user would paste it: venv binaries by name, paths relative to the repo."""
    def one(arg: str) -> str:
        if Path(arg).name in ("btnode", "python", "python3") and "/bin/" in arg:
            return Path(arg).name
        return arg.replace(str(ROOT) + "/", "")

    return shlex.join([one(c) for c in cmd])


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


def update_section(name: str, markdown: str) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else HEADER
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS.write_text(text)


class Progress:
    """A live "done/total, rate, ETA" line for long benchmark loops on a terminal; silent when stderr
    is not one (a log file), where the benchmark's own result lines are what matters."""

    def __init__(self, total: int, label: str, unit: str = "cases"):
        import sys

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
