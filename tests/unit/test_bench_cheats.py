"""bench/cheats.py at a tiny size, in process: a new row (the 3-of-5 Sybil) and the honest swarm it is
measured against are run and every published field is computed from them. Whether the attack is
stopped is the bench's to say, not this test's."""

from __future__ import annotations

import argparse
from dataclasses import replace
import math
from concurrent.futures import Future

import pytest

from btnode.codec.codecs import Codec

from bench.cheats import MODES, ROW_FIELDS, config, differences, measure, metrics, record, render
from btnode.aggregate.round.config import AggregatorConfig


class Inline:
    """An executor that runs each call at once (the bench's pool, without processes)."""

    def submit(self, fn, *args):  # type: ignore[no-untyped-def]
        f: Future = Future()
        f.set_result(fn(*args))
        return f


def test_a_quick_sybil_row_has_every_field_computed():
    args = argparse.Namespace(rounds=2, h=3, batch=4, windows=4, seeds=1, cheats=["sybil3"], modes=["default"],
                              quick=True, jobs=1, link="wan", density=None, publish_density=None, robust=None)
    res = measure(args, Inline())  # type: ignore[arg-type]
    out = record(args, res, res["rows"], wall_s=0.0)
    [row] = out["rows"]
    assert all(f in row for f in ROW_FIELDS) and (row["cheat"], row["mode"], row["ids"]) == ("sybil3", "default", 3)
    assert math.isfinite(row["delta_ce"]) and row["delta_ce_runs"] == [row["delta_ce"]]
    # every version was scored, the last one being the final model: its ΔCE is among the peak's candidates
    assert row["peak_delta_ce"] >= row["delta_ce"] - 1e-9 and row["versions"] == [args.rounds]
    assert isinstance(row["revoked"], bool) and len(row["caught_round_runs"]) == 1
    assert out["default_config"]["audit"]["share"] == AggregatorConfig().audit.share  # as a fresh aggregator holds it
    assert set(out["sim_sets"]) <= {"claims.batch", "claims.lr", "claims.steps_per_round", "audit.state_timeout_s"}
    assert out["false_positives"] >= 0 and out["unmeasured"] == []  # the watch rows run outside (bench/cheats_watch.py)
    # the honest replicas alone (the 3 ids absent): the gap it leaves is the attack's compute, not its harm
    assert math.isfinite(row["delta_ce_vs_alone"]) and len(row["alone_minus_honest_runs"]) == 1
    m = metrics(out)
    assert m["rows run"] == 1 and m["worst ΔCE (nats/byte)"] == row["delta_ce"]
    assert "| sybil3 | default | 3 |" in render(out)


def test_differences_names_the_leaves_that_changed():
    assert differences({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 1, "c": 5}, "d": 3}) == {"a.c": 5}


def test_mode_open_turns_the_config_s_open_switch_on_or_fails_loudly_without_one():
    # the daemon's defaults: a fresh AggregatorConfig with the wan link's publish codec (codec/profiles.py)
    assert config("default") == replace(AggregatorConfig(), link="wan", publish_codec=Codec.SPARSE8,
                                        publish_density=0.09) and MODES == ("default", "open")
    assert config("default", "lan") == AggregatorConfig()
    if "open" in AggregatorConfig.__dataclass_fields__:
        assert config("open").open is True  # type: ignore[attr-defined]
    else:
        with pytest.raises(SystemExit, match="AggregatorConfig.open"):
            config("open")


def test_the_watch_rows_are_refused_and_hold_no_stream():
    """Real gRPC with identities: a Watch under a foreign, never-joined or revoked id is refused with its
    reason, no stream stays open, and the revoked one's open stream ended."""
    from bench.cheats_watch import watch_rows

    rows = {r["cheat"]: r for r in watch_rows(argparse.Namespace())}
    assert {c: r["refused"] for c, r in rows.items()} == {"watch_foreign": "name", "watch_never_joined": "not_joined",
                                                          "watch_revoked": "revoked"}
    assert not any(r["stream_held"] for r in rows.values())
    assert {c: r["revoked"] for c, r in rows.items()} == {"watch_foreign": True, "watch_never_joined": False,
                                                          "watch_revoked": True}  # impersonation revokes
    assert rows["watch_revoked"]["held_before"] and rows["watch_revoked"]["stream_end_s"] is not None


def test_a_density_warm_up_from_the_flags_reaches_the_workers_codecs_and_the_aggregator():
    from bench.cheats import codecs_of, warmup_of
    from btnode.codec.warmup import FACTOR, DensityWarmup

    given = argparse.Namespace(link="wan", density_warmup_rounds=10, density_warmup_factor=None)
    w = warmup_of(given)
    assert w == DensityWarmup(10, FACTOR)
    assert codecs_of("wan", 0.003, 0.009, w).warmup == w == config("default", "wan", 0.009, None, w).warmup
    assert warmup_of(argparse.Namespace(link="wan", density_warmup_rounds=None, density_warmup_factor=None)) is None
    assert config("default").warmup == codecs_of("wan").warmup  # the link's (none yet)
