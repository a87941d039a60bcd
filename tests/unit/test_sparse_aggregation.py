"""Sparse updates at the aggregator (issue #24): held sparse, summed as they arrive into one running sum
(aggregate/sums/accumulate.py), averaged over all updates or over each coordinate's senders, screened by
their cosine with the others, clipped on request, and published through a sparse codec that every
replica applies bit for bit."""

import math

import pytest
import torch

from btnode.aggregate.sums.accumulate import Accumulator, dense
from btnode.aggregate.sums.averaging import OuterConfig, weighted_mean
from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.codec.codecs import Codec, decode, encode
from btnode.codec.sparse import SparseTensor, keep_of
from btnode.protocol import Outcome, PushHeader
from btnode.store.files import state_sha256
from btnode.store.versions import VersionStore

torch.manual_seed(0)
INIT = {"w": torch.randn(64, 128), "b": torch.randn(300)}
CLAIMS = ClaimConfig(batch=1, lr=1.0, steps_per_round=4, enforce=True)


def sparse_update(seed: float, keep: int = 41, codec: Codec = Codec.SPARSE8) -> dict[str, SparseTensor]:
    g = torch.Generator().manual_seed(int(seed * 1000))
    out = {}
    for n, t in INIT.items():
        raw = encode(codec, 0.1 * torch.randn(t.shape, generator=g), keep=keep)
        out[n] = SparseTensor.decode(raw, tuple(t.shape), codec is Codec.SPARSE2)
    return out


def make(tmp_path, **kw) -> BlockAggregator:
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=10.0), claims=CLAIMS, outer=kw.pop("outer", OuterConfig(robust="mean")),
                            **kw)
    return BlockAggregator(0, INIT, VersionStore(tmp_path, 0, keep=acfg.keep), acfg, clock=lambda: 1000.0)


def header(worker, samples=2.0, codec=Codec.SPARSE8):
    return PushHeader(worker_id=worker, block=0, base_version=0, samples=samples, loss=1.0, codec=codec,
                      update_id=f"{worker}-0", steps=tuple(range(int(samples))))


def test_accumulator_all_is_the_weighted_mean_and_senders_divides_by_who_sent():
    ups = [sparse_update(s) for s in (1, 2, 3)]
    weights = [1.0, 2.0, 3.0]
    spec = {n: tuple(t.shape) for n, t in INIT.items()}
    every, senders = Accumulator(spec, "all"), Accumulator(spec, "senders")
    for u, w in zip(ups, weights):
        every.add(u, w)
        senders.add(u, w)
    want = weighted_mean([dense(u) for u in ups], weights)
    got = every.mean()
    assert all(torch.allclose(got[n], want[n], atol=1e-7) for n in INIT)
    by_sender = senders.mean()
    for n in INIT:
        sent = [torch.zeros(INIT[n].numel()).index_fill_(0, u[n].positions, 1.0) for u in ups]
        reached = sum(w * s for w, s in zip(weights, sent))
        flat = sum(w * dense(u)[n].reshape(-1) for w, u in zip(weights, ups))
        expect = torch.where(reached > 0, flat / reached.clamp(min=1e-30), torch.zeros_like(flat))
        assert torch.allclose(by_sender[n].reshape(-1), expect, atol=1e-7)
        only_first = (sent[0] > 0) & (sent[1] == 0) & (sent[2] == 0)
        assert only_first.any()  # a coordinate only the first sent keeps its value under "senders"
        assert torch.allclose(by_sender[n].reshape(-1)[only_first], dense(ups[0])[n].reshape(-1)[only_first])


def test_sparse_updates_stay_sparse_and_the_version_is_their_mean(tmp_path):
    agg = make(tmp_path, sparse_mean="all")
    for w in ("x", "y"):
        agg.register(w)
    ux, uy = sparse_update(1), sparse_update(2)
    agg.submit(header("y", samples=3.0), uy)
    held = agg.round.accepted["y"].delta
    assert all(isinstance(t, SparseTensor) for t in held.values())  # not made dense on arrival
    assert agg.submit(header("x", samples=1.0), ux).outcome is Outcome.PENDING
    info, params = agg.current()
    want = weighted_mean([dense(ux), dense(uy)], [1.0, 3.0])
    assert info.version == 1 and info.accepted == 2
    assert all(torch.allclose(params[n], INIT[n] + want[n], atol=1e-6) for n in INIT)


