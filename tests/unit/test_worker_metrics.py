"""A worker's counters as its stats file and /metrics give them (node/metrics.py): tests read these,
not its log, so each counter a test relies on is checked here where it is made."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, generate_latest

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.model.config import ModelConfig
from btnode.node.metrics import WorkerCollector
from btnode.sim.link import LocalLink
from btnode.swarm.worker import BlockWorker, WorkerConfig
from btnode.train.config import TrainConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=2, context=32, segments=(1, 8))
TC = TrainConfig(steps=100, batch=4, warmup=2)
H = 2


def test_a_re_push_after_a_reconnect_is_counted_by_its_answer(tmp_path):
    agg = SwarmAggregator(CFG, AggregatorConfig(round=RoundConfig(deadline_s=60.0), claims=ClaimConfig.of(TC, H)),
                          tmp_path)
    link = LocalLink(agg)
    w, other = (BlockWorker(CFG, TC, WorkerConfig(worker_id=name, block=0, steps_per_round=H, codec=Codec.FP32),
                            link, bytes(range(256)) * 40, device=torch.device("cpu")) for name in ("w", "other"))
    w.start()
    other.start()  # joined and silent: the round stays open after w's push
    w.train_steps(w.steps_due())
    header, raw = w.make_update()
    w.pushed(w.push(header, raw))
    w._repush(1)  # a reconnect while waiting on another round: nothing to push again
    assert w.stats.repushes == {}
    w._repush(0)  # the stream came back while w waits on round 0: the same update again, answered as before
    assert w.stats.repushes == {"pending": 1} and w.stats.outcomes == {"pending": 1}
    registry = CollectorRegistry()
    registry.register(WorkerCollector(0, lambda: w.stats))
    text = generate_latest(registry).decode()
    assert 'btnode_worker_repushes_total{block="0",outcome="pending"} 1.0' in text, text
    assert 'btnode_worker_repushes_total{block="0",outcome="late"} 0.0' in text, text
