"""The swarm with real processes over loopback: the `btnode swarm` command end to end, late
updates, refused fingerprints, and an aggregator restart."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch

from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames
from btnode.errors import ConfigMismatchError
from btnode.model.config import ModelConfig
from btnode.protocol import Outcome, PushHeader
from btnode.rpc.client import SwarmClient
from btnode.rpc.enroll import SwarmAuthority, enroll, identity_security
from btnode.rpc.convert import info_from_pb
from btnode.store.files import state_sha256
from btnode.store.versions import VersionStore

from procs import CLI, TINY_SHAPE, claim_flags, honest_terms

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))
# the hand-made updates below state their weight and move values by 1e-3·randn: these tests are about
# rounds and the outer step, so their aggregators believe claims (which tests/unit/test_claims.py checks)
BELIEVE = "--believe-claims"
NO_AUDIT = ("--audit", "0")  # these push hand-made updates without work claims: they test rounds, not audits


def client_for(agg) -> SwarmClient:
    return SwarmClient(agg.address, timeout_s=30)


def join(client, *workers, block=0, cfg=CFG):
    for w in workers:
        client.join(w, block, cfg.fingerprint(), json.dumps(cfg.to_dict()))


def spec(client, block=0):
    from btnode.store.models import init_block

    return {n: tuple(t.shape) for n, t in init_block(CFG, block, 0).state_dict().items()}


def push(client, worker, base, uid=None, block=0):
    g = torch.Generator().manual_seed(hash((worker, base)) % 1000)
    delta = {n: 1e-3 * torch.randn(s, generator=g) for n, s in spec(client, block).items()}
    h = PushHeader(worker_id=worker, block=block, base_version=base, samples=8.0, loss=1.0, codec=Codec.FP32,
                   update_id=uid or f"{worker}:{base}")
    return client.push(h, encode_frames(delta, Codec.FP32))


def wait_version(client, block, version, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = client.status()
        cur = info_from_pb(st.blocks[block].current)
        if cur.version >= version:
            return cur
        time.sleep(0.05)
    raise AssertionError(f"block {block} never reached version {version}")


@pytest.mark.slow
def test_swarm_command_three_blocks_two_replicas(tmp_path):
    state = tmp_path / "swarm"
    p = subprocess.Popen(CLI + ["swarm", "--state-dir", str(state), "--replicas", "2", "--rounds", "3",
                                "--steps-per-round", "3", "--batch", "4", "--deadline", "30", "--keep", "100",
                                *TINY_SHAPE],  # claims are checked by default
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the swarm's aggregator checks claims: a worker stating batch 8 is refused at Join, while the swarm's
        # own workers (batch 4, lr 0.002, H 3) are admitted and accepted below
        port = state / "aggregator.port"
        deadline = time.monotonic() + 120
        while not (port.exists() and port.read_text().strip()):
            assert time.monotonic() < deadline and p.poll() is None, "the swarm's aggregator never served"
            time.sleep(0.1)
        # identities (the default): the probe is a node the operator gave a join code
        code, _ = SwarmAuthority(state).mint(name="probe", host="127.0.0.1")
        enroll(code, tmp_path / "probe")
        probe = SwarmClient(f"127.0.0.1:{int(port.read_text())}", timeout_s=30,
                            security=identity_security(tmp_path / "probe"))
        with pytest.raises(ConfigMismatchError):
            probe.join("probe", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()),
                       training_json=honest_terms(ClaimConfig(batch=8, lr=0.002, steps_per_round=3)))
        refused = [c["value"] for c in probe.status_dict()["counters"]
                   if (c["name"], c["labels"].get("reason")) == ("join_refused", "training")]
        assert refused == [1], refused
        probe.close()
        out, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, out + err
    for b in range(3):
        assert f"block {b} round 1 → v2: train CE" in out
        newest = VersionStore(state, b).latest()
        assert newest is not None and newest.version >= 2
        for r in range(2):
            stats = json.loads((state / "logs" / f"b{b}r{r}.stats.json").read_text())
            # audits are on by default: the first 2 updates are held on probation, a drawn one too, until audited
            assert stats["pushes"] == 3 and stats["outcomes"].get("probation", 0) >= 2
            assert stats["outcomes"].get("pending", 0) + stats["outcomes"]["probation"] == 3
            assert stats["outcomes"].get("rejected", 0) == 0  # honest claims fit the swarm's batch, lr and H
            held = VersionStore(state, b).load(stats["version"])  # the version the worker ended on
            assert stats["sha256"] == held.meta["info"]["sha256"] == state_sha256(held.params)
    # every worker stated the bundled corpus and got a data key of its own, per block (in order of joining)
    keys = json.loads((state / "data_keys.json").read_text())
    assert keys["data_id"] == "bundled:wikitext-2"
    assert {b: sorted(ws) for b, ws in keys["blocks"].items()} == {str(b): [f"b{b}r0", f"b{b}r1"] for b in range(3)}
    gen = subprocess.run(CLI + ["generate", "--checkpoint", str(state), "--bytes", "16", "--segment", "8", "The"],
                         capture_output=True, timeout=120)
    assert gen.returncode == 0 and len(gen.stdout) == 17, gen.stderr


def test_an_update_after_the_deadline_is_late_and_not_applied(aggregator):
    agg = aggregator(BELIEVE, *NO_AUDIT, "--deadline", "1.5", "--min-updates", "1")
    c = client_for(agg)
    join(c, "fast", "slow")
    assert push(c, "fast", 0).outcome is Outcome.PENDING
    v1 = wait_version(c, 0, 1)
    assert v1.closed_by == "deadline" and v1.accepted == 1  # "slow" stayed silent: the deadline closed it
    j = push(c, "slow", 0)
    assert j.outcome is Outcome.LATE and "closed before this update arrived" in j.reason
    after = c.pull(0, "x", spec(c))
    assert after.info.version == 1 and state_sha256(after.tensors) == v1.sha256
    counters = {(m.name, m.labels.get("outcome")): m.value for m in c.status().counters if m.labels.get("block") == "0"}
    assert counters[("updates", "late")] == 1
    c.close()


def test_a_worker_with_another_fingerprint_is_refused(aggregator, tmp_path):
    agg = aggregator()
    shape = [a if a != "32" else "64" for a in TINY_SHAPE[:2]] + TINY_SHAPE[2:]
    p = subprocess.run(CLI + ["join", "--role", "worker", "--block", "0", "--peer", agg.address, "--rounds", "1",
                              "--worker-id", "odd", *shape], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "d_model: swarm has 32, worker has 64" in p.stderr and "Traceback" not in p.stderr


def test_a_worker_with_other_training_settings_is_refused_at_join(aggregator):
    agg = aggregator(*claim_flags(["--batch", "16", "--steps-per-round", "3"]))
    p = subprocess.run(CLI + ["join", "--role", "worker", "--block", "0", "--peer", agg.address, "--rounds", "1",
                              "--worker-id", "odd", "--steps-per-round", "3", "--batch", "8", *TINY_SHAPE],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == ConfigMismatchError.exit_code and "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "worker 'odd' trains with different swarm-wide settings (batch: swarm has " \
                                          "16, worker has 8)" in last, p.stderr
    c = client_for(agg)
    events = {(m.name, m.labels.get("reason")): m.value for m in c.status().counters if "block" not in m.labels}
    assert events[("join_refused", "training")] == 1 and ("joins", "") not in events
    c.close()


def test_a_restarted_aggregator_resumes_the_same_versions_and_hashes(aggregator, tmp_path):
    agg = aggregator(BELIEVE, *NO_AUDIT, "--deadline", "30")
    c = client_for(agg)
    join(c, "w", block=1)
    for v in range(2):
        assert push(c, "w", v, block=1).outcome is Outcome.PENDING
    before = {bs.block: info_from_pb(bs.current) for bs in c.status().blocks}
    assert before[1].version == 2 and before[0].version == 0
    c.close()
    assert agg.stop() == 0  # SIGTERM: a clean stop
    again = aggregator(BELIEVE, *NO_AUDIT, "--deadline", "30", state_dir=agg.state_dir)
    c = client_for(again)
    after = {bs.block: info_from_pb(bs.current) for bs in c.status().blocks}
    assert {b: (i.version, i.sha256) for b, i in after.items()} == {b: (i.version, i.sha256) for b, i in before.items()}
    pulled = c.pull(1, "w", spec(c, 1))
    assert state_sha256(pulled.tensors) == before[1].sha256
    c.close()


def test_a_new_version_is_exactly_base_plus_eta_times_the_weighted_mean(aggregator):
    """Recomputed here from the updates we sent, against an aggregator process with η = 0.7."""
    agg = aggregator(BELIEVE, *NO_AUDIT, "--deadline", "30", "--outer-lr", "0.7", "--link", "lan")  # fp32 deltas: exact
    c = client_for(agg)
    join(c, "r1", "r2", block=2)
    base = c.pull(2, "r1", spec(c, 2))
    g = torch.Generator().manual_seed(7)
    d = {w: {n: 1e-3 * torch.randn(s, generator=g) for n, s in spec(c, 2).items()} for w in ("r1", "r2")}
    weights = {"r1": 32.0, "r2": 96.0}
    for w in ("r2", "r1"):  # arrival order must not matter
        h = PushHeader(worker_id=w, block=2, base_version=0, samples=weights[w], loss=1.0, codec=Codec.FP32,
                       update_id=w)
        assert c.push(h, encode_frames(d[w], Codec.FP32)).outcome is Outcome.PENDING
    new = c.pull(2, "r1", spec(c, 2))
    assert new.info.version == 1 and new.info.closed_by == "all_reported"
    for n, t in base.tensors.items():
        acc = torch.zeros_like(t)
        for w in ("r1", "r2"):
            acc += (weights[w] / 128.0) * d[w][n]
        # the exact fixed-point sum (aggregate/sums/accumulate.py) is within its grid of this fp32 sum
        torch.testing.assert_close(new.tensors[n], t + 0.7 * acc, rtol=0, atol=1e-7, msg=n)
    c.close()
