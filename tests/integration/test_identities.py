"""Identities by default, with real processes: an aggregator started with no security flags makes
its swarm's CA, a worker that enrolls with a join code trains, a worker without one is told why it
gets no answer (not left retrying), a used code makes no second identity, a Watch under an id that
never joined is refused, and revoking an identity ends its stream at once."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from btnode.errors import Forbidden, Refused
from btnode.rpc.client import SwarmClient
from btnode.rpc.enroll import SwarmAuthority, identity_security

from procs import BTNODE, TINY_SHAPE, Aggregator, identity_env, operator, start, stop_all

from btnode.model.config import ModelConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))  # TINY_SHAPE
TRAINING = ["--steps-per-round", "2", "--batch", "4"]


@pytest.fixture
def swarm(tmp_path):
    agg = Aggregator(tmp_path / "agg", ["--deadline", "10", "--batch", "4", "--steps-per-round", "2"],
                     identities=True).start()
    yield agg
    agg.stop()


def test_a_default_swarm_admits_enrolled_workers_only(swarm, tmp_path):
    assert (swarm.state_dir / "swarm" / "ca" / "ca.pem").is_file()  # made at the first start, no command
    # a worker with no identity is told, in one line, what it lacks; it does not retry forever
    p = subprocess.run([BTNODE, "join", "--role", "worker", "--block", "0", "--peer", swarm.address, "--rounds", "1",
                        *TRAINING, *TINY_SHAPE], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "speaks TLS" in p.stderr and "--join-code" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    env = identity_env(swarm.state_dir, "w1")
    w = start(["join", "--role", "worker", "--block", "0", "--peer", swarm.address, "--rounds", "2", *TRAINING,
               *TINY_SHAPE, "--stats-file", str(tmp_path / "w1.json")], tmp_path / "w1.log", env=env)
    try:
        assert w.wait(timeout=180) == 0, (tmp_path / "w1.log").read_text()
    finally:
        stop_all([w])
    stats = json.loads((tmp_path / "w1.json").read_text())
    assert stats["pushes"] == 2
    # the code is spent: another node presenting it gets no identity, and says so
    p = subprocess.run([BTNODE, "--join-code", env["BTNODE_JOIN_CODE"], "--identity", str(tmp_path / "thief"),
                        "join", "--role", "worker", "--block", "0", "--peer", swarm.address, *TINY_SHAPE],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "used already" in p.stderr and not (tmp_path / "thief" / "identity.pem").exists()
    ops = SwarmClient(swarm.address, timeout_s=10, security=operator(swarm.state_dir))
    try:
        names = {r["name"]: r for r in ops.status_dict()["identities"]}
        assert names["w1"]["role"] == "worker" and "thief" not in json.dumps(names)
    finally:
        ops.close()


def test_streams_are_bound_to_a_joined_unrevoked_identity(swarm, tmp_path):
    code, _ = SwarmAuthority(swarm.state_dir).mint(name="idle", host="127.0.0.1")
    from btnode.rpc.enroll import enroll

    enroll(code, tmp_path / "idle")
    c = SwarmClient(swarm.address, timeout_s=10, security=identity_security(tmp_path / "idle"))
    ops = SwarmClient(swarm.address, timeout_s=10, security=operator(swarm.state_dir))
    try:
        with pytest.raises(Refused, match="without having joined"):
            next(iter(c.watch(0, "idle")))  # a replica the rounds would wait for, which never joined
        with pytest.raises(Forbidden):
            next(iter(c.watch(0, "someone-else")))  # a foreign id
        from procs import honest_terms
        from btnode.aggregate.trust.claims import ClaimConfig

        c.join("idle", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()),
               training_json=honest_terms(ClaimConfig(batch=4, steps_per_round=2)))
        stream = c.watch(0, "idle")
        assert next(stream).version == 0
        ended = threading.Event()

        def drain() -> None:
            try:
                for _ in stream:
                    pass
            except Exception:  # noqa: BLE001 - the stream's end is what is measured
                pass
            ended.set()

        threading.Thread(target=drain, daemon=True).start()
        t0 = time.monotonic()
        ops.revoke("idle")
        assert ended.wait(5), "the revoked identity's stream stayed open"
        print(f"stream closed {time.monotonic() - t0:.2f} s after the revocation")
        status = ops.status_dict()
        assert "idle" not in status["blocks"][0]["replicas"]
    finally:
        c.close()
        ops.close()
