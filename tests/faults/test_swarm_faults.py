"""Killed processes: a worker SIGKILLed in the middle of a push leaves the aggregator serving,
and the round still closes at its deadline."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames
from btnode.model.config import ModelConfig
from btnode.protocol import Outcome, PushHeader
from btnode.rpc.client import SwarmClient
from btnode.rpc.convert import info_from_pb
from btnode.store.models import init_block
from procs import honest_terms

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))


def test_kill_9_of_a_worker_mid_push_leaves_the_aggregator_serving(aggregator):
    agg = aggregator("--deadline", "3", "--audit", "0")  # hand-made pushes: no work claims
    c = SwarmClient(agg.address, timeout_s=30)
    c.join("good", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms())
    victim = subprocess.Popen([sys.executable, str(Path(__file__).with_name("stalled_push.py")), agg.address,
                               "victim", json.dumps(CFG.to_dict())], stdout=subprocess.PIPE, text=True)
    assert victim.stdout.readline().strip() == "pushing"
    opened = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(timeout=10) == -signal.SIGKILL
    delta = {n: 1e-3 * torch.ones_like(t) for n, t in init_block(CFG, 0, 0).state_dict().items()}
    h = PushHeader(worker_id="good", block=0, base_version=0, samples=32.0, loss=1.0, codec=Codec.FP32, update_id="g",
                   steps=(0,))  # one step of the default batch: 1e-3 is within its bound
    assert c.push(h, encode_frames(delta, Codec.FP32)).outcome is Outcome.PENDING
    while True:  # "victim" is still registered and never reports: only the deadline can close the round
        cur = info_from_pb(c.status().blocks[0].current)
        if cur.version == 1:
            break
        assert time.monotonic() - opened < 30, "the round never closed"
        time.sleep(0.05)
    assert cur.closed_by == "deadline" and cur.accepted == 1
    assert agg.proc.poll() is None
    counters = {(m.labels.get("outcome"), m.labels.get("reason")): m.value for m in c.status().counters
                if m.labels.get("block") == "0"}
    # a dropped connection shows up as "aborted" or as a truncated stream, depending on which the server sees first
    assert counters.get(("rejected", "aborted"), 0) + counters.get(("rejected", "truncated"), 0) == 1
    assert counters[("pending", "")] == 1
    c.close()
