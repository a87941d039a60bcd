"""The sparse codecs' density warm-up (codec/warmup.py, issue #40): its schedule, the flags that set it, and
that workers and aggregator follow it in the simulator while every receiver decodes, audits and applies
their frames as before (a sparse frame names its own keep), and a malformed keep is still refused."""

from __future__ import annotations

import math

import pytest
import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.sums.averaging import OuterConfig
from btnode.codec.codecs import Codec, decode, encode, keep_in
from btnode.codec.profiles import LAN, WAN
from btnode.codec.sparse import CHUNK, decode_sparse, keep_of
from btnode.codec.warmup import FACTOR, NONE, DensityWarmup
from btnode.errors import ConfigError, MalformedInput
from btnode.model.config import ModelConfig
from btnode.settings import build, to_flags
from btnode.sim.simulator import SimConfig, Simulation
from btnode.store.files import state_sha256
from btnode.swarm.worker import BlockWorker, WorkerConfig
from btnode.train.config import TrainConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1,))
TC = TrainConfig(batch=4, steps=40, warmup=2)
CORPUS = bytes(range(256)) * 200


def test_the_schedule_decays_geometrically_from_factor_times_the_final_density_to_it():
    w = DensityWarmup(rounds=10, factor=10.0)
    assert w.density(0.003, 0) == pytest.approx(0.03) and w.density(0.009, 0) == pytest.approx(0.09)
    assert w.density(0.003, 5) == pytest.approx(math.sqrt(0.03 * 0.003))  # halfway in log: the geometric mean
    assert [w.density(0.003, v) for v in (10, 11, 500)] == [0.003] * 3
    d = [w.density(0.003, v) for v in range(12)]
    assert all(a > b for a, b in zip(d[:10], d[1:11]))  # strictly decreasing through the warm-up
    assert [w.keep(0.003, v) for v in (0, 10)] == [keep_of(0.03), keep_of(0.003)]
    assert DensityWarmup(rounds=4, factor=10).density(0.2, 0) == 1.0  # capped at every value
    assert DensityWarmup(rounds=4, factor=10).density(0.2, 2) == pytest.approx(math.sqrt(0.2))
    assert all(NONE.density(0.003, v) == 0.003 for v in range(3))  # rounds 0: none
    assert all(DensityWarmup(rounds=5, factor=1).density(0.003, v) == pytest.approx(0.003) for v in range(7))
    for bad in ({"rounds": -1}, {"factor": 0.5}, {"factor": float("nan")}):
        with pytest.raises(ConfigError, match="--density-warmup"):
            DensityWarmup(**bad)


def test_the_flags_set_it_on_both_sides_and_no_profile_has_one_yet():
    """Declared once (codec/warmup.py), filled on the worker and on the aggregator; without the flags, the
    link's (none for wan and lan: the shipped default is the lead's call after the checks, issue #40)."""
    assert WAN.warmup == LAN.warmup == NONE and (NONE.rounds, NONE.factor) == (0, FACTOR)
    values = {"density_warmup_rounds": 8, "density_warmup_factor": 5.0}
    w, a = build(WorkerConfig, values), build(AggregatorConfig, values)
    assert w.warmup == a.warmup == DensityWarmup(8, 5.0)
    assert build(WorkerConfig, {"density_warmup_rounds": 8}).warmup == DensityWarmup(8, FACTOR)
    assert build(AggregatorConfig, {}).warmup == NONE == AggregatorConfig().warmup
    argv = to_flags(build(WorkerConfig, {"worker_id": "a", "block": 0, **values}))  # what `btnode swarm` hands on
    assert argv[argv.index("--density-warmup-rounds") + 1] == "8"
    assert argv[argv.index("--density-warmup-factor") + 1] == "5.0"


