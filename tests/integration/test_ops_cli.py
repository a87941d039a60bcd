"""`btnode status`, `btnode doctor` and `btnode plan` as real processes against a real aggregator."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
from pathlib import Path

import torch
from procs import TINY_SHAPE, honest_terms

from btnode import __version__ as btnode_version
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.codecs import Codec, raw_size
from btnode.codec.frames import encode_frames
from btnode.model.config import ModelConfig
from btnode.protocol import PushHeader
from btnode.rpc.client import SwarmClient
from btnode.store.models import init_ar, init_block

BTNODE = str(Path(sys.executable).with_name("btnode"))
CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))


def btnode(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([BTNODE, *args], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def test_plan_counts_the_parameters_of_a_real_block():
    p = btnode("plan", "--json", "--batch", "8", "--d-model", "64", "--heads", "2", "--layers", "3", "--blocks", "4",
               "--context", "64", "--segments", "1,8")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    cfg = ModelConfig(d_model=64, n_heads=2, n_layers=3, n_blocks=4, context=64, segments=(1, 8))
    n = sum(t.numel() for t in init_block(cfg, 0, 0).parameters())
    w, e = plan["worker"], plan["end_to_end"]
    assert w["parameters"] == n and w["param_bytes"] == 4 * n and w["grad_bytes"] == 4 * n and w["adam_bytes"] == 8 * n
    n_ar = sum(t.numel() for t in init_ar(cfg, 12, 0).parameters())  # end to end: the B·L-layer AR model
    assert e["n_layers"] == 12 and e["parameters"] == n_ar and e["state_bytes"] == 16 * n_ar
    assert 100 * 2**20 < w["runtime_bytes"] == e["runtime_bytes"]  # this process, torch imported and warmed up
    assert w["peak_bytes"] >= w["train_peak_bytes"] > w["runtime_bytes"] + w["state_bytes"]
    assert plan["block_bytes_by_codec"]["fp32"] == 4 * n
    # what `join --role worker` checks: the training peak plus 9 fp32 copies and the int8 update
    assert w["swarm_worker_peak_bytes"] - w["train_peak_bytes"] == 36 * n + raw_size(Codec.INT8, n)
    assert plan["block_bytes_by_codec"]["fp32"] / plan["block_bytes_by_codec"]["int8"] > 3.5
    small = json.loads(btnode("plan", "--json", "--batch", "2", "--d-model", "64", "--heads", "2", "--layers", "3",
                              "--blocks", "4", "--context", "64", "--segments", "1,8").stdout)
    assert 0 < small["worker"]["activation_bytes"] < w["activation_bytes"]  # measured, and it grows with the batch
    text = btnode("plan", "--d-model", "64", "--heads", "2").stdout
    assert "AdamW state" in text and "end to end" in text and "int8" in text
    # a DiLoCo run's replica of another depth (--model ar --ar-layers N)
    ar = json.loads(btnode("plan", "--json", "--batch", "2", "--d-model", "64", "--heads", "2", "--layers", "3",
                           "--blocks", "4", "--context", "64", "--segments", "1,8", "--ar-layers", "3").stdout)
    assert ar["end_to_end"]["n_layers"] == 3
    assert ar["end_to_end"]["parameters"] == sum(t.numel() for t in init_ar(cfg, 3, 0).parameters())
    assert "end to end (AR, 3 layers)" in btnode("plan", "--d-model", "64", "--heads", "2", "--ar-layers", "3").stdout
    bad = btnode("plan", "--ar-layers", "0")
    assert bad.returncode == 2 and "--ar-layers must be ≥ 1" in bad.stderr
    # a block run with a low-rank σ path (--ada-rank): the worker holds what the config builds, and less
    low = json.loads(btnode("plan", "--json", "--batch", "2", "--d-model", "64", "--heads", "2", "--layers", "3",
                            "--blocks", "4", "--context", "64", "--segments", "1,8", "--ada-rank", "8").stdout)
    n_low = sum(t.numel() for t in init_block(dataclasses.replace(cfg, ada_rank=8), 0, 0).parameters())
    assert low["worker"]["parameters"] == n_low < n


def test_status_and_doctor_against_a_live_aggregator(aggregator):
    claims = ClaimConfig(batch=4, lr=0.01)  # one step may move 0.0117: the hand-made updates move 0.01
    agg = aggregator("--deadline", "600", "--batch", "4", "--lr", "0.01", "--audit", "0")  # hand-made pushes: no claims
    client = SwarmClient(agg.address, timeout_s=30)
    for w in ("a", "b"):
        client.join(w, 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(claims))
    spec = {n: tuple(t.shape) for n, t in init_block(CFG, 0, 0).state_dict().items()}
    for w in ("a", "b"):
        header = PushHeader(worker_id=w, block=0, base_version=0, samples=4.0, loss=3.25, codec=Codec.FP32,
                            update_id=f"{w}-0", steps=(0,))
        client.push(header, encode_frames({n: torch.full(s, 0.01) for n, s in spec.items()}, Codec.FP32))
    client.close()
    p = btnode("status", "--peer", agg.address)
    assert p.returncode == 0, p.stderr
    assert f"swarm at {agg.address} (btnode {btnode_version}): " in p.stdout  # the build the aggregator runs
    assert "block 0: version 1" in p.stdout and "2 replicas [a, b]" in p.stdout
    assert "    data keys: a 0/0, b 0/1" in p.stdout and "; data not stated yet" in p.stdout, p.stdout
    assert "v1: 2 accepted, 0 late, 0 stale, 0 rejected; closed by all_reported; loss 3.2500" in p.stdout
    st = json.loads(btnode("status", "--peer", agg.address, "--json").stdout)
    assert st["blocks"][0]["version"] == 1 and st["fingerprint"] == CFG.fingerprint()
    assert st["node_version"] == btnode_version

    ok = btnode("doctor", "--peer", agg.address, "--listen", "127.0.0.1:0", *TINY_SHAPE)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for check in ("peer", "health", "clock skew", "fingerprint", "port", "disk", "torch threads", "device"):
        assert f"] {check}:" in ok.stdout
    assert "[FAIL]" not in ok.stdout

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        bad = btnode("doctor", "--peer", agg.address, "--listen", f"127.0.0.1:{port}", "--d-model", "64",
                     *TINY_SHAPE[2:])
    assert bad.returncode == 1
    assert "[FAIL] fingerprint" in bad.stdout and "d_model: swarm 32, here 64" in bad.stdout
    assert "[FAIL] port" in bad.stdout and "fix:" in bad.stdout


def test_doctor_with_an_unreachable_peer_says_how_to_fix_it():
    p = btnode("doctor", "--peer", "127.0.0.1:1")
    assert p.returncode == 1 and "[FAIL] peer" in p.stdout and "fix: check the address" in p.stdout


def test_status_names_a_diloco_runs_unit_and_doctor_checks_its_fingerprint(aggregator):
    agg = aggregator("--model", "ar", "--ar-layers", "2", "--deadline", "600")
    cfg = ModelConfig.from_dict({**CFG.to_dict(), "kind": "ar", "ar_layers": 2})
    client = SwarmClient(agg.address, timeout_s=30)
    client.join("r", 0, cfg.fingerprint(), json.dumps(cfg.to_dict()), training_json=honest_terms())
    client.close()
    out = btnode("status", "--peer", agg.address).stdout
    assert "ar (2 layers) N=32" in out and "ar (2 layers): version 0" in out and "block 0" not in out
    ok = btnode("doctor", "--peer", agg.address, *TINY_SHAPE, "--model", "ar", "--ar-layers", "2")
    assert ok.returncode == 0 and "[  OK] fingerprint" in ok.stdout, ok.stdout
    bad = btnode("doctor", "--peer", agg.address, *TINY_SHAPE)
    assert bad.returncode == 1 and "[FAIL] fingerprint" in bad.stdout and "kind: swarm 'ar', here 'block'" in bad.stdout
