"""The benchmarks' shared edges: `publish` (the result JSON and its one section of BENCHMARKS.md),
the Markdown table renderer, and the shared argument parser's model shape."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from bench.flags import QUICK_SHAPE, SHAPE, BenchParser, shape_flags
from bench.report import BENCHMARKS, RESULTS, is_published, publish, result_path, table
from btnode.model.config import ModelConfig

MARKER = re.compile(r"<!-- ([a-z-]+):(begin|end) -->")


def render(res: dict) -> str:
    return "\n".join(["## A section", "", *table(["what", "value"], [("x", res["x"])], "lr")])


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the real BENCHMARKS.md and an empty results folder."""
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_bytes(BENCHMARKS.read_bytes())
    return bench, tmp_path / "results"


def test_publish_writes_the_json_and_splices_exactly_its_section(files):
    bench, results = files
    before = bench.read_text()
    sections = MARKER.findall(before)
    path = publish("fuzz", {"x": 7}, render, results=results, benchmarks=bench)
    assert path == results / "fuzz.json" and json.loads(path.read_text()) == {"x": 7}
    after = bench.read_text()
    begin, end = "<!-- fuzz:begin -->\n", "\n<!-- fuzz:end -->"
    assert after[after.index(begin) + len(begin):after.index(end)] == render({"x": 7})
    # everything outside the section is byte for byte what it was, markers included
    assert after[:after.index(begin)] == before[:before.index(begin)]
    assert after[after.index(end):] == before[before.index(end):]
    assert MARKER.findall(after) == sections


def test_publish_of_a_section_with_underscores_in_its_file(files):
    bench, results = files
    publish("wan-train", {"x": 1}, render, results=results, benchmarks=bench)
    assert (results / "wan_train.json").exists() and "| x | 1 |" in bench.read_text()


def test_a_result_written_elsewhere_never_touches_benchmarks(files, tmp_path):
    bench, results = files
    before = bench.read_bytes()
    for out in (tmp_path / "scratch" / "fuzz.json", result_path("fuzz", quick=True, results=results)):
        assert publish("fuzz", {"x": 1}, render, out=out, results=results, benchmarks=bench) == out
        assert json.loads(out.read_text()) == {"x": 1}
        assert not is_published("fuzz", out, results=results)
    assert bench.read_bytes() == before
    assert is_published("fuzz", results / "fuzz.json", results=results)


def test_publish_without_a_renderer_only_writes_the_json(files):
    bench, results = files
    before = bench.read_bytes()
    publish("memory", {"x": 1}, None, results=results, benchmarks=bench)
    assert bench.read_bytes() == before and (results / "memory.json").exists()


def test_a_new_section_is_appended(tmp_path):
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text("# Benchmarks\n\nprose\n")
    publish("new-one", {"x": 2}, render, results=tmp_path, benchmarks=bench)
    assert bench.read_text() == f"# Benchmarks\n\nprose\n\n<!-- new-one:begin -->\n{render({'x': 2})}\n<!-- new-one:end -->\n"


def test_table_renders_header_alignment_and_rows():
    assert table(["mode", "bytes/s", "note"], [("AR", "10.5", ""), ("spec", 45.9, "`cmd`")], "lr") == [
        "| mode | bytes/s | note |",
        "| --- | ---: | --- |",
        "| AR | 10.5 |  |",
        "| spec | 45.9 | `cmd` |",
    ]
    assert table(["a"], []) == ["| a |", "| --- |"]


def test_shape_flags_are_the_commands_users_type():
    # the shapes the benchmarks always passed, flag for flag: defaults (--target-seed 0, ...) left out
    assert shape_flags(SHAPE) == ["--d-model", "128", "--heads", "4", "--layers", "2", "--blocks", "3",
                                  "--context", "128", "--segments", "1,16"]
    assert shape_flags(QUICK_SHAPE) == ["--d-model", "32", "--heads", "2", "--layers", "1", "--blocks", "3",
                                        "--context", "32", "--segments", "1,8"]
    ar = ModelConfig(kind="ar", ar_layers=6, ada_rank=16)
    tail = shape_flags(ar)[12:]  # the flags past the block shape's, in to_flags()'s order
    assert dict(zip(tail[::2], tail[1::2])) == {"--ada-rank": "16", "--model": "ar", "--ar-layers": "6"}


FIELDS = ("d_model", "n_heads", "n_layers", "n_blocks", "context", "segments", "ada_rank")


@pytest.mark.parametrize("cfg", [ModelConfig(), QUICK_SHAPE,
                                 ModelConfig(d_model=64, n_heads=2, n_layers=1, n_blocks=4, context=64,
                                             segments=(1, 8, 16), ada_rank=8)])
def test_the_shared_parser_round_trips_a_shape(cfg):
    ap = BenchParser("doc")
    ap.shape(ModelConfig(d_model=64, context=64), *FIELDS)
    assert ap.parse_args(shape_flags(cfg)).shape == cfg
    assert ap.parse_args([]).shape == ModelConfig(d_model=64, context=64)


def test_quick_replaces_values_and_the_result_path():
    ap = BenchParser("doc")
    ap.result("async")
    ap.rounds(rounds=30)
    ap.shape(SHAPE)
    ap.quick(rounds=3, shape=QUICK_SHAPE)
    full, quick = ap.parse_args([]), ap.parse_args(["--quick", "--rounds", "9"])
    assert (full.rounds, full.shape, full.results) == (30, SHAPE, RESULTS / "async.json")
    assert (quick.rounds, quick.shape, quick.results) == (3, QUICK_SHAPE, RESULTS / "async_quick.json")
    assert ap.parse_args(["--out", "/tmp/x.json"]).results == Path("/tmp/x.json")


# every bench whose table comes from its result JSON renders the stored results (bench/results)
RENDERED = ("async", "commit", "fuzz", "judge", "memory", "serving", "soak", "spec_accept", "throughput", "transport", "wan_train")


@pytest.mark.parametrize("module", RENDERED)
def test_every_bench_renders_its_stored_result(module):
    res = json.loads((RESULTS / f"{module}.json").read_text())
    if module == "async":  # stored before the result kept its batch and windows
        res = {"batch": 16, "windows": 128, **res}
    md = importlib.import_module(f"bench.{module}").render(res)
    assert md.startswith("## ") and "| --- |" in md.replace("---:", "---")
