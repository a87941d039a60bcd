"""A real gRPC aggregator on 127.0.0.1:0 in this process, with its deadline ticker."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from btnode.aggregate.sums.averaging import OuterConfig
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.model.config import ModelConfig
from btnode.rpc.client import SwarmClient
from btnode.rpc.server import serve

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=2, context=32, segments=(1, 8))


@dataclass
class Live:
    agg: SwarmAggregator
    address: str
    client: SwarmClient


@pytest.fixture
def live(tmp_path, request):
    """Indirectly parametrized with True: every block keeps θ in its version file (store/theta.py), as a
    unit over 64 MiB does."""
    # batch 32 (tests' headers claim 32 samples a step); an inner lr of 0.01 bounds a step at 0.0117, over
    # the hand-made deltas (1e-3 · randn)
    in_file = {"theta_in_file_bytes": 0} if getattr(request, "param", False) else {}
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=30.0), outer=OuterConfig(lr=0.7),
                            claims=ClaimConfig(batch=32, lr=0.01, steps_per_round=4, enforce=True), **in_file)
    agg = SwarmAggregator(CFG, acfg, tmp_path)
    server, port, stop = serve(agg, "127.0.0.1:0")
    done = threading.Event()

    def tick():
        while not done.is_set():
            agg.tick()
            done.wait(0.02)

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    client = SwarmClient(f"127.0.0.1:{port}", timeout_s=20)
    yield Live(agg, f"127.0.0.1:{port}", client)
    client.close()
    done.set()
    stop.set()
    server.stop(0).wait()
    t.join()