def test_a_dropped_sparse_update_leaves_the_running_sum(tmp_path):
    agg = make(tmp_path, sparse_mean="all")
    for w in ("x", "y", "z"):
        agg.register(w)
    ups = {w: sparse_update(i + 1) for i, w in enumerate("xyz")}
    agg.submit(header("x"), ups["x"])
    agg.submit(header("y"), ups["y"])
    assert agg.drop("y", "audit_failed")
    agg.submit(header("z"), ups["z"])
    agg.unregister("y")
    info, params = agg.current()
    want = weighted_mean([dense(ups["x"]), dense(ups["z"])], [2.0, 2.0])
    assert info.version == 1 and info.accepted == 2
    assert all(torch.allclose(params[n], INIT[n] + want[n], atol=1e-6) for n in INIT)


def test_screened_drops_a_sign_flipped_sparse_update_by_its_cosine_with_the_others(tmp_path):
    agg = make(tmp_path, outer=OuterConfig(robust="screened"))
    workers = ("a", "b", "c", "d", "e")
    for w in workers:
        agg.register(w)
    g = torch.Generator().manual_seed(7)
    common = {n: 0.1 * torch.randn(t.shape, generator=g) for n, t in INIT.items()}  # honest updates agree
    for i, w in enumerate(workers):
        d = {n: c + 0.02 * torch.randn(c.shape, generator=g) for n, c in common.items()}
        if w == "e":
            d = {n: -t for n, t in d.items()}
        sent = {n: SparseTensor.decode(encode(Codec.SPARSE8, t, keep=410), tuple(t.shape), False) for n, t in d.items()}
        agg.submit(header(w), sent)
    summary = agg.recent[-1]
    assert summary.dropped == (("e", "direction_at_close"),)
    assert summary.info.accepted == 4


def test_clip_scales_a_large_update_to_the_median_norm(tmp_path):
    agg = make(tmp_path, clip=True)
    big = sparse_update(1)
    size = math.sqrt(sum(float(t.values.square().sum()) for t in big.values()))
    agg._norms.extend([size / 3] * 3)  # three accepted updates a third of its size before
    agg.register("x")
    agg.register("y")
    agg.submit(header("x"), big)
    held = agg.round.accepted["x"]
    clipped = held.scale * math.sqrt(sum(float(t.values.square().sum()) for t in held.delta.values()))
    assert held.norm == pytest.approx(size) and clipped == pytest.approx(size / 3, rel=1e-5)  # the norm as sent is kept


@pytest.mark.parametrize("codec", [Codec.SPARSE8, Codec.SPARSE2])
def test_a_sparse_publish_codec_gives_bytes_every_replica_applies_exactly(tmp_path, codec):
    agg = make(tmp_path, publish_codec=codec, publish_density=0.05)
    agg.register("x")
    for v in range(3):
        hx = PushHeader(worker_id="x", block=0, base_version=v, samples=2.0, loss=1.0, codec=Codec.SPARSE8,
                        update_id=f"x-{v}", steps=(0, 1))
        agg.submit(hx, sparse_update(v + 1, keep=410))  # denser than published: some must wait
    replica = {n: t.clone() for n, t in INIT.items()}
    store = VersionStore(tmp_path, 0)
    for v in (1, 2, 3):
        got, raw, _ = store.delta(v)
        assert got is codec
        assert all(len(b) < 4 * INIT[n].numel() / 4 for n, b in raw.items() if INIT[n].numel() >= 4096)
        replica = {n: replica[n] + decode(got, raw[n], tuple(INIT[n].shape)) for n in INIT}
        assert state_sha256(replica) == store.load(v).meta["info"]["sha256"]
    assert agg.residual and any(float(r.abs().sum()) > 0 for r in agg.residual.values())  # what was not sent waits
    assert keep_of(0.05) == 205
