"""The aggregator's status value: a snapshot taken under each block's lock, which the Status RPC
(rpc/convert.status_to_pb) and /metrics read instead of the aggregator's internals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from procs import honest_terms

import btnode
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.audit import AuditConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.codecs import Codec
from btnode.errors import ConfigMismatchError, MalformedInput
from btnode.model.config import ModelConfig
from btnode.protocol import PushHeader
from btnode.rpc.convert import info_from_pb, model_from_pb, status_to_pb

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=2, context=32, segments=(1, 8))
CLAIMS = ClaimConfig(batch=1, lr=1.0, steps_per_round=4, enforce=True)  # hand-made updates: 4 steps of one window


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def header(worker: str, block: int, uid: str, loss: float = 1.0) -> PushHeader:
    return PushHeader(worker_id=worker, block=block, base_version=0, samples=4.0, loss=loss, codec=Codec.FP32,
                      update_id=uid, steps=(0, 1, 2, 3))  # an honest claim: 4 steps of batch 1 (CLAIMS)


@pytest.fixture
def swarm(tmp_path):
    """Two blocks with two replicas each; block 0 published version 1 and rejected one push, block 1
    has one update in its open round; a refused join; 12 s since the rounds opened."""
    clock = Clock()
    agg = SwarmAggregator(CFG, AggregatorConfig(round=RoundConfig(deadline_s=30.0), claims=CLAIMS,
                                                audit=AuditConfig(share=0.0)), tmp_path, clock=clock)
    for b in (0, 1):
        for w in ("wb", "wa"):
            agg.join(w, b, CFG.fingerprint(), "", training_json=honest_terms(CLAIMS))
    with pytest.raises(ConfigMismatchError):
        agg.join("x", 0, "another run", "{}")
    b0, b1 = agg.block(0), agg.block(1)
    for i, w in enumerate(("wa", "wb")):
        b0.submit(header(w, 0, f"u{i}", loss=1.5 + i), {n: torch.full(s, 0.01 * (i + 1)) for n, s in b0.spec.items()})
    clock.t += 5
    b0.reject(header("wa", 0, "bad"), MalformedInput("norm", "too large"))
    b1.submit(header("wa", 1, "u9"), {n: torch.full(s, 0.02) for n, s in b1.spec.items()})
    clock.t += 7
    return agg


def test_block_status_holds_what_the_block_knows(swarm):
    s0, s1 = (swarm.block(b).status() for b in (0, 1))
    assert (s0.block, s0.current, s0.replicas) == (0, swarm.block(0).info, ("wa", "wb"))
    assert s0.current.version == 1 and s0.accepted_in_round == 0 and s0.round_age_s == 12.0
    assert [r.info.version for r in s0.recent] == [1] and s0.recent[0].info.mean_loss == 2.0
    assert s0.updates == {("pending", ""): 2, ("applied", ""): 2, ("rejected", "norm"): 1}
    assert s0.rounds_closed == {"all_reported": 1}
    assert s1.current.version == 0 and s1.accepted_in_round == 1 and s1.recent == ()
    assert s1.round_age_s == 12.0


def test_status_is_a_snapshot_the_aggregator_does_not_change(swarm):
    before = swarm.status()
    s0 = before.blocks[0]
    swarm.block(0).register("wc")
    swarm.block(0).reject(header("wa", 0, "bad2"), MalformedInput("codec", "no"))
    swarm.count("limited", "join_rate")
    assert s0.replicas == ("wa", "wb") and s0.updates == {("pending", ""): 2, ("applied", ""): 2, ("rejected", "norm"): 1}
    assert ("limited", "join_rate") not in before.events
    with pytest.raises(dataclasses.FrozenInstanceError):
        s0.accepted_in_round = 5  # type: ignore[misc]
    after = swarm.status()
    assert after.blocks[0].replicas == ("wa", "wb", "wc") and after.events[("limited", "join_rate")] == 1


def test_swarm_status_lists_blocks_in_order_and_the_events(swarm):
    s = swarm.status()
    assert s.fingerprint == CFG.fingerprint() and s.config == CFG
    assert [b.block for b in s.blocks] == [0, 1]
    assert s.events == {("joins", ""): 4, ("join_refused", "fingerprint"): 1}
    assert [dict(b.data_keys) for b in s.blocks] == [{"wb": "0/0", "wa": "0/1"}, {"wb": "1/0", "wa": "1/1"}]


def test_the_status_reply_carries_the_snapshot(swarm):
    s = swarm.status()
    reply = status_to_pb(s, server_time_unix=12345.5)
    assert reply.fingerprint == s.fingerprint and model_from_pb(reply.config) == CFG
    assert reply.node_version == btnode.__version__  # the build this node runs
    assert reply.server_time_unix == 12345.5
    assert [b.block for b in reply.blocks] == [0, 1]
    b0 = reply.blocks[0]
    assert info_from_pb(b0.current) == s.blocks[0].current and list(b0.replicas) == ["wa", "wb"]
    assert dict(b0.data_keys) == {"wb": "0/0", "wa": "0/1"} and reply.data_id == ""  # nobody stated a data id
    assert b0.round_age_s == 12.0 and b0.accepted_in_round == 0 and reply.blocks[1].accepted_in_round == 1
    assert [(info_from_pb(r.version), r.closed_at_unix) for r in b0.recent] == [(r.info, r.closed_at)
                                                                                 for r in s.blocks[0].recent]
    counters = [(c.name, dict(c.labels), c.value) for c in reply.counters]
    assert counters == [("updates", {"block": "0", "outcome": "pending", "reason": ""}, 2),
                        ("updates", {"block": "0", "outcome": "applied", "reason": ""}, 2),
                        ("updates", {"block": "0", "outcome": "rejected", "reason": "norm"}, 1),
                        ("updates", {"block": "1", "outcome": "pending", "reason": ""}, 1),
                        ("joins", {"reason": ""}, 4), ("join_refused", {"reason": "fingerprint"}, 1)]
