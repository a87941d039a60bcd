"""The docs cannot drift from the code and the measurements: every `btnode …` and `make …` line in the
README is checked against the real CLI's `--help` and the Makefile, the README's headline table is held to
the benchmark record (bench/results; BENCHMARKS.md is generated from it and checked by
tests/unit/test_bench_report.py), every relative link resolves, and each doc stays within its word
budget."""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULTS = ROOT / "bench" / "results"


# ---------------------------------------------------------------- commands shown in the README

def code_lines(text: str) -> list[str]:
    """The logical lines of every fenced code block (backslash continuations joined)."""
    lines: list[str] = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
        lines.extend(line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip())
    return lines


def commands(program: str) -> list[list[str]]:
    """README code lines that run `program` (a bare name or a path ending in it), as argv after it."""
    found = []
    for line in code_lines(README.read_text()):
        try:
            argv = shlex.split(line, comments=True)
        except ValueError:
            continue
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):  # VAR=value before the program
            argv = argv[1:]
        if argv and Path(argv[0]).name == program:
            found.append(argv[1:])
    return found


@cache
def root_command():
    """btnode's root command group (typer's own click: commands are found by name, not by type)."""
    from btnode_cli import main

    if not main.app.registered_commands:
        main._register()
    return typer.main.get_command(main.app)


@cache
def help_text(*args: str) -> str:
    from btnode_cli import main

    result = CliRunner().invoke(main.app, [*args, "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert result.exit_code == 0, f"btnode {' '.join(args)} --help failed: {result.output}"
    return result.output


def split_btnode(argv: list[str]) -> tuple[list[str], list[str]]:
    """btnode's argv → (the command path, e.g. ['config', 'show'], the --flags its own options use)."""
    group = root_command()
    path: list[str] = []
    rest = list(argv)
    while getattr(group, "commands", None) is not None:  # a group: options, then a subcommand
        while rest and rest[0].startswith("-"):
            name = rest.pop(0)
            param = next((p for p in group.params if name.split("=", 1)[0] in p.opts), None)
            assert param is not None, f"`btnode {shlex.join(argv)}`: unknown option {name} before the command"
            if not getattr(param, "is_flag", False) and "=" not in name and rest:
                rest.pop(0)  # its value
        assert rest, f"`btnode {shlex.join(argv)}` names no command"
        sub = group.commands.get(rest[0])
        assert sub is not None, f"`btnode {shlex.join(argv)}`: no command {rest[0]!r} under btnode {' '.join(path)}"
        path.append(rest.pop(0))
        group = sub
    flags = []
    for token in rest:
        if token == "--":  # what follows is another command line (config show join -- ...)
            break
        if token.startswith("--"):
            flags.append(token.split("=", 1)[0])
    return path, flags


def test_the_readme_shows_btnode_commands():
    assert len(commands("btnode")) >= 8


@pytest.mark.parametrize("argv", commands("btnode"), ids=shlex.join)
def test_every_btnode_command_in_the_readme_exists_with_its_flags(argv):
    path, flags = split_btnode(argv)
    if path == ["join"]:  # each role's help lists the options that role uses
        path = ["join", "--role", argv[argv.index("--role") + 1]]
    shown = help_text(*path)
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", shown)]
    assert not missing, f"`btnode {shlex.join(argv)}`: {missing} not in `btnode {' '.join(path)} --help`"


def test_every_make_target_in_the_readme_exists():
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), flags=re.M))
    shown = [t for argv in commands("make") for t in argv if not t.startswith("-") and "=" not in t]
    assert {"demo", "test"} <= set(shown)
    assert set(shown) <= targets, f"not Makefile targets: {set(shown) - targets}"


# ---------------------------------------------------------------- numbers held to the result JSONs

@cache
def result(name: str) -> dict:
    """The newest recorded run's detail of the bench NAME names ("serving.json": bench/results/serving/default.json;
    "quality.json:default-linux-doc": bench/results/quality/default-linux-doc.json)."""
    bench, _, setting = name.partition(":")
    return json.loads((RESULTS / bench.removesuffix(".json") / f"{setting or 'default'}.json").read_text())[-1]["detail"]


def at(name: str, *path: str | int) -> float:
    """The value at bench/results/NAME → path (dict keys or list indices)."""
    value = result(name)
    for key in path:
        value = value[key]
    return value


def f(places: int) -> Callable[[float], str]:
    """A value as a table shows it: `places` decimals, thousands separated by commas."""
    return lambda x: f"{x:,.{places}f}"


f0, f1, f2, f3 = f(0), f(1), f(2), f(3)


def pct(x: float) -> str:
    return f1(100 * x)


def mb(x: float) -> str:
    return f2(x / 1e6)


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after the heading line `heading`, header row excluded."""
    after = text.split(f"\n{heading}\n", 1)
    assert len(after) == 2, f"no heading {heading!r}"
    lines = [line for line in after[1].lstrip("\n").splitlines()]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            if rows:
                break
            continue
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert len(rows) > 2, f"no table under {heading!r}"
    return rows[2:]


# a number standing alone: not the 8 of "int8", "SCE-8" or "K=8"
NUMBER = re.compile(r"(?<![\w.=\-])[-−]?\d[\d,]*(?:\.\d+)?")


def label(cell: str) -> str:
    """A row's first cell without its link target: `[text](target)` → text."""
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cell)


