"""DiLoCo on the same daemon (`--model ar`, issue #12) with real processes over loopback: the local
swarm end to end, the outer Nesterov step recomputed bit for bit across an aggregator restart,
plain averaging, refused fingerprints, and the simulator. The exact checks of the outer step run with
`--link lan` (an fp32 publish): the default profile's sparse publish is what test_link.py checks."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from btnode.aggregate.sums.averaging import DILOCO_OUTER
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.codecs import Codec, decode, keep_in
from btnode.codec.frames import encode_frames
from btnode.codec.sparse import keep_of
from btnode.model.config import ModelConfig
from btnode.protocol import Outcome, PushHeader
from btnode.rpc.client import SwarmClient
from btnode.rpc.convert import info_from_pb
from btnode.store.files import state_sha256
from btnode.store.models import init_unit
from btnode.store.versions import VersionStore

from procs import CLI, TINY_SHAPE, cli_fails, honest_terms, run_cli

AR_FLAGS = ["--model", "ar", "--ar-layers", "2"]
LAN = ["--link", "lan"]  # fp32 published deltas: θ^{v+1} − θ^v is the outer step itself
ETA, MU = DILOCO_OUTER.lr, DILOCO_OUTER.momentum
CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8), kind="ar", ar_layers=2)
SPEC = {n: tuple(t.shape) for n, t in init_unit(CFG, 0, 0).state_dict().items()}
TRAINING = ["--steps-per-round", "2", "--batch", "4", "--lr", "0.01"]  # the aggregators' and the workers'
CLAIMS = ClaimConfig(batch=4, lr=0.01, steps_per_round=2)  # a step may move 0.0117: the hand-made deltas 1e-3·randn


def deltas(seed: int, workers: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {w: {n: 1e-3 * torch.randn(s, generator=g) for n, s in SPEC.items()} for w in workers}


def push_round(c: SwarmClient, base: int, d: dict[str, dict[str, torch.Tensor]], weights: dict[str, float]) -> None:
    for w in sorted(d, reverse=True):  # arrival order must not matter
        h = PushHeader(worker_id=w, block=0, base_version=base, samples=weights[w], loss=1.0, codec=Codec.FP32,
                       update_id=f"{w}:{base}", steps=tuple(range(int(weights[w]) // CLAIMS.batch)))
        assert c.push(h, encode_frames(d[w], Codec.FP32)).outcome is Outcome.PENDING


def mean(d: dict[str, dict[str, torch.Tensor]], weights: dict[str, float]) -> dict[str, torch.Tensor]:
    """The aggregator's weighted mean, in its order (worker ids sorted), in fp32."""
    total = sum(weights.values())
    out = {}
    for n in SPEC:
        acc = torch.zeros(SPEC[n])
        for w in sorted(d):
            acc += (weights[w] / total) * d[w][n]
        out[n] = acc
    return out


