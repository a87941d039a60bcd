"""bench/comms.py's own arithmetic: which sparse row is best against int8, what a frame's header costs
beyond its payload, and that one lockstep row trains every round it claims with every push accepted."""

from __future__ import annotations

import pytest

from bench.comms import Row, Settings, all_accepted, best_ratios, framing, grid, levers, model_of, run_row
from bench.comms_wan import INT8, flags_of
from btnode.codec.codecs import Codec
from btnode.codec.frames import Bundle, ChunkData, frame_from_raw
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
