"""The benchmark record: one `Run` (a frozen, versioned shape shared by every bench) and its file,
bench/results/<bench>/<setting>.json, which a run is appended to and which is validated on every read."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = 1  # bump when a field is added, renamed or changes meaning; `load` refuses other versions
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
UNKNOWN = "unknown"  # a migrated run whose code, date or command no earlier file named: never guessed
NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")  # bench and setting names: they are file and folder names

Metric = float | int | str | bool | None
METRIC_TYPES = (float, int, str, bool, type(None))


class RecordError(ValueError):
    """A record file that is not a list of runs of the current schema, or a run that is malformed."""


@dataclass(frozen=True)
class Run:
    """One run of one bench in one setting. `metrics` are the headline numbers BENCHMARKS.md shows
    (name → value, the name carrying its unit); `detail` is everything else the bench measured, kept
    for plots, tests and later reading but never rendered."""

    bench: str
    setting: str  # which variant of the bench ran ("default", "d256", "relays"): runs compare within one
    code: str  # the commit measured ("abc1234", "+dirty" when the tree had edits), or "unknown"
    machine: str  # the host in words: architecture, cores, torch where it matters
    date: str  # UTC, "YYYY-MM-DD HH:MM" (or a day alone, or "unknown" for a migrated run)
    command: str  # what a user types to repeat it, or "unknown"
    metrics: dict[str, Metric]
    detail: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA

    def __post_init__(self) -> None:
        problems = [f"{name} {value!r} is not a name ([a-z0-9._-])" for name, value in
                    (("bench", self.bench), ("setting", self.setting)) if not NAME.fullmatch(str(value))]
        problems += [f"{name} is not a non-empty string" for name in ("code", "machine", "date", "command")
                     if not isinstance(getattr(self, name), str) or not getattr(self, name)]
        if not isinstance(self.metrics, dict) or not self.metrics:
            problems.append("metrics is not a non-empty object")
        else:
            problems += [f"metric {k!r} is {type(v).__name__}, not a number, string or bool"
                         for k, v in self.metrics.items() if not isinstance(v, METRIC_TYPES)]
        if not isinstance(self.detail, dict):
            problems.append("detail is not an object")
        if self.schema != SCHEMA:
            problems.append(f"schema {self.schema!r}, this code reads {SCHEMA}")
        if problems:
            raise RecordError(f"run of {self.bench}/{self.setting}: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, raw: object) -> Run:
        """A run read back from JSON: exactly the fields of `Run`, each checked."""
        if not isinstance(raw, dict):
            raise RecordError(f"a run is an object, not {type(raw).__name__}")
        names = {f for f in cls.__dataclass_fields__}
        if set(raw) - names or {"bench", "setting", "code", "machine", "date", "command", "metrics"} - set(raw):
            raise RecordError(f"run fields {sorted(raw)}; expected {sorted(names)}")
        return cls(**raw)


def slug(text: str) -> str:
    """A free-text label ("tcache off (GLIBC_TUNABLES=…)") as a setting name: lower case, runs of other
    characters as one hyphen."""
    return re.sub(r"[^a-z0-9._]+", "-", text.lower()).strip("-.") or "default"


def path_of(bench: str, setting: str = "default", *, results: Path | None = None) -> Path:
    """Where the runs of `bench` in `setting` live."""
    return (results or RESULTS) / bench / f"{setting}.json"


def filed(run: Run, path: Path) -> bool:
    """A run belongs in <bench>/<setting>.json, or in a folder inside its bench's (<bench>/<aside>/<setting>.json:
    runs kept beside the rendered record, e.g. bench/results/levers/equal-time/)."""
    return path.stem == run.setting and run.bench in (path.parent.name, path.parent.parent.name)


def load(path: Path) -> list[Run]:
    """Every run in a record file, oldest first, each validated, and all of the file's bench and setting
    (the folder and file name): a file that fails is an error, never skipped."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RecordError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(raw, list) or not raw:
        raise RecordError(f"{path}: a record is a non-empty list of runs")
    runs = []
    for i, item in enumerate(raw):
        try:
            run = Run.from_dict(item)
        except (RecordError, TypeError) as exc:
            raise RecordError(f"{path}, run {i}: {exc}") from exc
        if not filed(run, path):
            raise RecordError(f"{path}, run {i}: {run.bench}/{run.setting} filed under {path.parent.name}/{path.stem}")
        runs.append(run)
    return runs


def load_all(results: Path | None = None) -> dict[str, dict[str, list[Run]]]:
    """bench → setting → its runs, for every record under `results` (the committed ones by default;
    a gitignored quick.json is a smoke run and never part of the record)."""
    found: dict[str, dict[str, list[Run]]] = {}
    for path in sorted((results or RESULTS).glob("*/*.json")):
        if path.stem != "quick":
            found.setdefault(path.parent.name, {})[path.stem] = load(path)
    return found


def append(run: Run, path: Path) -> Path:
    """Add `run` to the end of its record file: the new list is written beside the old file, flushed to
    disk and renamed over it, so that a crash leaves the old record or the new one, never half of one."""
    if not filed(run, path):
        raise RecordError(f"{run.bench}/{run.setting} would be filed under {path.parent.name}/{path.stem}")
    runs = load(path) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        f.write(json.dumps([asdict(r) for r in [*runs, run]], indent=1, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return path


def code() -> str:
    """The commit this tree is at, short, with "+dirty" when tracked files differ from it. The record
    itself (bench/results, BENCHMARKS.md) does not count: a bench run after another in the same tree
    measures the same code."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short=7", "HEAD") or UNKNOWN
    return head + ("+dirty" if head != UNKNOWN and git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                                           ":!bench/results", ":!BENCHMARKS.md") else "")


def machine() -> str:
    """This host in words: CPU model, architecture and the cores this process may use."""
    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
                 platform.processor() or "cpu")
    return f"{model}, {platform.machine()}, {len(os.sched_getaffinity(0))} cores"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime())