@pytest.mark.slow
def test_swarm_command_trains_full_replicas_and_eval_reads_the_newest_version(tmp_path):
    state = tmp_path / "swarm"
    p = subprocess.run(CLI + ["swarm", "--state-dir", str(state), "--replicas", "2", "--rounds", "2",
                              "--steps-per-round", "2", "--batch", "4", "--deadline", "30", "--keep", "100",
                              *TINY_SHAPE, *AR_FLAGS, *LAN], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ar round 0 → v1: train CE" in p.stdout and "ar round 1 → v2: train CE" in p.stdout
    store = VersionStore(state, 0, stem="ar")
    newest = store.latest()
    assert newest is not None and newest.version >= 2
    # the swarm's aggregator took --model ar's outer step (η, Nesterov μ): from the stored versions and their
    # momentum buffers m (saved with each version), θ1 − θ0 = η(1 + μ)·m1 and θ2 − θ1 = η((1 + μ)·m2 − μ·m1)
    v0, v1, v2 = (store.load(v) for v in range(3))
    assert set(v1.outer) == set(v2.outer) == set(v0.params)  # plain averaging (μ = 0) keeps no buffers
    for n, t in v0.params.items():
        m1, m2 = v1.outer[n], v2.outer[n]
        torch.testing.assert_close(v1.params[n] - t, ETA * (1 + MU) * m1, rtol=0, atol=1e-6, msg=n)
        torch.testing.assert_close(v2.params[n] - v1.params[n], ETA * ((1 + MU) * m2 - MU * m1), rtol=0, atol=1e-6,
                                   msg=n)
    # every accepted update is in a version (a replica that starts late may find the other done)
    assert sum(store.load(v).meta["info"]["accepted"] for v in range(1, newest.version + 1)) == 4
    for r in range(2):  # each replica holds a published version, bit for bit
        stats = json.loads((state / "logs" / f"b0r{r}.stats.json").read_text())
        # audits are on by default: a new identity's first 2 updates are held on probation until replayed
        assert stats["pushes"] == 2 and stats["outcomes"] == {"probation": 2}
        held = store.load(stats["version"])
        assert stats["sha256"] == held.meta["info"]["sha256"] == state_sha256(held.params)
    out = run_cli("eval", "--checkpoint", str(state), "--windows", "4").stdout
    assert "autoregressive (2 layers): teacher-forced CE" in out


def test_the_default_outer_step_is_nesterov_bit_for_bit_across_a_restart(aggregator):
    agg = aggregator(*AR_FLAGS, *LAN, *TRAINING, "--deadline", "30", "--audit", "0")
    c = SwarmClient(agg.address, timeout_s=30)
    weights = {"r1": 4.0, "r2": 12.0}  # one step and three
    for w in weights:
        c.join(w, 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(CLAIMS))
    base = c.pull(0, "r1", SPEC).tensors
    d1 = deltas(7, ("r1", "r2"))
    push_round(c, 0, d1, weights)
    v1 = c.pull(0, "r1", SPEC)
    m1 = mean(d1, weights)  # the momentum buffer after one step is the mean itself
    assert v1.info.version == 1 and v1.info.closed_by == "all_reported"
    for n, t in base.items():
        # the exact fixed-point mean (aggregate/sums/accumulate.py) is within an ulp of this fp32 one: a few
        # ulps of θ, far under what a lossy momentum buffer (bf16: ~2e-6 here) would be off by
        torch.testing.assert_close(v1.tensors[n], t + ETA * (m1[n] + MU * m1[n]), rtol=0, atol=5e-7, msg=n)
    c.close()
    assert agg.stop() == 0
    again = aggregator(*AR_FLAGS, *LAN, *TRAINING, "--deadline", "30", "--audit", "0", state_dir=agg.state_dir)
    c = SwarmClient(again.address, timeout_s=30)
    (unit,) = c.status().blocks
    assert (info_from_pb(unit.current).version, info_from_pb(unit.current).sha256) == (1, v1.info.sha256)
    for w in weights:
        c.join(w, 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(CLAIMS))
    d2 = deltas(8, ("r1", "r2"))
    push_round(c, 1, d2, weights)
    v2 = c.pull(0, "r2", SPEC)
    g2 = mean(d2, weights)
    for n, t in v1.tensors.items():  # the momentum came back from disk: μ·m1 + mean, then the look-ahead
        m2 = MU * m1[n] + g2[n]
        torch.testing.assert_close(v2.tensors[n], t + ETA * (g2[n] + MU * m2), rtol=0, atol=5e-7, msg=n)
    assert state_sha256(v2.tensors) == v2.info.sha256
    c.close()


def test_plain_averaging_is_selectable_a_worker_trains_a_replica_and_a_block_worker_is_refused(aggregator, tmp_path):
    agg = aggregator(*AR_FLAGS, *LAN, *TRAINING, "--deadline", "30", "--audit", "0", "--outer-lr", "1",
                     "--outer-momentum", "0")
    c = SwarmClient(agg.address, timeout_s=30)
    c.join("r1", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(CLAIMS))
    base = c.pull(0, "r1", SPEC).tensors
    d = deltas(3, ("r1",))
    push_round(c, 0, d, {"r1": 8.0})
    v1 = c.pull(0, "r1", SPEC).tensors
    for n in SPEC:  # one update's mean is itself, to the fixed-point grid: η = 1, μ = 0
        torch.testing.assert_close(v1[n], base[n] + d["r1"][n], rtol=0, atol=5e-7)
    c.leave("r1", 0)
    # a real worker process (no --block: an AR run's one unit) trains a full replica for a round
    stats = tmp_path / "w.stats.json"
    run_cli("join", "--role", "worker", "--peer", agg.address, "--rounds", "1", *TRAINING, "--worker-id", "w",
            "--stats-file", str(stats), *TINY_SHAPE, *AR_FLAGS)
    held = json.loads(stats.read_text())
    current = info_from_pb(c.status().blocks[0].current)
    assert held["outcomes"] == {"pending": 1} and (held["version"], held["sha256"]) == (2, current.sha256)
    c.close()
    cli_fails("join", "--role", "worker", "--block", "0", "--peer", agg.address, "--rounds", "1", "--worker-id", "odd",
              *TINY_SHAPE, match="kind: swarm has 'ar', worker has 'block'")


def test_simulate_runs_diloco_with_its_outer_step_and_config_show_prints_its_fingerprint(tmp_path):
    out = tmp_path / "sim.json"
    p = run_cli("simulate", "--rounds", "2", "--steps-per-round", "2", "--batch", "4", "--eval-windows", "4",
                "--json", str(out), "--codec", "sparse2", "--density", "0.03", "--publish-codec", "sparse8",
                *TINY_SHAPE, *AR_FLAGS)  # the sparse codecs too, as a block run would have them (issue #24)
    assert "after 2 rounds: teacher-forced CE" in p.stdout
    res = json.loads(out.read_text())
    assert res["versions"] == {"0": 2} and res["model"]["kind"] == "ar" and res["ce"] > 0
    assert (res["sim"]["codec"], res["sim"]["density"], res["outcomes"]["rejected"]) == ("SPARSE2", 0.03, 0)
    assert (res["outer"]["lr"], res["outer"]["momentum"]) == (ETA, MU)
    shown = run_cli("config", "show", "join", "--", "--role", "worker", *TINY_SHAPE, *AR_FLAGS).stdout
    assert f"run fingerprint: {CFG.fingerprint()}" in shown


def test_a_local_swarm_passes_the_sparse_codecs_to_its_nodes(tmp_path):
    """Issue #24 through the real CLI: `btnode swarm` hands --codec sparse2 --density to its `join --role
    worker` processes and --publish-codec sparse8 --publish-density to its `join --role aggregator`."""
    state = tmp_path / "swarm"
    p = subprocess.run(CLI + ["swarm", "--state-dir", str(state), "--replicas", "2", "--rounds", "2", *TRAINING,
                              "--deadline", "30", "--keep", "100", "--codec", "sparse2", "--density", "0.03",
                              "--publish-codec", "sparse8", "--publish-density", "0.03", *TINY_SHAPE, *AR_FLAGS],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    store = VersionStore(state, 0, stem="ar")
    newest = store.latest()
    assert newest is not None and newest.version >= 1
    for v in range(1, newest.version + 1):  # published in sparse8 at 3 %, and each version rebuilds bit for bit
        codec, raw, meta = store.delta(v)
        assert codec is Codec.SPARSE8 and keep_in(codec, raw) == keep_of(0.03)
        before = store.load(v - 1).params
        rebuilt = {n: before[n] + decode(codec, raw[n], SPEC[n]) for n in SPEC}
        assert state_sha256(rebuilt) == meta["info"]["sha256"]
    numel = sum(math.prod(s) for s in SPEC.values())
    for r in range(2):
        stats = json.loads((state / "logs" / f"b0r{r}.stats.json").read_text())
        assert stats["outcomes"] == {"probation": 2} and stats["sha256"] == store.load(stats["version"]).meta["info"]["sha256"]  # probation: audits by default
        assert stats["bytes_pushed_raw"] < 0.03 * 4 * numel * stats["pushes"]  # sparse2 at 3 %: under 3 % of fp32


@pytest.mark.parametrize("args, match", [(["--role", "worker", "--codec", "sparse2", "--density", "0"], "--density must be"),
                                         (["--role", "aggregator", "--publish-codec", "sparse8", "--publish-density", "1.5"],
                                          "--publish-density must be")])
def test_a_density_outside_zero_one_is_refused_by_the_cli(args, match):
    cli_fails("join", *args, *TINY_SHAPE, *AR_FLAGS, match=match)
