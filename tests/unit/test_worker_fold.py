"""No idle waiting (issue #5): steps trained while a version is on its way are folded into the
next update, never thrown away. BlockWorker against an in-process aggregator (LocalLink)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.model.config import ModelConfig
from btnode.protocol import Judgement, Outcome
from btnode.sim.link import LocalLink
from btnode.store.files import state_sha256
from btnode.swarm.worker import BlockWorker, WorkerConfig
from btnode.train.config import TrainConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=2, context=32, segments=(1, 8))
TC = TrainConfig(steps=100, batch=4, warmup=2)
CORPUS = bytes(range(256)) * 40
H = 4


def make(tmp_path, n_replicas=1, deadline=30.0, **wkw):
    agg = SwarmAggregator(CFG, AggregatorConfig(round=RoundConfig(deadline_s=deadline), claims=ClaimConfig.of(TC, H)), tmp_path)
    link = LocalLink(agg)
    workers = [BlockWorker(CFG, TC, WorkerConfig(worker_id=f"w{i}", block=0, steps_per_round=H, codec=Codec.FP32,
                                                 **wkw), link, CORPUS, device=torch.device("cpu"))
               for i in range(n_replicas)]
    return agg, workers


def params(w: BlockWorker) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in w.trainer.model.state_dict().items()}


def test_work_done_while_waiting_is_folded_onto_the_new_version(tmp_path):
    agg, (w,) = make(tmp_path)
    w.start()
    w.train_steps(w.steps_due())
    header, raw = w.make_update()
    at_push = params(w)
    w.pushed(w.push(header, raw))  # the only replica: the round closes, version 1 exists
    w.train_steps(3)  # what it trains while the announcement travels
    now = params(w)
    info, published = agg.block(0).current()
    w.advance(info)
    after = params(w)
    for n in after:
        torch.testing.assert_close(after[n], published[n] + (now[n] - at_push[n]), rtol=0, atol=1e-6)
    assert w.info.version == 1 and w.steps_due() == H - 3
    w.train_steps(w.steps_due())
    header2, _ = w.make_update()
    assert header2.samples == H * TC.batch and header2.base_version == 1  # the 3 folded steps are in it


def test_an_update_that_was_not_accepted_is_folded_whole(tmp_path):
    agg, (w,) = make(tmp_path)
    w.start()
    w.train_steps(H)
    header, raw = w.make_update()
    w.pushed(Judgement(Outcome.LATE, "round closed", 1))  # as if it had arrived after the deadline
    w.train_steps(1)
    now = params(w)
    base = {n: t.clone() for n, t in w.base.items()}
    info, published = agg.block(0).current()  # still version 0: nothing of the update was applied
    w.advance(info)
    after = params(w)
    for n in after:
        torch.testing.assert_close(after[n], published[n] + (now[n] - base[n]), rtol=0, atol=1e-6)
    assert w.steps_due() == 0  # H + 1 steps already carried: it pushes at once


def test_idle_mode_adopts_the_version_exactly(tmp_path):
    agg, (w,) = make(tmp_path, train_while_waiting=False)
    w.start()
    w.train_steps(H)
    w.pushed(w.push(*w.make_update()))
    w.train_steps(2)
    info, published = agg.block(0).current()
    w.advance(info)
    assert state_sha256(params(w)) == info.sha256 and w.steps_due() == H


@pytest.mark.parametrize("overlap", [True, False])
def test_threaded_replicas_train_while_a_slow_peer_holds_the_round(tmp_path, overlap):
    """Two replicas; one pushes through a slow link, so the other waits for each version. With
    train_while_waiting it trains meanwhile, folds that in, and still ends on the published hash."""
    agg, (fast, slow) = make(tmp_path, n_replicas=2, train_while_waiting=overlap, rounds=3)
    slow_push = slow.link.push

    def delayed(header, frames):
        time.sleep(0.6)
        return slow_push(header, frames)

    slow.push = lambda header, raw: delayed(header, slow._frames(raw))  # type: ignore[method-assign]
    threads = [threading.Thread(target=w.run) for w in (fast, slow)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    info, _ = agg.block(0).current()
    assert info.version >= 3
    assert fast.stats.outcomes.get("pending") == 3
    if overlap:
        assert fast.stats.wait_steps > 0 and fast.stats.folds > 0
    else:
        assert fast.stats.wait_steps == 0 and fast.stats.folds == 0
    for w in (fast, slow):
        assert w.stats.sha256 == agg.block(0).store.load(w.stats.version).meta["info"]["sha256"]


@pytest.mark.parametrize("by_version", [True, False])
def test_a_late_replica_joins_the_schedule_where_the_swarm_is(tmp_path, by_version):
    agg, (w,) = make(tmp_path)
    w.start()
    for _ in range(3):  # the only replica: each push publishes a version
        w.train_steps(w.steps_due())
        w.pushed(w.push(*w.make_update()))
        w.advance(agg.block(0).info)
    late = BlockWorker(CFG, TC, WorkerConfig(worker_id="late", block=0, steps_per_round=H, codec=Codec.FP32,
                                             schedule_by_version=by_version), LocalLink(agg), CORPUS,
                       device=torch.device("cpu"))
    late.start()
    assert late.trainer.step == (3 * H if by_version else 0)
    assert w.trainer.step == 3 * H  # in lockstep own steps and version × H agree
