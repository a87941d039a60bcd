"""Poisoned updates (issue #7): among 3 replicas of a block one sends updates scaled by 1000, with
NaN, or sign-flipped and scaled. With validation and the robust mode on, the poisoned update is
rejected (on arrival or by the screen at close), the counters and metrics say so, and the block
ends within 0.01 nats/byte of a run without the poisoned replica."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from btnode.aggregate.sums.averaging import OuterConfig
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.codec.frames import FrameAssembler, encode_frames, iter_chunks
from btnode.evaluation.metrics import sce1_k1
from btnode.model.config import ModelConfig
from btnode.node.metrics import AggregatorCollector
from btnode.sim.link import LocalLink
from btnode.store.models import init_block
from btnode.swarm.worker import BlockWorker, WorkerConfig
from btnode.train.config import TrainConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=2, context=32, segments=(1, 8))
TC = TrainConfig(steps=12, batch=4, warmup=2)
CORPUS = (b"The quick brown fox jumps over the lazy dog. " * 60) + bytes(range(256)) * 4
POISONS = {
    "scaled x1000": lambda d: {n: 1000 * t for n, t in d.items()},
    "nan": lambda d: {n: torch.full_like(t, float("nan")) if i == 0 else t for i, (n, t) in enumerate(d.items())},
    "sign-flipped x3": lambda d: {n: -3 * t for n, t in d.items()},
}


class PoisonLink(LocalLink):
    """The poisoner's network: its pushes are rewritten on the way (decoded, poisoned, re-encoded)."""

    def __init__(self, agg: SwarmAggregator, poison):
        super().__init__(agg)
        self.poison = poison

    def push(self, header, frames):
        spec = self.agg.block(header.block).spec
        asm = FrameAssembler.for_spec(spec, [header.codec])
        for c in iter_chunks(frames):
            asm.add(c)
        bad = self.poison(asm.finish())
        return self.agg.push(header, iter_chunks(encode_frames(bad, header.codec)))


def run(tmp_path, poison=None, rounds=3):
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=3600), outer=OuterConfig(robust="trimmed"),
                            claims=ClaimConfig.of(TC, 4))
    agg = SwarmAggregator(CFG, acfg, tmp_path)
    workers = [BlockWorker(CFG, TC, WorkerConfig(worker_id=f"h{i}", block=0, steps_per_round=4, codec=Codec.INT8,
                                                 train_while_waiting=False), LocalLink(agg), CORPUS,
                           device=torch.device("cpu")) for i in range(2)]
    if poison is not None:
        workers.append(BlockWorker(CFG, TC, WorkerConfig(worker_id="p", block=0, steps_per_round=4, codec=Codec.INT8,
                                                         train_while_waiting=False), PoisonLink(agg, poison), CORPUS,
                                   device=torch.device("cpu")))
    for w in workers:
        w.start()
    for _ in range(rounds):
        for w in workers:
            w.train_steps(w.steps_due())
            w.pushed(w.push(*w.make_update()))
        info = agg.block(0).info
        for w in workers:
            w.advance(info)
    blocks = [init_block(CFG, b, 0) for b in range(CFG.n_blocks)]
    blocks[0].load_state_dict(agg.block(0).current()[1])
    return agg, sce1_k1(blocks, CORPUS, 16, torch.device("cpu"))


@pytest.mark.parametrize("kind", sorted(POISONS))
def test_a_poisoned_replica_is_rejected_and_the_block_stays_on_course(tmp_path, kind):
    clean_agg, clean = run(tmp_path / "clean")
    agg, poisoned = run(tmp_path / "poisoned", POISONS[kind])
    assert agg.block(0).info.version == clean_agg.block(0).info.version == 3
    assert abs(poisoned - clean) <= 0.01, (kind, poisoned, clean)
    # refused on arrival (rejected) or by the screen at close (dropped)
    rejected = {(outcome, reason): n for (outcome, reason), n in agg.block(0).counters.items()
                if outcome in ("rejected", "dropped") and n}
    assert sum(rejected.values()) == 3, rejected  # every poisoned update, each round
    assert all(r.info.accepted == 2 and r.info.rejected == 1 for r in agg.block(0).recent)
    registry = CollectorRegistry()
    registry.register(AggregatorCollector(agg))
    text = generate_latest(registry).decode()
    for (outcome, reason), n in rejected.items():
        assert f'btnode_updates_total{{block="0",outcome="{outcome}",reason="{reason}"}} {float(n)}' in text, text
