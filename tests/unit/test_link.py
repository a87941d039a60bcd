"""--link: the codecs a node started from the command line uses when no codec flag sets them
(btnode/codec/profiles.py, docs/tuning.md): wan by default (sparse8 up at 3 % with error feedback,
sparse8 published at 9 %; DiLoCo as lan), lan the old int8 up / fp32 down; a codec flag wins;
the dataclasses themselves (in-process tools) keep lan."""

from __future__ import annotations

import pytest

from btnode.aggregate.round.config import AggregatorConfig
from btnode.codec.codecs import Codec
from btnode.codec.profiles import link_codecs
from btnode.errors import ConfigError
from btnode.settings import build
from btnode.swarm.worker import WorkerConfig


def test_the_command_line_default_is_sparse_for_blocktrain_and_int8_up_fp32_down_for_diloco():
    w, a = build(WorkerConfig, {}), build(AggregatorConfig, {})
    assert (w.link, w.codec, w.density, w.error_feedback, w.fallback) == ("wan", Codec.SPARSE8, 0.03, True, Codec.INT8)
    assert (a.link, a.publish_codec, a.publish_density) == ("wan", Codec.SPARSE8, 0.09)
    w, a = build(WorkerConfig, {"model": "ar"}), build(AggregatorConfig, {"model": "ar"})
    assert (w.codec, w.fallback, a.publish_codec) == (Codec.INT8, None, Codec.FP32)
    assert (a.outer.lr, a.outer.momentum) == (0.7, 0.9)  # DiLoCo's outer step is untouched by the link


def test_lan_is_the_old_default_and_codec_flags_win_over_the_link():
    w, a = build(WorkerConfig, {"link": "lan"}), build(AggregatorConfig, {"link": "lan"})
    assert (w.codec, w.fallback, a.publish_codec) == (Codec.INT8, None, Codec.FP32)
    w = build(WorkerConfig, {"codec": "sparse2", "density": 0.03})
    assert (w.codec, w.density, w.fallback) == (Codec.SPARSE2, 0.03, None)  # the user's: never swapped for int8
    a = build(AggregatorConfig, {"publish_codec": "int8"})
    assert (a.publish_codec, a.publish_density) == (Codec.INT8, 0.09)  # the density stays the link's
    assert AggregatorConfig().publish_codec is Codec.FP32 and AggregatorConfig().link == "lan"  # in process: lan


def test_an_unknown_link_is_refused():
    with pytest.raises(ConfigError, match="--link"):
        build(WorkerConfig, {"link": "satellite"})
    with pytest.raises(ConfigError, match="--link"):
        link_codecs("satellite")


def test_a_profile_chosen_codec_passes_on_as_flags_with_its_fallback():
    """`btnode swarm` hands its workers their config as flags (settings.to_flags): the int8 fallback of a
    profile's sparse codec goes with it, so a worker it starts behind a relay still falls back."""
    from btnode.settings import to_flags

    w = build(WorkerConfig, {"worker_id": "a", "block": 0})
    argv = to_flags(w)
    assert argv[argv.index("--codec-fallback") + 1] == "int8" and argv[argv.index("--link") + 1] == "wan"
    assert "--codec-fallback" not in to_flags(build(WorkerConfig, {"worker_id": "a", "block": 0, "link": "lan"}))
