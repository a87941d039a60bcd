"""DiLoCo as a mode of the same swarm (issue #12): a kind="ar" run has one unit, the whole AR model,
and the daemon's own aggregator, worker and simulator train it. In-process, on a virtual clock."""

from __future__ import annotations

import json

import pytest
import torch

from btnode.aggregate.sums.averaging import DILOCO_OUTER, OuterConfig
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec, decode, keep_in
from btnode.codec.sparse import keep_of
from btnode.errors import CheckpointError, ConfigError, ConfigMismatchError
from btnode.model.ar import ByteTransformer
from btnode.model.config import ModelConfig
from btnode.sim.simulator import SimConfig, Simulation
from btnode.store.files import state_sha256
from btnode.store.models import kind_of, load_ar, load_blocks
from btnode.train.config import TrainConfig

BLOCKS = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))
AR = ModelConfig(**{**BLOCKS.to_dict(), "segments": (1, 8), "kind": "ar", "ar_layers": 2})
TC = TrainConfig(steps=40, batch=4, warmup=2)
CORPUS = bytes(range(256)) * 40


def simulate(tmp_path, outer: OuterConfig = DILOCO_OUTER, rounds: int = 3) -> tuple[Simulation, object]:
    scfg = SimConfig(rounds=rounds, replicas=2, steps_per_round=3, step_time_s=0.1, delays_s=(0.02,),
                     delay_dist="fixed", codec=Codec.INT8)
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=1.0), outer=outer, keep=10)
    sim = Simulation(AR, TC, acfg, scfg, CORPUS, tmp_path, device=torch.device("cpu"))
    return sim, sim.run()


def test_the_ar_kind_is_fingerprinted_and_a_block_run_keeps_its_fingerprint():
    assert "kind" not in BLOCKS.to_dict() and "ar_layers" not in BLOCKS.to_dict()
    assert AR.fingerprint() != BLOCKS.fingerprint()
    assert AR.fingerprint() != ModelConfig(**{**AR.to_dict(), "segments": (1, 8), "ar_layers": 3}).fingerprint()
    assert ModelConfig.from_dict(AR.to_dict()) == AR
    assert [f for f, _, _ in BLOCKS.diff(AR)] == ["kind", "ar_layers", "ctx_head"]  # an AR run has no clean head
    assert AR.total_blocks == 1 and AR.unit_name(0) == "ar" and BLOCKS.unit_name(2) == "block 2"


@pytest.mark.parametrize("bad", [dict(kind="dense"), dict(kind="ar", ar_layers=0), dict(ar_layers=2),
                                 dict(kind="ar", ar_layers=2, tail_blocks=1)])
def test_inconsistent_kinds_are_refused(bad):
    with pytest.raises(ConfigError):
        ModelConfig(**bad)


@pytest.mark.parametrize("swarm, worker", [(AR, BLOCKS), (BLOCKS, AR)])
def test_a_worker_of_the_other_kind_is_refused_with_the_fields_named(tmp_path, swarm, worker):
    agg = SwarmAggregator(swarm, AggregatorConfig(), tmp_path)
    with pytest.raises(ConfigMismatchError) as err:
        agg.join("w", 0, worker.fingerprint(), json.dumps(worker.to_dict()))
    assert f"kind: swarm has {swarm.kind!r}, worker has {worker.kind!r}" in str(err.value)


def test_rounds_advance_on_one_unit_and_every_replica_ends_on_the_published_hash(tmp_path):
    sim, res = simulate(tmp_path)
    assert res.versions == {0: 3} and res.outcomes["pending"] == res.outcomes["applied"] == 6 and res.closed_by == {"all_reported": 3}
    agg = sim.agg.block(0)
    assert [r.worker.stats.sha256 for r in sim.replicas] == [agg.info.sha256] * 2
    assert isinstance(sim.replicas[0].worker.trainer.model, ByteTransformer)
    # the versions live in STATE/ar/ (beside the run and its data keys), each exactly its predecessor plus its
    # published delta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ar", "data_keys.json", "run.json", "training.jsonl"]
    for v in range(1, 4):
        before, after = agg.store.load(v - 1).params, agg.store.load(v)
        codec, raw, meta = agg.store.delta(v)
        rebuilt = {n: before[n] + decode(codec, raw[n], tuple(t.shape)) for n, t in before.items()}
        assert state_sha256(rebuilt) == state_sha256(after.params) == meta["info"]["sha256"]
    assert set(agg.store.load(3).outer) == set(agg.params)  # Nesterov buffers, saved with the version


