"""bench/comms.py's own arithmetic: which sparse row is best against int8, what a frame's header costs
beyond its payload, and that one lockstep row trains every round it claims with every push accepted."""

from __future__ import annotations

import pytest

from bench.comms import (Row, Settings, all_accepted, best_ratios, framing, grid, levers, model_of, run_row, steady,
                         steady_ratios)
from bench.comms_wan import INT8, flags_of
from btnode.codec.codecs import Codec
from btnode.codec.frames import Bundle, ChunkData, frame_from_raw
from btnode.codec.warmup import DensityWarmup
from btnode.model.config import ModelConfig
from btnode.rpc.convert import chunk_to_pb

TINY = ModelConfig(d_model=16, n_heads=2, n_layers=1, n_blocks=2, context=16, segments=(1, 4))


def row(codec: str, up: float, down: float, ce: float, *, publish: str = "fp32", lever: str = "") -> dict:
    return {"model": "block", "codec": codec, "publish_codec": publish, "bytes_up": up, "bytes_down": down, "ce": ce,
            "header_up": 1, "header_down": 1,
            "lever": lever, "label": f"{codec} {up}", "density": 0.01, "publish_density": 0.01, "aggregator": {}, "outer": None}


def test_the_best_ratio_is_the_cheapest_sparse_row_within_two_hundredths_of_int8():
    rows = [row("int8", 100, 400, 2.00), row("int8", 100, 100, 1.90, publish="int8"), row("fp32", 400, 400, 1.99),
            row("sparse8", 5, 5, 2.019), row("sparse2", 2, 3, 2.021), row("sparse2", 4, 6, 2.01, lever="publish")]
    best = best_ratios(rows)["block"]
    assert best["ratio"] == pytest.approx(500 / 10) and best["row"] == "sparse8 5"  # 2.021 is past the cut
    assert best["setting"]["codec"] == "sparse8"
    assert best_ratios([row("int8", 100, 400, 2.0), row("sparse2", 1, 1, 2.5)])["block"]["ratio"] is None


def test_framing_is_the_chunk_messages_less_their_payload():
    f = frame_from_raw("blocks.0.attn.weight", (16, 48), Codec.INT8, bytes(800))
    extra = framing(f.chunks())
    assert extra == chunk_to_pb(ChunkData(f.header, f.payload)).ByteSize() - len(f.payload)
    assert 32 + len(f.header.name) < extra < 120  # the sha256 and the name are most of it
    raw = [(f"t{i}", bytes(50 + i)) for i in range(40)]
    sparse = framing(Bundle(Codec.SPARSE8, raw).chunks())  # one header for 40 tensors: the digest and a size each
    assert 32 + 40 <= sparse < 32 + 40 + 20


def test_the_grid_has_every_codec_and_density_for_each_model():
    rows = grid(["block", "ar"], [0.1, 0.01])
    assert len(rows) == 2 * (3 + 2 * 2)
    assert all(r.publish_density == min(1.0, 3 * r.density) for r in rows if r.codec.sparse)
    labels = {r.label for r in levers(["ar"], [0.01])}
    assert labels >= {"sparse2@0.01 / publish fp32", "sparse2@0.01 / publish sparse8@0.01",
                      "sparse8@0.01 / publish sparse8@0.03, outer η=1 μ=0", "int8 / publish fp32, outer η=1 μ=0",
                      "int8 / publish fp32, outer η=0.7 μ=0.9"}  # DiLoCo's own step, the default before #40
    ar = [r for r in grid(["ar"], [0.02], Codec.SPARSE2, 2) if r.codec.sparse]  # --publish-codec, --publish-factor
    assert {(r.publish, r.publish_density) for r in ar} == {(Codec.SPARSE2, 0.04)}
    assert model_of(TINY, "ar").ar_layers == 2 and model_of(TINY, "block") == TINY


def test_a_lockstep_row_trains_every_round_and_counts_both_directions():
    s = Settings(TINY, rounds=2, h=1, batch=2, lr=2e-3, replicas=2, windows=4)
    dense, sparse = run_row(Row("block", Codec.INT8), s), run_row(Row("block", Codec.SPARSE2, 0.01, Codec.SPARSE8, 0.01), s)
    for r in (dense, sparse):
        assert all_accepted(r) and r["versions"] == 2 and r["pushes"] == 2 * 2 * 2
        assert r["header_up"] > 0 and r["header_down"] > 0
    assert sparse["bytes_up"] < dense["bytes_up"] / 4 and sparse["bytes_down"] < dense["bytes_down"] / 4


def test_a_frontier_setting_becomes_the_flags_of_real_nodes():
    setting = {"codec": "sparse2", "density": 0.01, "publish_codec": "sparse8", "publish_density": 0.03,
               "aggregator": {"sparse_mean": "all", "clip": True}, "outer": [1.0, 0.0]}
    assert flags_of(setting) == (["--codec", "sparse2", "--density", "0.01"],
                                 ["--publish-codec", "sparse8", "--publish-density", "0.03", "--sparse-mean", "all", "--clip",
                                  "--outer-lr", "1", "--outer-momentum", "0"])
    assert flags_of(INT8) == (["--codec", "int8"], ["--publish-codec", "fp32"])


def test_a_density_warm_up_row_sends_more_first_and_reports_its_steady_state():
    """Issue #40: the grid's sparse rows once per warm-up; a warm-up row's bytes fall round by round to
    the steady state it reports apart from the mean over the run, which it keeps."""
    rows = grid(["block"], [0.003], codecs=[Codec.SPARSE8], warmups=[DensityWarmup(), DensityWarmup(10)])
    assert [r.label for r in rows if r.codec.sparse] == ["sparse8@0.003 / publish sparse8@0.009",
                                                         "sparse8@0.003 / publish sparse8@0.009, warm-up 10 from 10×"]
    assert Row("block", Codec.INT8, warmup=DensityWarmup(10)).label == "int8 / publish fp32"  # nothing to warm up
    s = Settings(TINY, rounds=3, h=1, batch=2, lr=2e-3, replicas=2, windows=4)
    r = run_row(Row("block", Codec.SPARSE8, 0.01, Codec.SPARSE8, 0.03, warmup=DensityWarmup(2, 10.0)), s)
    assert all_accepted(r) and r["warmup"] == [2, 10.0] and len(r["bytes_by_round"]) == 3
    (u0, d0), (u1, d1), (u2, d2) = r["bytes_by_round"]
    assert u0 > u1 > u2 and d0 > d1 > d2
    assert (r["bytes_up_steady"], r["bytes_down_steady"]) == (u2, d2)
    assert r["bytes_up"] == pytest.approx((u0 + u1 + u2) / 3) and r["bytes_down"] == pytest.approx((d0 + d1 + d2) / 3)
    assert steady(r["bytes_by_round"], 0) == (pytest.approx(r["bytes_up"]), pytest.approx(r["bytes_down"]))
    ref = {**row("int8", 100, 400, 2.0), "header_up": 5, "header_down": 5}
    warm = {**row("sparse8", 3, 7, 2.01), "bytes_up_steady": 1, "bytes_down_steady": 4, "warmup": [10, 10.0]}
    [x] = steady_ratios([ref, warm])
    assert (x["ratio"], x["ratio_steady"], x["ratio_steady_with_headers"]) == (50, 100, 510 / 7)
    assert x["delta_ce"] == pytest.approx(0.01)
    assert flags_of({**INT8, "codec": "sparse8", "density": 0.003, "warmup": [10, 10.0]})[0][-4:] == [
        "--density-warmup-rounds", "10", "--density-warmup-factor", "10"]