def test_a_frame_at_any_keep_of_the_schedule_decodes_to_what_was_encoded_and_a_bad_keep_is_refused():
    x = torch.randn(3 * CHUNK + 100, generator=torch.Generator().manual_seed(0))
    w = DensityWarmup(rounds=6, factor=10.0)
    for v in range(7):
        for codec in (Codec.SPARSE8, Codec.SPARSE2):
            raw = encode(codec, x, keep=w.keep(0.003, v))
            assert keep_in(codec, {"t": raw}) == w.keep(0.003, v)  # the receiver reads the keep from the bytes
            positions, _ = decode_sparse(raw, x.numel(), codec.two_bit)
            chunks = x.abs().split(CHUNK)  # each chunk's top k_c of |x|, as the encoder chose them
            k = w.keep(0.003, v)
            top = [i * CHUNK + torch.topk(c, -(-k * len(c) // CHUNK)).indices for i, c in enumerate(chunks)]
            assert torch.equal(positions, torch.cat([t.sort().values for t in top]))
            sent = torch.zeros_like(x, dtype=torch.bool).index_fill(0, positions, True)
            assert torch.equal(decode(codec, raw, tuple(x.shape)) != 0, sent)
    raw = bytearray(encode(Codec.SPARSE8, x, keep=w.keep(0.003, 0)))
    for keep in (0, CHUNK + 1):  # outside 1…4096: refused, warm-up or not
        raw[:2] = keep.to_bytes(2, "little")
        with pytest.raises(MalformedInput):
            decode_sparse(bytes(raw), x.numel(), False)
    raw[:2] = keep_of(0.003).to_bytes(2, "little")  # a valid keep the sections do not fit
    with pytest.raises(MalformedInput):
        decode_sparse(bytes(raw), x.numel(), False)


class Recording(BlockWorker):
    """Records (base version, keep) of each update it makes."""

    def __init__(self, *args, **kw):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.sent: list[tuple[int, int]] = []

    def make_update(self):  # type: ignore[no-untyped-def]
        header, raw = super().make_update()
        self.sent.append((header.base_version, keep_in(header.codec, raw)))
        return header, raw


def test_workers_and_aggregator_follow_the_schedule_and_every_update_replays_and_applies(tmp_path):
    """Sparse8 at 0.3 % up and 0.9 % published, warmed up over 3 versions from 10×: each update and each
    published delta has its version's keep, every update is audited (p = 1) and passes its replay (the
    auditor reads the keep from the bytes), and every replica ends on the published hash."""
    warm, rounds = DensityWarmup(rounds=3, factor=10.0), 5
    scfg = SimConfig(rounds=rounds, replicas=3, steps_per_round=2, delays_s=(0.02,), delay_dist="fixed",
                     codec=Codec.SPARSE8, density=0.003, warmup=warm, audit=1.0, probation=0)
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=10.0), keep=rounds + 1, publish_codec=Codec.SPARSE8,
                            publish_density=0.009, warmup=warm,
                            outer=OuterConfig(robust="mean"))  # (the screen drops some of so small a block's updates)
    sim = Simulation(CFG, TC, acfg, scfg, CORPUS, tmp_path, device=torch.device("cpu"),
                     workers={f"b0r{r}": Recording for r in range(3)})
    res = sim.run()
    assert res.versions == {0: rounds}
    assert res.outcomes.get("applied") == 3 * rounds and not res.outcomes.get("dropped"), res.outcomes
    assert len(sim.verdicts) == 3 * rounds and all(v.passed for v in sim.verdicts)
    keeps = [warm.keep(0.003, v) for v in range(rounds)]
    assert keeps[0] == keep_of(0.03) > keeps[1] > keeps[2] > keeps[3] == keeps[4] == keep_of(0.003)
    for r in range(3):
        w = sim.worker(f"b0r{r}")
        assert w.sent == list(enumerate(keeps)) and w.stats.sha256 == sim.agg.block(0).info.sha256
    agg = sim.agg.block(0)
    for v in range(1, rounds + 1):
        codec, raw, meta = agg.store.delta(v)
        assert codec is Codec.SPARSE8 and keep_in(codec, raw) == warm.keep(0.009, v - 1)
        before = agg.store.load(v - 1).params
        rebuilt = {n: before[n] + decode(codec, raw[n], tuple(t.shape)) for n, t in before.items()}
        assert state_sha256(rebuilt) == meta["info"]["sha256"]
