"""Running btnode as operators do: systemd units that `systemd-analyze verify` accepts without a
word, sd_notify readiness and watchdog from real processes, a graceful drain on SIGTERM, JSON logs
under systemd, and settings from a TOML file, the environment and flags."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames
from btnode.model.config import ModelConfig
from btnode.protocol import PushHeader
from btnode.rpc.client import SwarmClient
from btnode.store.models import init_block
from btnode.store.versions import VersionStore

from procs import CLI, TINY_SHAPE, claim_flags, honest_terms, start, wait_port

ROOT = Path(__file__).resolve().parents[2]
UNITS = sorted((ROOT / "systemd").glob("*.service"))
BTNODE = str(Path(sys.executable).with_name("btnode"))
CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))


def instance(unit: Path) -> str:
    return unit.name.replace("@.", "@2.") if "@." in unit.name else unit.name


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_verifies_without_any_warning(unit, tmp_path):
    # the units run /opt/btnode/venv/bin/btnode (docs/operations.md installs it there); verify
    # checks that ExecStart exists, so the copy under test points at this venv's btnode instead
    text = unit.read_text()
    assert "/opt/btnode/venv/bin/btnode" in text
    (tmp_path / unit.name).write_text(text.replace("/opt/btnode/venv/bin/btnode", BTNODE))
    done = subprocess.run(["systemd-analyze", "verify", instance(unit)], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stdout + done.stderr
    for needed in ("Type=notify", "WatchdogSec=", "DynamicUser=yes", "ProtectSystem=strict", "StateDirectory=",
                   "KillSignal=SIGTERM"):
        assert needed in text, f"{unit.name} lacks {needed}"


def test_a_broken_unit_is_caught(tmp_path):
    """The check above can fail: an unknown key only warns on stderr, with exit code 0."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = ROOT / "systemd" / "btnode-aggregator.service"
    (tmp_path / unit.name).write_text(unit.read_text().replace("/opt/btnode/venv/bin/btnode", BTNODE)
                                      + "\n[Service]\nRestartt=always\n")
    done = subprocess.run(["systemd-analyze", "verify", unit.name], cwd=tmp_path, capture_output=True, text=True)
    assert "Restartt" in done.stderr


