"""The benchmark record and its report: a run appended to its bench's record (fsync'd, validated on read),
BENCHMARKS.md generated from the records and held to them (`python -m bench.report --check`), the Markdown
table renderer, and the shared argument parser's model shape and record path."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from bench import report
from bench.flags import QUICK_SHAPE, SHAPE, BenchParser, shape_flags
from bench.report import BENCHMARKS, RESULTS, NoteTooLong, check, generate, is_published, publish, result_path, table, write
from bench.runs import SCHEMA, RecordError, Run, append, load, load_all, slug
from btnode.model.config import ModelConfig


def run(setting: str = "default", code: str = "aaaaaaa", **metrics: float) -> Run:
    return Run(bench="toy", setting=setting, code=code, machine="test box", date="2026-12-06 10:00",
               command="python -m bench.toy", metrics=metrics or {"ce": 1.5}, detail={"rows": [1, 2]})


def test_a_run_round_trips_through_its_record(tmp_path):
    path = tmp_path / "toy" / "default.json"
    first, second = run(ce=2.0), run(code="bbbbbbb", ce=1.5)
    append(first, path)
    append(second, path)
    assert load(path) == [first, second]
    assert json.loads(path.read_text())[0]["schema"] == SCHEMA
    assert not list(path.parent.glob(".*tmp*"))  # the write went through a temporary file, renamed over


@pytest.mark.parametrize("bad", [
    {"schema": SCHEMA + 1},  # a record written by other code
    {"metrics": {}},  # a run with nothing to show
    {"metrics": {"ce": [1, 2]}},  # a metric that is not a number, string or bool
    {"code": ""},
    {"setting": "Has Spaces"},
])
def test_load_refuses_a_malformed_run(tmp_path, bad):
    path = tmp_path / "toy" / "default.json"
    append(run(), path)
    raw = json.loads(path.read_text())
    raw[0].update(bad)
    path.write_text(json.dumps(raw))
    with pytest.raises(RecordError):
        load(path)


def test_load_refuses_a_run_filed_under_another_setting_or_unknown_fields(tmp_path):
    path = tmp_path / "toy" / "default.json"
    append(run(), path)
    moved = tmp_path / "toy" / "other.json"
    moved.write_text(path.read_text())
    with pytest.raises(RecordError, match="filed under"):
        load(moved)
    raw = json.loads(path.read_text())
    raw[0]["extra"] = 1
    path.write_text(json.dumps(raw))
    with pytest.raises(RecordError, match="fields"):
        load(path)
    with pytest.raises(RecordError, match="would be filed"):
        append(run("other"), tmp_path / "toy" / "default.json")


def test_a_run_may_be_kept_in_a_folder_inside_its_bench_and_is_not_rendered(tmp_path):
    aside = tmp_path / "toy" / "aside" / "default.json"
    append(run(), aside)
    assert [r.setting for r in load(aside)] == ["default"]
    assert load_all(tmp_path) == {}  # only <bench>/<setting>.json is the rendered record
    with pytest.raises(RecordError, match="would be filed"):
        append(run(), tmp_path / "other" / "aside" / "default.json")


def test_publish_appends_a_run_with_its_provenance_and_regenerates_benchmarks(tmp_path):
    results, bench = tmp_path / "results", tmp_path / "BENCHMARKS.md"
    out = publish("toy", {"x": 7}, {"x (units)": 7}, out=result_path("toy", results=results), results=results,
                  benchmarks=bench)
    assert out == results / "toy" / "default.json"
    (new,) = load(out)
    assert (new.bench, new.setting, new.metrics, new.detail) == ("toy", "default", {"x (units)": 7}, {"x": 7})
    assert new.code and new.machine and new.date and new.command
    assert bench.read_text() == generate(results=results, notes=tmp_path / "notes")


def test_a_quick_run_or_a_scratch_folder_never_touches_benchmarks(tmp_path):
    results, bench = tmp_path / "results", tmp_path / "BENCHMARKS.md"
    quick = result_path("toy", quick=True, results=results)
    publish("toy", {}, {"x": 1}, out=quick, results=results, benchmarks=bench)
    publish("toy", {}, {"x": 1}, out=result_path("toy", results=tmp_path / "scratch"), results=results, benchmarks=bench)
    assert not bench.exists() and quick.name == "quick.json" and not is_published(quick, results=results)
    assert "toy" not in load_all(results)  # a quick run is never part of the record


def test_the_section_shows_the_newest_run_per_setting_and_the_change_since_other_code(tmp_path):
    results = tmp_path / "results"
    for r in (run(code="aaaaaaa", ce=2.0), run(code="bbbbbbb", ce=1.75), run(code="bbbbbbb", ce=1.5),
              run("wide", ce=3.0)):
        append(r, results / "toy" / f"{r.setting}.json")
    md = generate(results=results, notes=tmp_path / "notes")
    assert "| `default` | ce | 1.5 | 2 → 1.5 |" in md  # against the last run on other code, not the rerun
    assert "| `wide` | ce | 3 |  |" in md  # one run: nothing to compare
    assert "- `default` (3 runs): `python -m bench.toy` on `bbbbbbb`" in md and "before: `aaaaaaa`" in md
    assert "| [toy](#toy) | ce 1.5 | `default` |" in md


def test_a_note_is_rendered_and_held_to_ten_lines(tmp_path):
    results, notes = tmp_path / "results", tmp_path / "notes"
    append(run(), results / "toy" / "default.json")
    notes.mkdir()
    (notes / "toy.md").write_text("What the toy number means.\n")
    assert "What the toy number means." in generate(results=results, notes=notes)
    (notes / "toy.md").write_text("line\n" * 11)
    with pytest.raises(NoteTooLong):
        generate(results=results, notes=notes)


def test_check_fails_on_a_hand_edited_benchmarks(tmp_path):
    results, notes, bench = tmp_path / "results", tmp_path / "notes", tmp_path / "BENCHMARKS.md"
    append(run(), results / "toy" / "default.json")
    write(results=results, notes=notes, benchmarks=bench)
    assert check(results=results, notes=notes, benchmarks=bench) == []
    bench.write_text(bench.read_text().replace("| 1.5 |", "| 1.4 |"))
    diff = check(results=results, notes=notes, benchmarks=bench)
    assert "-| `default` | ce | 1.4 |  |" in diff and "+| `default` | ce | 1.5 |  |" in diff


def test_benchmarks_md_is_what_the_generator_makes():
    """`python -m bench.report --check`: regenerate with `python -m bench.report` after a bench run."""
    assert report.main(["--check"]) == 0, "\n".join(check())
    assert len(BENCHMARKS.read_text().split()) < report.WORD_BUDGET


def test_every_committed_record_loads_and_every_note_fits():
    record = load_all()
    assert {"scale", "cheats", "comms"} <= set(record)
    assert all(runs for settings in record.values() for runs in settings.values())
    for note in report.NOTES.glob("*.md"):
        assert note.stem in record, f"{note.name}: no bench of that name"
        assert len(note.read_text().splitlines()) <= report.NOTE_LINES


def test_no_commit_hash_labels_a_row():
    """History lives in the records' code field, never in a row's label."""
    rows = [line.split("|")[1].strip() for line in BENCHMARKS.read_text().splitlines() if line.startswith("| `")]
    assert rows and not [r for r in rows if __import__("re").fullmatch(r"`[0-9a-f]{7}.*`", r)]


def test_slug_makes_a_setting_name_of_a_label():
    assert slug("tcache off (GLIBC_TUNABLES=x)") == "tcache-off-glibc_tunables-x"
    assert slug("--decode-slots 1") == "decode-slots-1"


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


def test_quick_replaces_values_and_the_record_path():
    ap = BenchParser("doc")
    ap.result("async")
    ap.rounds(rounds=30)
    ap.shape(SHAPE)
    ap.quick(rounds=3, shape=QUICK_SHAPE)
    full, quick = ap.parse_args([]), ap.parse_args(["--quick", "--rounds", "9"])
    assert (full.rounds, full.shape, full.results) == (30, SHAPE, RESULTS / "async" / "default.json")
    assert (quick.rounds, quick.shape, quick.results) == (3, QUICK_SHAPE, RESULTS / "async" / "quick.json")
    assert ap.parse_args(["--out", "/tmp/r", "--setting", "wide"]).results == Path("/tmp/r/async/wide.json")


# every bench whose table comes from its result renders the newest recorded run's detail
RENDERED = {"async": "async", "commit": "commit", "fuzz": "fuzz", "judge": "judge", "memory": "memory",
            "serving": "serving", "soak": "soak", "spec_accept": "spec-accept", "throughput": "throughput",
            "transport": "transport", "wan_train": "wan-train"}


@pytest.mark.parametrize("module", RENDERED)
def test_every_bench_renders_its_recorded_result(module):
    res = dict(load(result_path(RENDERED[module]))[-1].detail)
    if module == "async":  # stored before the result kept its batch and windows
        res = {"batch": 16, "windows": 128, **res}
    md = importlib.import_module(f"bench.{module}").render(res)
    assert md.startswith("## ") and "| --- |" in md.replace("---:", "---")


@pytest.mark.parametrize("module", [*RENDERED, "api", "cheats", "codec_speed", "comms", "data", "dct_energy", "diloco",
                                    "join_memory", "quality", "replay_cost", "round_memory", "scale", "tail"])
def test_every_recorded_run_has_the_metrics_its_bench_computes(module):
    """The migrated records and the benches agree: each bench's `metrics` recomputes its newest run's."""
    bench = {"codec_speed": "codec-speed", "dct_energy": "dct-energy", "replay_cost": "replay-cost",
             "round_memory": "round-memory", "join_memory": "join-memory", **RENDERED}.get(module, module)
    setting = "flat" if bench == "scale" else "default"
    new = load(result_path(bench, setting))[-1]
    assert importlib.import_module(f"bench.{module}").metrics(dict(new.detail)) == new.metrics