def check_table(rows: list[list[str]], expected: dict[str, list[tuple[Callable[[float], str], float]]],
                value_columns: slice) -> None:
    """Every row is named in `expected`, and the numbers in its value columns are exactly the JSON values
    named for it, at the rounding shown."""
    seen = set()
    for row in rows:
        name = label(row[0])
        assert name in expected, f"row {name!r} is not held to a result JSON (add it to the test)"
        seen.add(name)
        shown = Counter(n.replace("−", "-") for cell in row[value_columns] for n in NUMBER.findall(cell))
        want = Counter(fmt(value) for fmt, value in expected[name])
        assert shown == want, f"row {name!r}: shows {sorted(shown.elements())}, the JSONs say {sorted(want.elements())}"
    assert seen == set(expected), f"rows the test expects but the table lacks: {set(expected) - seen}"


def readme_expected() -> dict[str, list[tuple[Callable[[float], str], float]]]:
    wan = ("serving.json", "links", "wan")
    judged = ("serving.json", "quality_t1")
    full = ("memory.json", "sizes", -1)
    linux = "quality.json:default-linux-doc"
    return {
        "Held-out nats/byte, 900 s per block; AR-6, AR-2: 900 s":
            [(f3, at("quality.json", "sce8_k1_deployed")), (f3, at("quality.json", "ar_total_ce_deployed")),
             (f3, at("quality.json", "ar_block_ce_deployed"))],
        "Same, equal total compute: 300 s per block":
            [(f3, at("quality.json", "sce8_k1")), (f3, at("quality.json", "ar_total_ce"))],
        "Held-out nats/byte, 24 MB of Linux docs, 900 s per worker; AR-6, AR-2":
            [(f3, at(linux, "sce8_k1_deployed")), (f3, at(linux, "ar_total_ce_deployed")),
             (f3, at(linux, "ar_block_ce_deployed"))],
        "Bytes/s served over an emulated WAN; AR plain and speculative":
            [(f1, at(*wan, "blockwise K=16 spec", "bytes_per_s")), (f1, at(*wan, "AR plain", "bytes_per_s")),
             (f1, at(*wan, "AR speculative G=8", "bytes_per_s"))],
        "Judge CE of the served text (real text)":
            [(f3, at(*judged, "blockwise K=16 spec", "judge_ce")), (f3, at(*judged, "AR plain", "judge_ce")),
             (f3, at("serving.json", "judge_ce_real"))],
        "Held-out nats/byte, 6 workers, 480 s over a WAN; DiLoCo AR-6":
            [(f3, at("diloco.json", "blocktrain_ce")), (f3, at("diloco.json", "diloco_ce"))],
        "MB per worker-round, same runs":
            [(mb, at("diloco.json", "blocktrain_bytes_per_worker_round")),
             (mb, at("diloco.json", "diloco_bytes_per_worker_round"))],
        "Peak RSS per worker (MB), d = 1792; full AR-8 replica":
            [(f0, at(*full, "block_rss_mb")), (f0, at(*full, "full_rss_mb"))],
    }


def test_the_readme_headline_table_equals_the_result_jsons():
    check_table(table_rows(README.read_text(), "## Results"), readme_expected(), slice(1, 3))


# ---------------------------------------------------------------- links

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return ({slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}
            | set(re.findall(r'<a id="([^"]+)"></a>', text)))


LINKED = [README, BENCHMARKS, ROOT / "CHANGELOG.md", *DOCS]


@pytest.mark.parametrize("doc", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_that_exists(doc):
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, fragment = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(target)
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: broken links {broken}"


# ---------------------------------------------------------------- word budgets

# Words (as `wc -w` counts them) each manual in docs/ may hold, set near its size when it was last
# made a manual. A doc that outgrows its budget is usually growing a diary: dated runs belong in
# BENCHMARKS.md and what was tried in docs/research.md. Raise a budget only for new manual text.
BUDGETS = {
    "architecture.md": 1_500,
    "data.md": 1_300,
    "design.md": 3_700,
    "identities.md": 1_000,
    "judge.md": 750,
    "model.md": 1_700,
    "operations.md": 2_600,
    "relays.md": 2_400,
    "research.md": 4_500,
    "scale.md": 2_250,
    "security.md": 5_000,
    "serving.md": 3_500,
    "swarm.md": 3_600,
    "tuning.md": 1_745,  # + the density warm-up (issue #40)
    "verification.md": 1_500,
    "wire.md": 720,
}
README_BUDGET = 1_200  # the front door: what btnode is, two commands, a tour


def words(path: Path) -> int:
    return len(path.read_text().split())


def test_every_doc_has_a_word_budget():
    unbudgeted = sorted(p.name for p in DOCS if p.name not in BUDGETS)
    assert not unbudgeted, f"docs without a word budget (add them to BUDGETS): {unbudgeted}"


@pytest.mark.parametrize("doc", [p for p in DOCS if p.name in BUDGETS], ids=lambda p: p.name)
def test_each_doc_is_within_its_word_budget(doc):
    assert words(doc) <= BUDGETS[doc.name], f"docs/{doc.name}: {words(doc):,} words, budget {BUDGETS[doc.name]:,}"


def test_the_readme_is_within_its_word_budget():
    assert words(README) <= README_BUDGET, f"README.md: {words(README):,} words, budget {README_BUDGET:,}"
