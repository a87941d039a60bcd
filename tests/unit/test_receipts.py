"""Round receipts (aggregate/round/receipts.py): an update taken into a round is answered PENDING, and once
its round closes it is APPLIED or DROPPED with the reason, on its sender's identity record too."""

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.aggregate.sums.averaging import OuterConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.codecs import Codec
from btnode.errors import MalformedInput
from btnode.model.config import ModelConfig
from btnode.node.metrics import AggregatorCollector
from btnode.protocol import Outcome, PushHeader, RoundReceipt
from btnode.rpc.convert import round_receipt_from_pb, round_receipt_to_pb, status_to_pb

CFG = ModelConfig(d_model=16, n_heads=2, n_layers=1, n_blocks=1, context=16, segments=(1,))


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def swarm(tmp_path, clock=None) -> SwarmAggregator:
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=10.0), outer=OuterConfig(robust="screened"),
                            claims=ClaimConfig(enforce=False))
    return SwarmAggregator(CFG, acfg, tmp_path, clock=clock or Clock())


def header(worker, base, uid=None):
    return PushHeader(worker_id=worker, block=0, base_version=base, samples=1.0, loss=1.0, codec=Codec.FP32,
                      update_id=uid or f"{worker}-{base}", steps=(0,))


def along(block, scale, flip=False, seed=None):
    """A delta of `scale` along one fixed direction (sign-alternated with `flip`: off the others' course),
    with noise of its own when `seed` is given: honest replicas are alike (cosine ≈ 0.9), not copies,
    which the screen counts as one vote (round/screen.py)."""
    out = {}
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    for n, s in block.spec.items():
        t = torch.ones(s).view(-1)
        if flip:
            t[1::2] = -1.0
        if g is not None:
            t = t + 0.35 * torch.randn(t.shape, generator=g)
        out[n] = (scale * t).view(s)
    return out


def screened_round(agg):
    """Five updates into round 0: three alike, one of zero norm, one off course; all report, so it closes."""
    b = agg.block(0)
    sent = {"a": along(b, 1e-3, seed=1), "b": along(b, 1.1e-3, seed=2), "c": along(b, 1.05e-3, seed=3), "d": along(b, 0.0),
            "e": along(b, 1e-3, flip=True)}
    for w in sent:
        b.register(w)
    answers = {w: b.submit(header(w, 0), d) for w, d in sent.items()}
    return b, answers


def test_a_screened_out_update_is_pending_on_arrival_and_dropped_with_its_reason_at_close(tmp_path):
    agg = swarm(tmp_path)
    b, answers = screened_round(agg)
    assert {w: j.outcome for w, j in answers.items()} == dict.fromkeys("abcde", Outcome.PENDING)  # none says applied
    assert b.info.version == 1 and b.recent[-1].dropped == (("d", "norm_at_close"), ("e", "direction_at_close"))
    assert b.receipt("a", "a-0") == RoundReceipt("a-0", Outcome.APPLIED, 1)
    assert b.receipt("d", "d-0") == RoundReceipt("d-0", Outcome.DROPPED, 1, "norm_at_close")
    assert b.receipts_for("e", 1) == (RoundReceipt("e-0", Outcome.DROPPED, 1, "direction_at_close"),)
    assert b.receipt("a", "d-0") is None and b.receipts_for("d", 2) == ()  # only its sender's, only that version's
    again = b.submit(header("d", 0), along(b, 0.0))  # a re-push of it now hears the final word
    assert (again.outcome, again.reason) == (Outcome.DROPPED, "norm_at_close")
    assert b.counters[("pending", "")] == 5 and b.counters[("applied", "")] == 3
    assert b.counters[("dropped", "norm_at_close")] == b.counters[("dropped", "direction_at_close")] == 1


def test_the_identity_record_counts_each_drop_and_status_and_metrics_show_it(tmp_path):
    agg = swarm(tmp_path)
    screened_round(agg)
    recs = {r.name: r for r in agg.identities.records()}
    assert (recs["a"].applied, dict(recs["a"].dropped)) == (1, {})
    assert (recs["d"].applied, dict(recs["d"].dropped)) == (0, {"norm_at_close": 1})
    assert agg.identities.drops("e") == agg.identities.drops("d") == 1 and agg.identities.drops("a") == 0
    assert agg.identities.drops("never-seen") == 0
    reply = status_to_pb(agg.status(), server_time_unix=0.0)
    shown = {r.name: (r.applied, dict(r.dropped)) for r in reply.identities}
    assert shown["e"] == (0, {"direction_at_close": 1}) and shown["b"] == (1, {})
    registry = CollectorRegistry()
    registry.register(AggregatorCollector(agg))
    text = generate_latest(registry).decode()
    assert "btnode_identities_dropped 2.0" in text and "btnode_identity_drops_max 1.0" in text, text
    assert 'btnode_updates_total{block="0",outcome="dropped",reason="norm_at_close"} 1.0' in text, text


def test_a_revoked_or_failed_update_is_dropped_with_its_reason_and_a_held_one_too(tmp_path):
    agg = swarm(tmp_path)
    b = agg.block(0)
    for w in ("a", "b", "h"):
        b.register(w)
    b.submit(header("a", 0), along(b, 1e-3))
    held = b.submit(header("h", 0), along(b, 1e-3), hold=True)
    assert held.outcome is Outcome.PROBATION
    agg.replays.drop("a", "revoked")  # as SwarmAggregator.revoke does
    agg.replays.drop("h", "audit_delta")  # as a failed audit does (ReplayDesk.punish)
    assert b.receipt("a", "a-0") == RoundReceipt("a-0", Outcome.DROPPED, 1, "revoked")
    assert b.receipt("h", "h-0") == RoundReceipt("h-0", Outcome.DROPPED, 1, "audit_delta")
    assert b.info.version == 0 and not b.round.accepted  # nothing of either is in the round
    assert {r.name: dict(r.dropped) for r in agg.identities.records()} == {"a": {"revoked": 1}, "h": {"audit_delta": 1}}
    assert agg.identities.drops("a") == 0  # a revocation or an audit is not the screen's judgement


def test_an_update_held_past_its_round_is_dropped_at_the_close_and_stays_so(tmp_path):
    agg = swarm(tmp_path)
    b = agg.block(0)
    for w in ("a", "h"):
        b.register(w)
    assert b.submit(header("h", 0), along(b, 1e-3), hold=True).outcome is Outcome.PROBATION
    b.submit(header("a", 0), along(b, 1e-3))
    agg.clock.t += 11  # the deadline: round 0 closes without the held update, still under audit
    b.tick()
    assert b.info.version == 1 and b.receipt("h", "h-0") == RoundReceipt("h-0", Outcome.DROPPED, 1,
                                                                         "audited_after_close")
    assert not b.admit_held("h-0")  # its audit passes too late: it stays out, and its receipt stays as it was
    assert b.receipt("h", "h-0").reason == "audited_after_close" and b.info.version == 1
    assert {r.name: (r.applied, dict(r.dropped)) for r in agg.identities.records()} == {
        "a": (1, {}), "h": (0, {"audited_after_close": 1})}


def test_a_receipt_crosses_the_wire_and_a_peer_cannot_send_another_outcome():
    r = RoundReceipt("u1", Outcome.DROPPED, 4, "direction_at_close")
    assert round_receipt_from_pb(round_receipt_to_pb(r)) == r
    bad = round_receipt_to_pb(RoundReceipt("u1", Outcome.APPLIED, 4))
    bad.outcome = 6  # PENDING is an answer, never a receipt
    with pytest.raises(MalformedInput):
        round_receipt_from_pb(bad)
