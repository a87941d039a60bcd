"""bench/scale.py: a tiny flat run through a real aggregator counts every update and fills the result's
fields; the tally calls an accepted update missing from its version lost."""

from __future__ import annotations

import json

from bench.scale import QUICK_SHAPE, Tally, current, finish, render, run_row


def test_an_accepted_update_missing_from_its_version_is_lost():
    def push(v: int, outcome: str = "accepted") -> dict:
        return {"kind": "push", "version": v, "outcome": outcome}

    def version(v: int, accepted: int) -> dict:
        return {"kind": "version", "version": v, "accepted": accepted, "rejected": 0}

    whole = Tally.of([push(0), push(0), push(0, "late"), version(1, 2), push(1), version(2, 1)])
    assert whole.lost() == 0 and whole.outcomes == {"accepted": 3, "late": 1}
    short = Tally.of([push(0), push(0), version(1, 1), push(1)])  # round 1 never published
    assert short.lost() == 2
    extra = Tally.of([push(0), version(1, 3), push(1), push(1), version(2, 1)])  # 2 answers lost with their workers
    assert extra.lost() == 1


def test_a_tiny_flat_run_counts_every_update(tmp_path):
    n, rounds = 4, 2
    row = run_row(QUICK_SHAPE, n, "flat", tmp_path / "run", rounds=rounds, deadline=30)
    assert row["lost"] == 0 and row["refused"] == 0 and row["errors_by_call"] == {}
    assert row["accepted_told"] == row["published_accepted"] == n * rounds
    assert row["outcomes"] == {"pending": n * rounds} and row["rounds_published"] == rounds
    assert set(row["closed_by"].values()) == {"all_reported"}
    assert row["pulls_served"] == n and row["delta_fetches_served"] == n * rounds
    assert 0 < row["root_ingress_mb"] < row["root_egress_mb"]  # int8 up, fp32 deltas down to every worker
    assert 50 < row["root_peak_rss_mb"] < 4000 and row["root_cpu_s"] > 0
    assert 0 <= row["close_s"] < 30 and 0 < row["max_watchdog_gap_s"] < 30
    res = {"command": "x", "date": "d", "machine": "m", "setup": "s", "code": "c", "block_params": 1, "block_fp32_mb": 1.0,
           "idle_rss_mb": 1.0, "rows": [{**row, "code": "c", "kill": False}]}
    finish(res)
    json.dumps(res)
    assert f"| c | {n} | flat | {row['root_peak_rss_mb']:,.0f} |" in render(res)


def test_where_versions_name_their_updates_lost_is_counted_by_id():
    told = [{"kind": "push", "version": 0, "outcome": "accepted", "update_id": u} for u in ("a", "b", "c")]
    named = [{"kind": "version", "version": 1, "accepted": 3, "rejected": 0, "included": ["a", "c", "x"]}]
    assert Tally.of(told + named).lost() == 1  # "b": the count matches, the ids do not
    assert Tally.of(told + [{**named[0], "included": ["a", "b", "c"]}]).lost() == 0
    t = Tally.of([{**e, "src": 1, "peer": "r1", "worker": f"w{e['update_id']}"} for e in told] + named)
    assert t.lost_by_cause({1}, {"r1"}) == {"worker and relay killed": 1} and t.lost_by_cause({1}, set()) == {"other": 1}
    assert t.screened({(0, "wb"), (1, "wa")}) == 1 and t.lost() == 0  # the screen dropped b's at close: not lost


def test_the_fits_read_the_last_default_rows_not_levers_fixed_relays_or_kills():
    def row(code: str, topology: str = "tree", **extra: object) -> dict:
        return {"code": code, "topology": topology, "n_workers": 16, "kill": False, **extra}

    rows = [row("a"), row("a", "flat"), row("b"), row("b", kill=True), row("lever-x"), row("c-r16", relays_fixed=16)]
    assert [(r["code"], r["topology"]) for r in current({"rows": rows})] == [("a", "flat"), ("b", "tree")]


def test_a_later_round_kill_run_reports_lost_over_its_rows_and_its_slowest_recovery():
    from bench.scale import metrics

    row = {"n_workers": 32, "topology": "tree", "root_peak_rss_mb": 600.0, "close_s": 0.5, "kill": True}
    rows = [{**row, "kill_round": 1, "levels": 1, "lost": 0, "next_version_after_kill_s": 8.0},
            {**row, "kill_round": 1, "levels": 2, "lost": 2, "next_version_after_kill_s": 130.0}]
    m = metrics({"rows": rows})
    assert m == {"N = 32, a relay killed in round 1: lost": 2,
                 "N = 32, a relay killed in round 1: next version (s), slowest": 130.0}
    refused = [{"kind": "refused", "call": "push", "code": "ABORTED", "reason": "join_pending"},
               {"kind": "refused", "call": "push", "code": "INTERNAL"}, {"kind": "rejoined"}]
    t = Tally.of(refused)
    assert t.refused_reasons == {"push:join_pending": 1, "push:INTERNAL": 1} and t.rejoined == 1