def test_the_same_seeds_give_the_same_versions_bit_for_bit(tmp_path):
    a, _ = simulate(tmp_path / "a")
    b, _ = simulate(tmp_path / "b")
    assert [s.info.sha256 for s in a.agg.block(0).recent] == [s.info.sha256 for s in b.agg.block(0).recent]
    plain, _ = simulate(tmp_path / "plain", outer=OuterConfig())  # plain averaging is another run
    assert plain.agg.block(0).info.sha256 != a.agg.block(0).info.sha256
    assert plain.agg.block(0).store.load(3).outer == {}


def test_the_state_folder_is_an_ar_checkpoint(tmp_path):
    sim, _ = simulate(tmp_path, rounds=2)
    assert kind_of(tmp_path) == "ar"
    newest = load_ar(tmp_path)
    assert newest.cfg == AR and newest.meta["n_layers"] == 2
    assert state_sha256(newest.model.state_dict()) == sim.agg.block(0).info.sha256
    first = load_ar(tmp_path, version=1)
    assert state_sha256(first.model.state_dict()) == sim.agg.block(0).store.load(1).meta["info"]["sha256"]
    with pytest.raises(CheckpointError, match="DiLoCo run"):
        load_blocks(tmp_path)
    again = SwarmAggregator(AR, AggregatorConfig(outer=DILOCO_OUTER), tmp_path)  # a restart resumes it
    assert again.block(0).info == sim.agg.block(0).info
    assert again.block(0).outer.buffers.keys() == sim.agg.block(0).outer.buffers.keys()


@pytest.mark.parametrize("cfg", [AR, BLOCKS], ids=["ar", "blocks"])
def test_sparse_codecs_train_both_kinds_and_every_replica_holds_the_published_hash(tmp_path, cfg):
    """Issue #24: DiLoCo gets the same sparse codecs as BlockTrain (the comparison stays fair): sparse2
    updates at 3 % are all accepted, the sparse8 deltas published at 3 % rebuild each version bit for bit,
    and every replica ends on its unit's published hash."""
    scfg = SimConfig(rounds=3, replicas=2, steps_per_round=3, step_time_s=0.1, delays_s=(0.02,), delay_dist="fixed",
                     codec=Codec.SPARSE2, density=0.03)
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=1.0), outer=DILOCO_OUTER if cfg.kind == "ar" else OuterConfig(),
                            keep=10, publish_codec=Codec.SPARSE8, publish_density=0.03)
    sim = Simulation(cfg, TC, acfg, scfg, CORPUS, tmp_path, device=torch.device("cpu"))
    res = sim.run()
    units = range(cfg.total_blocks)
    assert res.versions == {b: 3 for b in units}
    n = 2 * 3 * len(units)  # every update taken into its round (those held for audit once it passed), and applied
    assert res.outcomes["pending"] == res.outcomes["applied"] == n, res.outcomes
    assert not any(res.outcomes.get(k) for k in ("late", "stale", "rejected", "dropped")), res.outcomes
    for rep in sim.replicas:  # each replica caught up to its unit's newest version, bit for bit
        w = rep.worker
        assert w.stats.sha256 == sim.agg.block(w.wcfg.block).info.sha256
        numel = sum(t.numel() for t in w.base.values())
        assert w.stats.bytes_pushed_raw < 0.03 * 4 * numel * w.stats.pushes  # under 3 % of fp32: sparse2 at 3 %
    for b in units:
        agg = sim.agg.block(b)
        for v in range(1, 4):
            before, after = agg.store.load(v - 1).params, agg.store.load(v)
            codec, raw, meta = agg.store.delta(v)
            assert codec is Codec.SPARSE8 and keep_in(codec, raw) == keep_of(0.03)
            step = {n: decode(codec, raw[n], tuple(t.shape)) for n, t in before.items()}
            assert sum(int(s.count_nonzero()) for s in step.values()) < 0.05 * sum(s.numel() for s in step.values())
            rebuilt = {n: before[n] + step[n] for n in before}
            assert state_sha256(rebuilt) == state_sha256(after.params) == meta["info"]["sha256"]
