"""What a worker does with its answers and round receipts (swarm/worker.py): on probation it keeps its
error-feedback residual, and the chain of claims stays whole whether the held update gets in or comes too
late. BlockWorker against an in-process aggregator replaying every update (LocalLink, a fake clock)."""

from __future__ import annotations

import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.aggregate.trust.audit import AuditConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.codecs import Codec
from btnode.model.config import ModelConfig
from btnode.protocol import EMPTY_STATE, Outcome, PushHeader, RoundReceipt
from btnode.sim.link import LocalLink
from btnode.store.files import state_sha256
from btnode.swarm.worker import BlockWorker, WorkerConfig
from btnode.train.config import TrainConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1,))
TC = TrainConfig(steps=100, batch=4, warmup=2)
CORPUS = bytes(range(256)) * 40
H = 2


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def audited(tmp_path):
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=30.0), claims=ClaimConfig.of(TC, H),
                            audit=AuditConfig(share=1.0, probation=1))
    agg = SwarmAggregator(CFG, acfg, tmp_path, corpus=CORPUS, clock=Clock())
    w = BlockWorker(CFG, TC, WorkerConfig(worker_id="w", block=0, steps_per_round=H, codec=Codec.INT8),
                    LocalLink(agg), CORPUS, device=torch.device("cpu"))
    w.start()
    return agg, w


def probation_push(w: BlockWorker):
    w.train_steps(w.steps_due())
    header, raw = w.make_update()
    assert header.claim.residual_end != EMPTY_STATE  # int8 leaves a rounding error to carry
    j = w.push(header, raw)
    assert j.outcome is Outcome.PROBATION
    w.pushed(j)
    assert state_sha256(w.residual) == header.claim.residual_end  # kept: the update may yet be applied
    return header, j


def next_claim(agg: SwarmAggregator, w: BlockWorker) -> PushHeader:
    w.advance(agg.block(0).current()[0])
    w.train_steps(w.steps_due())
    header, raw = w.make_update()
    j = w.push(header, raw)  # its chain holds, and probation is over: at p = 1 it is drawn, not on probation
    assert j.outcome is Outcome.PROBATION and j.reason.startswith("drawn for audit")
    return header


def test_a_worker_on_probation_keeps_its_residual_and_the_admitted_update_is_applied(tmp_path):
    agg, w = audited(tmp_path)
    first, j = probation_push(w)
    assert [v.passed for v in agg.run_audits()] == [True]  # fresh state: replayed at once, then admitted
    newer = agg.block(0).current()[0]
    assert newer.version == 1 and first.update_id in newer.included
    assert w.settle(first, j, newer) == RoundReceipt(first.update_id, Outcome.APPLIED, 1)
    assert w.stats.applied == 1 and w.stats.dropped == {}
    assert state_sha256(w.residual) == first.claim.residual_end
    second = next_claim(agg, w)
    assert second.claim.residual_start == first.claim.residual_end  # the error feedback went on


def test_a_held_update_that_comes_too_late_is_dropped_and_its_residual_with_it(tmp_path):
    agg, w = audited(tmp_path)
    block = agg.block(0)
    first, j = probation_push(w)
    other = PushHeader(worker_id="o", block=0, base_version=0, samples=float(TC.batch), loss=1.0, codec=Codec.FP32,
                       update_id="o-0", steps=(0,))
    block.register("o")
    assert block.submit(other, {n: torch.full(s, 1e-6) for n, s in block.spec.items()}).outcome is Outcome.PENDING
    agg.clock.t += 31  # the deadline: round 0 closes with o's update, w's still waiting for its replay
    block.tick()
    newer = block.current()[0]
    assert newer.version == 1 and first.update_id not in newer.included
    assert [v.passed for v in agg.run_audits()] == [True]  # it passes, after its round: it stays out
    assert w.settle(first, j, newer) == RoundReceipt(first.update_id, Outcome.DROPPED, 1, "audited_after_close")
    assert w.stats.dropped == {"audited_after_close": 1} and w.stats.applied == 0 and w.residual == {}
    second = next_claim(agg, w)
    assert second.claim.residual_start == EMPTY_STATE  # a chain may start from no residual
    assert {r.name: dict(r.dropped) for r in agg.identities.records()}["w"] == {"audited_after_close": 1}
    assert agg.identities.drops("w") == 0  # the aggregator's pace, not the worker's fault
