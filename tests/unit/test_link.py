"""--link: the codecs a node started from the command line uses when no codec flag sets them
(btnode/codec/profiles.py, docs/tuning.md): wan by default (sparse8 up at 3 % with error feedback,
sparse8 published at 9 %; DiLoCo sparse2 at 2 % and 4 %), lan the old int8 up / fp32 down; a codec flag wins;
the dataclasses themselves (in-process tools) keep lan."""

from __future__ import annotations

import pytest

from pathlib import Path

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.sums.averaging import DILOCO_OUTER
from btnode.codec.codecs import Codec
from btnode.codec.profiles import SHORT_ROUNDS_AR, link_codecs
from btnode.errors import ConfigError
from btnode.settings import build
from btnode.swarm.worker import WorkerConfig


TUNING = Path(__file__).resolve().parents[2] / "docs" / "tuning.md"


def test_the_command_line_default_is_sparse_for_blocktrain_and_int8_for_diloco():
    w, a = build(WorkerConfig, {}), build(AggregatorConfig, {})
    assert (w.link, w.codec, w.density, w.error_feedback, w.fallback) == ("wan", Codec.SPARSE8, 0.03, True, Codec.INT8)
    assert (a.link, a.publish_codec, a.publish_density) == ("wan", Codec.SPARSE8, 0.09)
    # DiLoCo's sparse setting passed at H = 5 only (+0.16 at the daemon's H = 50): int8 up, fp32 down
    w, a = build(WorkerConfig, {"model": "ar"}), build(AggregatorConfig, {"model": "ar"})
    assert (w.codec, a.publish_codec) == (Codec.INT8, Codec.FP32) and w.steps_per_round == 50
    s = SHORT_ROUNDS_AR  # one flag away
    w = build(WorkerConfig, {"model": "ar", "codec": "sparse2", "density": s.density})
    a = build(AggregatorConfig, {"model": "ar", "publish_codec": "sparse2", "publish_density": s.publish_density})
    assert (w.codec, w.density, w.error_feedback, a.publish_codec, a.publish_density) == (
        s.codec, s.density, True, s.publish_codec, s.publish_density)
    assert (a.outer.lr, a.outer.momentum) == (1.0, 0.3)  # DILOCO_OUTER, whatever the link
    a = build(AggregatorConfig, {"model": "ar", "link": "lan"})
    assert (a.publish_codec, a.outer.lr, a.outer.momentum) == (Codec.FP32, 1.0, 0.3)
    old = build(AggregatorConfig, {"model": "ar", "outer_lr": 0.7, "outer_momentum": 0.9})  # one flag away
    assert (old.outer.lr, old.outer.momentum) == (0.7, 0.9)


def test_tuning_md_states_the_defaults_the_profiles_set():
    """docs/tuning.md's table of --link rows names each profile's codecs, and DiLoCo's row its outer step."""
    rows = {line.split("|")[1].strip(): line for line in TUNING.read_text().splitlines() if line.startswith("| `")}

    def at(codec: Codec, density: float) -> str:  # a dense codec has no density
        return f"{codec.name.lower()} at {100 * density:g} %" if codec.name.startswith("SPARSE") else codec.name.lower()

    for key, (kind, link) in {"`wan` (default)": ("block", "wan"), "`wan`, `--model ar` (DiLoCo)": ("ar", "wan")}.items():
        c = link_codecs(link, kind)
        cells = [x.strip() for x in rows[key].split("|")[2:4]]
        assert cells[0].startswith(at(c.codec, c.density)) and cells[1].startswith(at(c.publish_codec, c.publish_density)), cells
    assert f"η = {DILOCO_OUTER.lr:g}, μ = {DILOCO_OUTER.momentum:g}" in rows["`wan`, `--model ar` (DiLoCo)"]


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
