"""What a worker pushes (swarm/worker.py): one bundle to an aggregator that reads them (JoinReply.bundles),
a frame a tensor to an older one, the same update either way, and its bytes counted once sent."""

from __future__ import annotations

from dataclasses import replace

import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.bundles import BundleHeader
from btnode.codec.codecs import Codec
from btnode.codec.frames import FrameHeader, iter_chunks
from btnode.model.config import ModelConfig
from btnode.protocol import Outcome
from btnode.sim.link import LocalLink
from btnode.swarm.worker import BlockWorker, WorkerConfig
from btnode.train.config import TrainConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1,))
TC = TrainConfig(steps=100, batch=4, warmup=2)
CORPUS = bytes(range(256)) * 40
H = 2


class OlderLink(LocalLink):
    """An aggregator from before bundles, as its Join answers (it reads the frames it is sent either way)."""

    def __init__(self, agg, older: bool):
        super().__init__(agg)
        self.older, self.headers = older, []

    def join(self, *args, **kw):
        info = super().join(*args, **kw)
        return replace(info, bundles=False) if self.older else info

    def push(self, header, frames):
        chunks = list(iter_chunks(frames))
        self.headers += [type(c.header) for c in chunks if c.header is not None]
        return self.agg.push(header, iter(chunks))


def test_a_worker_pushes_a_bundle_or_frames_as_its_aggregator_reads(tmp_path):
    sent = {}
    for older in (False, True):
        acfg = AggregatorConfig(round=RoundConfig(deadline_s=30.0), claims=ClaimConfig.of(TC, H))
        agg = SwarmAggregator(CFG, acfg, tmp_path / str(older))
        link = OlderLink(agg, older)
        w = BlockWorker(CFG, TC, WorkerConfig(worker_id="w", block=0, steps_per_round=H, codec=Codec.INT8),
                        link, CORPUS, device=torch.device("cpu"))
        w.start()
        w.train_steps(w.steps_due())
        header, raw = w.make_update()
        assert w.push(header, raw).outcome in (Outcome.PENDING, Outcome.APPLIED)
        spec = agg.block(0).spec
        assert link.headers == ([FrameHeader] * len(spec) if older else [BundleHeader])
        assert w.stats.bytes_pushed_raw == sum(map(len, raw.values())) and w.stats.bytes_pushed_wire > 0
        sent[older] = raw
    assert sent[False] == sent[True]  # the same update, whichever way it travelled
