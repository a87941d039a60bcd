"""The aggregator killed with SIGKILL: in the middle of writing a checkpoint (no torn version; the
restart resumes the newest complete one), and in the middle of a round (the worker that was told
ACCEPTED re-pushes the same update to the restarted aggregator and gets a definite answer)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import torch

from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames
from btnode.errors import PeerUnavailable
from btnode.model.config import ModelConfig
from btnode.protocol import Outcome, PushHeader
from btnode.rpc.client import SwarmClient
from btnode.rpc.convert import info_from_pb
from btnode.store.files import state_sha256
from btnode.store.models import init_block
from btnode.store.versions import VersionStore

from procs import CLI, TINY_SHAPE, claim_flags, free_port, honest_terms

# wide enough that writing a version (θ, the delta and their hashes, fsync'd) takes a while
BIG = ModelConfig(d_model=256, n_heads=4, n_layers=2, n_blocks=1, context=32, segments=(1, 8))
BIG_SHAPE = ["--d-model", "256", "--heads", "4", "--layers", "2", "--blocks", "1", "--context", "32", "--segments", "1,8"]
TINY = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))
TRAINING = ["--steps-per-round", "2", "--batch", "4"]  # the worker's; its aggregator judges its claims by them
GHOST = honest_terms(ClaimConfig(batch=4, steps_per_round=2))  # a hand-made join with the worker's settings


def start_aggregator(state: Path, port: int, shape: list[str], *extra: str) -> subprocess.Popen:
    p = subprocess.Popen([*CLI, "join", "--role", "aggregator", "--listen", f"127.0.0.1:{port}", "--state-dir",
                          str(state), "--keep", "1000", *shape, *extra,
                          "--no-identities", "--audit", "0"],  # hand-made pushes: several ids, no work claims env=dict(os.environ, OMP_NUM_THREADS="1"),
                         stdout=open(state.parent / "aggregator.log", "ab"), stderr=subprocess.STDOUT)
    client = SwarmClient(f"127.0.0.1:{port}", timeout_s=5)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.status()
            break
        except Exception:  # noqa: BLE001 - not up yet
            assert p.poll() is None and time.monotonic() < deadline, (state.parent / "aggregator.log").read_text()
            time.sleep(0.1)
    client.close()
    return p


def in_flight(folder: Path) -> bool:
    """A version is being written: a temp file, or data files without their commit record."""
    if not folder.is_dir():
        return False
    names = [p.name for p in folder.iterdir()]
    committed = {n.split(".")[0] for n in names if n.endswith(".json")}
    return any(".tmp-" in n or (n.startswith("v") and n.split(".")[0] not in committed) for n in names)


def test_kill_9_while_writing_a_checkpoint_never_leaves_a_torn_version(tmp_path):
    state, port = tmp_path / "state", free_port()
    delta = {n: 1e-4 * torch.ones_like(t) for n, t in init_block(BIG, 0, 0).state_dict().items()}
    frames = encode_frames(delta, Codec.FP32)
    folder = state / "block-0"
    caught = 0
    for attempt in range(2):
        agg = start_aggregator(state, port, BIG_SHAPE, "--deadline", "600")
        c = SwarmClient(f"127.0.0.1:{port}", timeout_s=60)
        c.join("w", 0, BIG.fingerprint(), json.dumps(BIG.to_dict()), training_json=honest_terms())
        current = info_from_pb(c.status().blocks[0].current)
        stored = VersionStore(state, 0).latest()
        assert stored is not None and stored.version == current.version  # resumed the newest complete version
        assert state_sha256(stored.params) == current.sha256
        base = current.version
        # push (each push closes the round: the only replica, and the write happens inside the push call)
        # while a watcher SIGKILLs the aggregator the moment it sees a version being written
        seen = threading.Event()

        def watch() -> None:
            while agg.poll() is None:
                if in_flight(folder):
                    agg.send_signal(signal.SIGKILL)
                    seen.set()
                    return
                time.sleep(0.0005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for i in range(40):
            h = PushHeader(worker_id="w", block=0, base_version=base, samples=32.0, loss=1.0, codec=Codec.FP32,
                           update_id=f"{attempt}-{i}", steps=(0,))  # one step of the default batch
            try:
                assert c.push(h, frames).outcome is Outcome.PENDING
            except PeerUnavailable:
                break
            base += 1
        c.close()
        if agg.poll() is None:
            agg.send_signal(signal.SIGKILL)
        agg.wait(timeout=30)
        watcher.join(timeout=10)
        killed = seen.is_set()
        caught += killed and in_flight(folder)
        for v in VersionStore(state, 0).versions():  # every committed version verifies
            s = VersionStore(state, 0).load(v)
            assert state_sha256(s.params) == s.meta["info"]["sha256"]
    assert caught >= 1, "never managed to kill the aggregator in the middle of a write"
    agg = start_aggregator(state, port, BIG_SHAPE, "--deadline", "600")  # and it still resumes and serves
    c = SwarmClient(f"127.0.0.1:{port}", timeout_s=60)
    cur = info_from_pb(c.status().blocks[0].current)
    assert cur.version == VersionStore(state, 0).latest().version
    c.close()
    agg.send_signal(signal.SIGTERM)
    assert agg.wait(timeout=60) == 0


def test_kill_9_mid_round_the_accepted_update_is_pushed_again(tmp_path):
    state, port = tmp_path / "state", free_port()
    agg = start_aggregator(state, port, TINY_SHAPE, "--deadline", "600", *claim_flags(TRAINING))
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([*CLI, "join", "--role", "worker", "--block", "0", "--peer", f"127.0.0.1:{port}",
                               "--worker-id", "w", "--stats-file", str(tmp_path / "w.json"), *TRAINING, *TINY_SHAPE],
                              env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=open(log, "wb"),
                              stderr=subprocess.STDOUT)
    c = SwarmClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        c.join("ghost", 0, TINY.fingerprint(), json.dumps(TINY.to_dict()), training_json=GHOST)  # never pushes: the round stays open

        def accepted_in_round() -> int:
            try:
                return c.status().blocks[0].accepted_in_round
            except Exception:  # noqa: BLE001 - aggregator restarting
                return -1

        deadline = time.monotonic() + 60
        while accepted_in_round() < 1:
            assert time.monotonic() < deadline and worker.poll() is None, log.read_text()
            time.sleep(0.1)
        agg.send_signal(signal.SIGKILL)  # the accepted update lives only in the open round
        agg.wait(timeout=30)
        agg = start_aggregator(state, port, TINY_SHAPE, "--deadline", "600", *claim_flags(TRAINING))
        c.join("ghost", 0, TINY.fingerprint(), json.dumps(TINY.to_dict()), training_json=GHOST)  # registrations live in memory
        deadline = time.monotonic() + 60
        while accepted_in_round() < 1:  # the worker's watch stream reconnects and it re-pushes
            assert time.monotonic() < deadline and worker.poll() is None, log.read_text()
            time.sleep(0.2)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, log.read_text()
        stats = json.loads((tmp_path / "w.json").read_text())
        assert stats["repushes"].get("pending", 0) >= 1, stats  # its update, pushed again after the restart
    finally:
        c.close()
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
        agg.send_signal(signal.SIGTERM)
        agg.wait(timeout=60)
