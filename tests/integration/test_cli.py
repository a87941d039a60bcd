"""The `btnode` command, run as real processes: train, evaluate, generate, and every bad input
ending in one clear line and a non-zero exit code, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from procs import BTNODE, TINY_TRAIN, cli_fails, run_cli

TINY = TINY_TRAIN
run, fails = run_cli, cli_fails


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "blocks"
    run("train-local", "--out", str(out), "--steps", "3", *TINY)
    return out


def test_train_local_writes_one_checkpoint_per_block(trained):
    for b in range(3):
        meta = json.loads((trained / f"block-{b}.json").read_text())
        assert meta["block"] == b and meta["step"] == 3 and meta["kind"] == "block"
        assert (trained / f"block-{b}.safetensors").stat().st_size == meta["files"]["model"]["bytes"]
    assert len((trained / "train-log.jsonl").read_text().splitlines()) == 9


def test_eval_reports_sce_per_k(trained, tmp_path):
    out = tmp_path / "eval.json"
    p = run("eval", "--checkpoint", str(trained), "--windows", "4", "--seeds", "2", "--json", str(out))
    assert "K=1" in p.stdout and "K=8" in p.stdout and "SCE-2" in p.stdout
    res = json.loads(out.read_text())
    assert set(res["per_k"]) == {"1", "8"} and res["per_k"]["8"]["positions"] == 4 * 16
    assert 0 < res["per_k"]["1"]["sce2"] < 10
    # composition beside every chain number: each block alone, the best one, and the difference
    assert [a["block"] for a in res["alone"]] == [0, 1, 2] and res["readout"] == "pool"
    best = min(res["alone"], key=lambda a: a["best"])
    assert res["best_block"] == {"block": best["block"], "ce": best["best"]}
    assert all(a["best"] == min(a["noise_sce2"], a["context"]) for a in res["alone"])
    assert res["chain_minus_best_block"] == pytest.approx(res["per_k"]["1"]["sce2"] - best["best"])
    assert "its best block (block" in p.stdout
    run("eval", "--checkpoint", str(trained), "--windows", "4", "--seeds", "2", "--readout", "last", "--no-alone",
        "--json", str(out))
    last = json.loads(out.read_text())
    assert "alone" not in last and last["per_k"]["1"]["sce2"] != res["per_k"]["1"]["sce2"]
    fails("eval", "--checkpoint", str(trained), "--readout", "mean", match="--readout must be one of")
    fails("eval", "--checkpoint", str(trained), "--version", "1", match="needs an aggregator state folder")


def test_generate_prints_the_requested_bytes(trained):
    p = subprocess.run([BTNODE, "generate", "--checkpoint", str(trained), "--bytes", "20", "--segment", "8",
                        "--seed", "1", "hello"], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert len(p.stdout) == 21  # 20 bytes and a newline


def test_a_model_with_a_tail_block_trains_scores_and_generates_through_it(tmp_path):
    out = tmp_path / "tailed"
    run("train-local", "--out", str(out), "--steps", "2", "--tail-blocks", "1", "--sigma-gen", "0.2", *TINY)
    meta = json.loads((out / "block-3.json").read_text())
    assert meta["block"] == 3 and meta["model"]["tail_blocks"] == 1 and meta["model"]["sigma_gen"] == 0.2
    res = tmp_path / "eval.json"
    run("eval", "--checkpoint", str(out), "--windows", "4", "--seeds", "1", "--json", str(res))
    assert [a["block"] for a in json.loads(res.read_text())["alone"]] == [0, 1, 2]  # scoring never runs the tail
    for extra in ([], ["--tail-steps", "4"]):
        p = subprocess.run([BTNODE, "generate", "--checkpoint", str(out), "--bytes", "16", "--segment", "8",
                            "--temperature", "1", *extra, "hi"], capture_output=True, timeout=120)
        assert p.returncode == 0 and len(p.stdout) == 17, p.stderr
    fails("generate", "--checkpoint", str(out), "--segment", "8", "--tail-steps", "4", "--readout", "pool", "hi",
          match="reads its last evaluation")
    fails("generate", "--checkpoint", str(tmp_path / "none"), "--tail-steps", "4", match="does not exist")


def test_train_ar_and_eval(tmp_path):
    out = tmp_path / "ar"
    run("train-ar", "--out", str(out), "--steps", "2", "--ar-layers", "2", *TINY)
    p = run("eval", "--checkpoint", str(out), "--windows", "4")
    assert "autoregressive (2 layers): teacher-forced CE" in p.stdout


def test_bad_checkpoints(trained, tmp_path):
    fails("eval", "--checkpoint", str(tmp_path / "missing"), match="holds no btnode checkpoint")
    broken = tmp_path / "broken"
    shutil.copytree(trained, broken)
    blob = (broken / "block-1.safetensors").read_bytes()
    (broken / "block-1.safetensors").write_bytes(blob[:100])
    fails("eval", "--checkpoint", str(broken), "--windows", "2", match="block-1.safetensors is truncated")
    fails("generate", "--checkpoint", str(broken), "hi", match="truncated or corrupted")
    (broken / "block-2.json").unlink()
    shutil.copy(trained / "block-1.safetensors", broken / "block-1.safetensors")
    fails("eval", "--checkpoint", str(broken), match="block-2.json is missing")


def test_checkpoint_from_another_configuration(trained, tmp_path):
    other = tmp_path / "wide"
    wide = [a if a != "32" else "64" for a in TINY[:2]] + TINY[2:]
    run("train-local", "--out", str(other), "--steps", "1", *wide)
    mixed = tmp_path / "mixed"
    shutil.copytree(trained, mixed)
    for suffix in (".json", ".safetensors", ".optim.safetensors"):
        shutil.copy(other / f"block-2{suffix}", mixed / f"block-2{suffix}")
    fails("eval", "--checkpoint", str(mixed), match="d_model: expected 32, got 64")
    fails("train-local", "--out", str(trained), "--resume", "--steps", "4", *wide, match="d_model: expected 64, got 32")


def test_wrong_shape_checkpoint(trained, tmp_path):
    bad = tmp_path / "shape"
    shutil.copytree(trained, bad)
    from safetensors.torch import load_file, save_file
    import hashlib

    state = load_file(bad / "block-0.safetensors")
    state["head.weight"] = state["head.weight"][:, :7].contiguous()
    save_file(state, bad / "block-0.safetensors")
    meta = json.loads((bad / "block-0.json").read_text())
    blob = (bad / "block-0.safetensors").read_bytes()
    meta["files"]["model"].update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    (bad / "block-0.json").write_text(json.dumps(meta))
    fails("eval", "--checkpoint", str(bad), match="head.weight is torch.float32 (256, 7), expected torch.float32 (256, 32)")


def test_bad_data_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    fails("train-local", "--out", str(tmp_path / "o"), "--data", str(empty), *TINY, match="is empty")
    fails("train-local", "--out", str(tmp_path / "o"), "--data", str(tmp_path / "none.txt"), *TINY,
          match="does not exist")
    fails("train-local", "--out", str(tmp_path / "o"), "--data", "/proc/self/mem", *TINY, match="cannot be read")
    short = tmp_path / "short.txt"
    short.write_bytes(b"tiny")
    fails("train-local", "--out", str(tmp_path / "o"), "--data", str(short), *TINY, match="windows need at least 33")


def test_bad_requests(trained):
    fails("generate", "--checkpoint", str(trained), "--segment", "8", "x" * 26, match="at most 25 bytes")
    fails("generate", "--checkpoint", str(trained), "--segment", "4", "--readout", "pool", "hi",
          match="K=4 was not trained")  # spec, the default, drafts any K up to N/2
    fails("generate", "--checkpoint", str(trained), "--steps", "2", "hi", match="cannot visit all 3 blocks")
    fails("eval", "--checkpoint", str(trained), "--segments", "16", match="[16] were not trained")
    fails("train-local", "--out", "/tmp/x", "--segments", "8,16", match="must include K=1")
    if not __import__("torch").cuda.is_available():
        fails("generate", "--checkpoint", str(trained), "--device", "cuda", "hi", match="no CUDA GPU")
    fails("generate", "--checkpoint", str(trained), "--device", "tpu", "hi", match="unknown device")


def test_simulate_reports_ce_and_participation(tmp_path):
    out = tmp_path / "sim.json"
    p = run("simulate", "--participation", "0.5", "--rounds", "3", "--steps-per-round", "2", "--eval-windows", "8",
            "--eval-init", "--json", str(out), *TINY)
    assert "after 3 rounds: SCE-1" in p.stdout
    res = json.loads(out.read_text())
    assert res["attempts"] == 3 * 3 * 2 and 0 < res["absent"] < res["attempts"]
    assert res["ce"] > 0 and res["ce_init"] > 0
    fails("simulate", "--participation", "1.5", *TINY, match="participation")


def test_simulate_keeps_versions_that_eval_reads_back(tmp_path):
    """A learning curve from one swarm run: --keep holds every version, eval --version scores each."""
    state = tmp_path / "state"
    run("simulate", "--rounds", "3", "--steps-per-round", "2", "--eval-windows", "4", "--state-dir", str(state),
        "--keep", "10", *TINY)
    scores = {}
    for v in (1, 3):
        out = tmp_path / f"v{v}.json"
        run("eval", "--checkpoint", str(state), "--version", str(v), "--windows", "4", "--seeds", "1",
            "--segments", "1", "--no-alone", "--json", str(out))
        res = json.loads(out.read_text())
        scores[v] = res["per_k"]["1"]["sce1"]
        assert res["version"] == v
    assert scores[1] != scores[3]  # two different models were read
    newest = tmp_path / "newest.json"
    run("eval", "--checkpoint", str(state), "--windows", "4", "--seeds", "1", "--segments", "1", "--no-alone",
        "--json", str(newest))
    assert json.loads(newest.read_text())["per_k"]["1"]["sce1"] == scores[3]
    fails("eval", "--checkpoint", str(state), "--version", "7", match="holds no version 7")
    fails("simulate", "--delay-dist", "pareto", *TINY, match="delay distribution")
