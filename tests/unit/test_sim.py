"""The virtual async simulator: the daemon's aggregator and workers on a virtual clock."""

from __future__ import annotations

import pytest
import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.codec.codecs import Codec
from btnode.errors import ConfigError
from btnode.model.config import ModelConfig
from btnode.sim.simulator import SimConfig, Simulation
from btnode.store.files import state_sha256
from btnode.train.config import TrainConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=2, context=32, segments=(1, 8))
TC = TrainConfig(steps=40, batch=4, warmup=2)
CORPUS = bytes(range(256)) * 40
H, STEP = 3, 0.1


def run(tmp_path, deadline=1.0, **kw):
    scfg = SimConfig(**{"rounds": 4, "steps_per_round": H, "step_time_s": STEP, "delays_s": (0.02,),
                        "delay_dist": "fixed", "codec": Codec.INT8, **kw})
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=deadline))
    sim = Simulation(CFG, TC, acfg, scfg, CORPUS, tmp_path, device=torch.device("cpu"))
    return sim, sim.run()


def test_lockstep_publishes_one_version_per_round_and_closes_early(tmp_path):
    sim, res = run(tmp_path, participation=1.0)
    assert res.versions == {0: 4, 1: 4}
    assert res.outcomes["pending"] == res.outcomes["applied"] == 16 and res.outcomes["late"] == 0 and res.absent == 0
    assert res.closed_by == {"all_reported": 8}
    # each round: H steps of compute, the push's delay and the announcement's delay
    assert res.virtual_seconds == pytest.approx(4 * (H * STEP + 0.04))
    for b, agg in sim.agg.blocks.items():  # the versions on disk are the daemon's own, hash and all
        stored = agg.store.latest()
        assert stored is not None and state_sha256(stored.params) == agg.info.sha256


def test_same_seed_same_run_and_nested_participation(tmp_path):
    sim_a, a = run(tmp_path / "a", participation=0.5, seed=3)
    sim_b, b = run(tmp_path / "b", participation=0.5, seed=3)
    sim_c, c = run(tmp_path / "c", participation=0.9, seed=3)
    assert a == b
    assert [x.info.sha256 for x in sim_a.agg.block(0).recent] == [x.info.sha256 for x in sim_b.agg.block(0).recent]
    # the attempts a replica misses at 0.9 are a subset of those it misses at 0.5
    assert b.absent > 0 and b.attempts == c.attempts == 16
    for rb, rc in zip(sim_b.replicas, sim_c.replicas):
        assert set(rc.missed) <= set(rb.missed)


def test_absent_replicas_make_rounds_wait_for_the_deadline(tmp_path):
    _, res = run(tmp_path, participation=0.5, seed=1)
    assert 0 < res.absent < res.attempts
    assert res.closed_by.get("deadline", 0) > 0
    assert res.outcomes["pending"] == res.attempts - res.absent  # with τ generous nothing is late


def test_a_replica_slower_than_the_deadline_is_late(tmp_path):
    # replica 1 of each block has a 0.4 s link: its update lands after τ = 0.5 s, in the next round
    _, res = run(tmp_path / "late", deadline=0.5, delays_s=(0.01, 0.4))
    assert res.outcomes["late"] > 0 and res.outcomes["stale"] == 0
    assert res.closed_by.get("deadline", 0) > 0
    # a 3 s link: by the time its update lands the block has moved on by more than one version
    _, res = run(tmp_path / "stale", deadline=0.5, delays_s=(0.01, 3.0))
    assert res.outcomes["stale"] > 0


def test_training_while_waiting_raises_utilisation(tmp_path):
    # without audits: an audited swarm turns training while waiting off (work folded in cannot be replayed)
    _, idle = run(tmp_path / "idle", delays_s=(0.25,), train_while_waiting=False, audit=0.0)
    _, busy = run(tmp_path / "busy", delays_s=(0.25,), train_while_waiting=True, audit=0.0)
    assert busy.utilisation > idle.utilisation + 0.1
    assert busy.virtual_seconds < idle.virtual_seconds


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError):
        SimConfig(participation=1.5)
    with pytest.raises(ConfigError):
        SimConfig(delay_dist="pareto")
    with pytest.raises(ConfigError):
        SimConfig(delays_s=(-1.0,))