class NotifySocket:
    """Plays systemd's side of sd_notify: a datagram socket whose messages we collect."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.5)
        self.messages: list[str] = []

    def wait_for(self, field: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(field in m.split("\n") for m in self.messages):
                return
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                pass
        raise AssertionError(f"no {field} in {self.messages}")

    def collect(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                pass


def test_aggregator_notifies_ready_keeps_the_watchdog_and_drains_on_sigterm(tmp_path):
    note = NotifySocket(tmp_path / "notify.sock")
    port_file = tmp_path / "port"
    env = dict(os.environ, NOTIFY_SOCKET=str(note.path), WATCHDOG_USEC="300000", INVOCATION_ID="test", OMP_NUM_THREADS="1")
    log = tmp_path / "agg.log"
    proc = subprocess.Popen([*CLI, "join", "--role", "aggregator", "--listen", "127.0.0.1:0", "--state-dir",
                             str(tmp_path / "state"), "--port-file", str(port_file), "--deadline", "600", "--batch",
                             "4", "--lr", "0.01", *TINY_SHAPE, "--no-identities", "--audit", "0"],  # pushes by hand as "a", with no work claim
                            env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        address = f"127.0.0.1:{wait_port(port_file, proc)}"
        note.wait_for("READY=1")
        note.collect(1.5)  # WatchdogSec = 0.3 s: a keep-alive every 0.15 s
        assert sum(m == "WATCHDOG=1" for m in note.messages) >= 4
        # one of two replicas pushes: the round (τ = 600 s) is open with one accepted update
        client = SwarmClient(address, timeout_s=30)
        for w in ("a", "b"):
            client.join(w, 0, CFG.fingerprint(), json.dumps(CFG.to_dict()),
                        training_json=honest_terms(ClaimConfig(batch=4, lr=0.01)))
        params = init_block(CFG, 0, 0).state_dict()
        spec = {n: tuple(t.shape) for n, t in params.items()}
        delta = {n: torch.full(s, 0.01) for n, s in spec.items()}
        header = PushHeader(worker_id="a", block=0, base_version=0, samples=4.0, loss=3.0, codec=Codec.FP32,
                            update_id="u1", steps=(0,))  # one step of batch 4 at lr 0.01 may move 0.0117
        assert client.push(header, encode_frames(delta, Codec.FP32)).outcome.value == "pending"
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        note.wait_for("STOPPING=1")
    finally:
        if proc.poll() is None:
            proc.kill()
    stored = VersionStore(tmp_path / "state", 0).latest()
    assert stored is not None and stored.meta["info"]["version"] == 1
    assert stored.meta["info"]["closed_by"] == "drain" and stored.meta["info"]["accepted"] == 1
    # under systemd (INVOCATION_ID set) the log is JSON lines: their shape, not their words, is the product here
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    docs = [json.loads(ln) for ln in lines]
    assert docs and all({"ts", "level", "logger", "msg"} <= set(d) for d in docs)


def test_worker_stops_at_a_step_boundary_and_exits_0_on_sigterm(aggregator, tmp_path):
    training = ["--steps-per-round", "100000", "--batch", "4"]
    agg = aggregator("--deadline", "600", *claim_flags(training))
    log = tmp_path / "worker.log"
    proc = start(["join", "--role", "worker", "--block", "1", "--peer", agg.address, "--worker-id", "w", *training,
                  "--stats-file", str(tmp_path / "w.json"), *TINY_SHAPE], log)
    client = SwarmClient(agg.address, timeout_s=30)
    try:
        deadline = time.monotonic() + 60
        while "w" not in next(b for b in client.status().blocks if b.block == 1).replicas:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        time.sleep(1.0)  # training its (very long) round
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
        assert time.monotonic() - t0 < 15
        block = next(b for b in client.status().blocks if b.block == 1)
        assert "w" not in block.replicas and block.current.version == 0  # left; nothing partial pushed
        stats = json.loads((tmp_path / "w.json").read_text())
        assert stats["steps"] >= 1 and stats["pushes"] == 0, stats  # it trained, and abandoned the round unpushed
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()


def test_settings_precedence_flag_env_file(tmp_path):
    (tmp_path / "btnode.toml").write_text('[model]\nd-model = 64\nsegments = [1, 8]\n\n'
                                          '[join]\nrole = "worker"\npeer = "agg:7070"\nsteps-per-round = 7\nbatch = 8\n')
    env = dict(os.environ, BTNODE_JOIN_STEPS_PER_ROUND="9", BTNODE_JOIN_BATCH="16")
    done = subprocess.run([BTNODE, "--config", str(tmp_path / "btnode.toml"), "config", "show", "join", "--",
                           "--batch", "4", "--block", "2"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    rows = {ln.split()[0]: ln.split()[1:] for ln in done.stdout.splitlines() if ln.startswith("  --")}
    assert rows["--peer"] == ["agg:7070", "file"]
    assert rows["--steps-per-round"] == ["9", "env"]  # env beats the file
    assert rows["--batch"] == ["4", "flag"]  # a flag beats both
    assert rows["--d-model"] == ["64", "file", "swarm-wide"]
    assert rows["--lr"][1] == "default"
    assert "run fingerprint: " in done.stdout
    expected = ModelConfig(d_model=64, n_heads=4, n_layers=2, n_blocks=3, context=128, segments=(1, 8)).fingerprint()
    assert expected in done.stdout


@pytest.mark.parametrize("content, match", [('[join]\nsteps = 3\n', "unknown setting"),
                                            ('[joinn]\n', "unknown table"),
                                            ('[model]\nlr = 0.1\n', "swarm-wide"),
                                            ('[join\n', "not valid TOML")])
def test_bad_settings_files_are_refused_clearly(tmp_path, content, match):
    (tmp_path / "bad.toml").write_text(content)
    done = subprocess.run([BTNODE, "--config", str(tmp_path / "bad.toml"), "config", "show"], capture_output=True,
                          text=True)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error:") and match in done.stderr, done.stderr
