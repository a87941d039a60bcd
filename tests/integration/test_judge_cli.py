"""`btnode judge` as a real process: scores a samples file and the reference with a tiny judge, dumps
the fixed prompts, and refuses bad input with one `error:` line and a non-zero exit code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from procs import TINY_TRAIN, cli_fails, run_cli

TINY = TINY_TRAIN
run = run_cli


def fails(*args: str, match: str) -> None:
    assert match in cli_fails(*args, match=match)  # the message is the last line itself


@pytest.fixture(scope="module")
def judge_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("judge") / "ar"
    run("train-ar", "--out", str(out), "--steps", "3", "--ar-layers", "1", *TINY)
    return out


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_judge_scores_samples_and_reference(judge_ckpt, tmp_path):
    samples = write_lines(tmp_path / "s.jsonl", [
        json.dumps({"prompt": "The history of", "continuation": " the the the the the", "mode": "ar"}),
        "",  # blank lines are skipped
        json.dumps({"prompt": "Caf\u00e9 \u00ff", "continuation": "ab\u0000cdefgh", "mode": "blockwise"}),
    ])
    out = tmp_path / "judge.json"
    p = run("judge", str(samples), "--checkpoint", str(judge_ckpt), "--reference", "--json", str(out))
    assert "judge CE" in p.stdout and "reference" in p.stdout
    res = json.loads(out.read_text())
    assert res["encoding"] == "latin-1" and res["word_list"] and res["judge"]["context"] == 32
    s, r = res["samples"], res["reference"]
    assert s["n_samples"] == 2 and s["n_bytes"] == 20 + 9 and [x["line"] for x in s["samples"]] == [1, 3]
    assert [x["mode"] for x in s["samples"]] == ["ar", "blockwise"]
    assert s["samples"][0]["distinct4"] == pytest.approx(4 / 17)  # " the" repeated: 4 distinct of 17
    assert r["n_samples"] == 32 and r["n_bytes"] == 32 * 256 and r["stride"] == 16
    for row in (s, r):
        assert 0 < row["judge_ce"] < 10 and math.isfinite(row["judge_ce"])
    assert s["judge_ce"] == pytest.approx(sum(x["judge_ce"] * x["n_bytes"] for x in s["samples"]) / 29)


def test_prompts_out_needs_no_checkpoint(tmp_path):
    out = tmp_path / "prompts.jsonl"
    run("judge", "--prompts-out", str(out), "--checkpoint", str(tmp_path / "absent"))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 32 and [r["index"] for r in rows] == list(range(32))
    assert all(len(r["prompt"].encode("latin-1")) == 64 and len(r["reference"].encode("latin-1")) == 256 for r in rows)


def test_bad_input_is_one_clear_line(judge_ckpt, tmp_path):
    good = json.dumps({"prompt": "ab", "continuation": "cd"})
    broken = write_lines(tmp_path / "broken.jsonl", [good, '{"prompt": "ab", "continuation": '])
    fails("judge", str(broken), "--checkpoint", str(judge_ckpt), match="line 2 is not JSON")
    wide = write_lines(tmp_path / "wide.jsonl", [json.dumps({"prompt": "ab", "continuation": "\u20ac"})])
    fails("judge", str(wide), "--checkpoint", str(judge_ckpt), match="above U+00FF")
    missing_key = write_lines(tmp_path / "key.jsonl", [json.dumps({"prompt": "ab"})])
    fails("judge", str(missing_key), "--checkpoint", str(judge_ckpt), match="'continuation' must be a non-empty")
    fails("judge", str(tmp_path / "nope.jsonl"), "--checkpoint", str(judge_ckpt), match="does not exist")
    ok = write_lines(tmp_path / "ok.jsonl", [good])
    fails("judge", str(ok), "--checkpoint", str(tmp_path / "absent"), match="does not exist")
    blocks = tmp_path / "blocks"
    blocks.mkdir()
    (blocks / "block-0.json").write_text("{}")
    fails("judge", str(ok), "--checkpoint", str(blocks), match="must be an autoregressive checkpoint")
    fails("judge", match="nothing to do")
