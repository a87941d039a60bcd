"""Round receipts over a real server: a worker whose update the screen drops at close hears PENDING on
arrival, then DROPPED with the reason with the next version (its Watch stream), and acts on it."""

import threading
import time

import torch

from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames
from btnode.protocol import Outcome, PushHeader, RoundReceipt
from btnode.rpc import convert
from btnode.rpc.client import SwarmClient
from btnode.swarm.worker import BlockWorker, WorkerConfig
from btnode.train.config import TrainConfig
from btnode.v2 import swarm_pb2 as pb
from btnode.v2 import swarm_pb2_grpc as pb_grpc
from test_swarm_rpc import join, small_delta

CORPUS = bytes(range(256)) * 40


class Faint(BlockWorker):
    """Pushes a ten-thousandth of its delta: honest claims, a norm far under the round's median."""

    def _encode(self) -> dict[str, bytes]:
        with torch.no_grad():
            for n, p in self.trainer.model.state_dict().items():
                p.copy_(self.base[n] + 1e-4 * (p - self.base[n]))
        return super()._encode()


def test_a_dropped_update_is_pending_then_dropped_with_the_next_version(live):
    claims = live.agg.acfg.claims
    tc = TrainConfig(batch=claims.batch, lr=claims.lr, beta1=claims.beta1, beta2=claims.beta2,
                     weight_decay=claims.weight_decay, warmup=1, steps=100)
    join(live, "a", "b", "c")  # replicas the round waits for
    link = SwarmClient(live.address, timeout_s=20)
    worker = Faint(live.agg.cfg, tc, WorkerConfig(worker_id="w", block=0, steps_per_round=claims.steps_per_round,
                                                  codec=Codec.INT8, rounds=1, train_while_waiting=False),
                   link, CORPUS, device=torch.device("cpu"))
    got: list = []
    runner = threading.Thread(target=lambda: got.append(worker.run()))
    runner.start()
    block = live.agg.block(0)
    deadline = time.monotonic() + 60
    while "w" not in block.round.accepted:
        assert time.monotonic() < deadline and runner.is_alive(), "the worker's update never came"
        time.sleep(0.02)
    uid = block.round.accepted["w"].update_id
    course = small_delta(live, 1e-3)
    for i, w in enumerate("abc"):  # three alike, not copies (those share one vote): w's faint update is far under
        own = small_delta(live, 3.5e-4, seed=i + 1)  # their median norm
        # as much work as w's (its H steps): the screen's medians are weighted by work (round/screen.py)
        header = PushHeader(worker_id=w, block=0, base_version=0, samples=32.0 * claims.steps_per_round, loss=2.0,
                            codec=Codec.FP32, update_id=f"{w}:0", steps=tuple(range(claims.steps_per_round)))
        delta = {n: course[n] + own[n] for n in course}
        assert live.client.push(header, encode_frames(delta, Codec.FP32)).outcome is Outcome.PENDING
    runner.join(timeout=60)
    link.close()
    stats = got[0]
    assert block.info.version == 1 and block.recent[-1].dropped == (("w", "norm_at_close"),)
    assert stats.outcomes == {"pending": 1}  # never told accepted
    assert stats.dropped == {"norm_at_close": 1} and stats.applied == 0 and stats.not_included == []
    assert worker.residual == {}  # its int8 rounding error belonged to a delta nobody applied
    assert live.agg.identities.drops("w") == 1
    # on the wire: the Watch reply that delivers version 1 carries the watcher's own receipts, and only those
    stub = pb_grpc.WorkerStub(live.client.channel)
    for watcher, want in (("w", RoundReceipt(uid, Outcome.DROPPED, 1, "norm_at_close")),
                          ("a", RoundReceipt("a:0", Outcome.APPLIED, 1))):
        stream = stub.Watch(pb.WatchRequest(block=0, worker_id=watcher))
        first = next(stream)
        stream.cancel()
        assert first.version.version == 1
        assert [convert.round_receipt_from_pb(r) for r in first.receipts] == [want]
    # and by update id: the sender's own only
    asked = stub.RoundReceipt(pb.RoundReceiptRequest(block=0, worker_id="w", update_id=uid))
    assert convert.round_receipt_from_pb(asked.receipt).reason == "norm_at_close"
    assert not stub.RoundReceipt(pb.RoundReceiptRequest(block=0, worker_id="a", update_id=uid)).HasField("receipt")
    fresh = SwarmClient(live.address, timeout_s=20)
    try:
        assert fresh.receipt(0, "b", "b:0") == RoundReceipt("b:0", Outcome.APPLIED, 1)
        assert fresh.receipt(0, "b", "nobody") is None
    finally:
        fresh.close()


def test_a_worker_keeps_its_sparse_residual_through_a_direction_drop(live):
    """The screen drops w's sparse update for its direction (the others agree on another one): w hears
    DROPPED direction_at_close and keeps the error-feedback residual its update left (the mass of its top-k
    misses, which a later update sends; the audit chain starts there), where a norm drop resets it (above)."""
    claims = live.agg.acfg.claims
    tc = TrainConfig(batch=claims.batch, lr=claims.lr, beta1=claims.beta1, beta2=claims.beta2,
                     weight_decay=claims.weight_decay, warmup=1, steps=100)
    join(live, "a", "b", "c")
    link = SwarmClient(live.address, timeout_s=20)
    worker = BlockWorker(live.agg.cfg, tc, WorkerConfig(worker_id="w", block=0, steps_per_round=claims.steps_per_round,
                                                        codec=Codec.SPARSE8, density=0.03, rounds=1,
                                                        train_while_waiting=False),
                         link, CORPUS, device=torch.device("cpu"))
    got: list = []
    runner = threading.Thread(target=lambda: got.append(worker.run()))
    runner.start()
    block = live.agg.block(0)
    deadline = time.monotonic() + 60
    while "w" not in block.round.accepted:
        assert time.monotonic() < deadline and runner.is_alive(), "the worker's update never came"
        time.sleep(0.02)
    left = {n: t.clone() for n, t in worker.residual.items()}  # what its update left unsent
    assert left and any(bool(t.any()) for t in left.values())
    course = small_delta(live, 1.0, seed=9)  # a direction of their own, at w's norm
    size = block.round.accepted["w"].norm / sum(float(t.norm()) ** 2 for t in course.values()) ** 0.5
    for i, w in enumerate("abc"):
        own = small_delta(live, 0.2, seed=i + 1)
        header = PushHeader(worker_id=w, block=0, base_version=0, samples=32.0 * claims.steps_per_round, loss=2.0,
                            codec=Codec.FP32, update_id=f"{w}:0", steps=tuple(range(claims.steps_per_round)))
        delta = {n: size * (course[n] + own[n]) for n in course}
        assert live.client.push(header, encode_frames(delta, Codec.FP32)).outcome is Outcome.PENDING
    runner.join(timeout=60)
    link.close()
    assert block.info.version == 1 and block.recent[-1].dropped == (("w", "direction_at_close"),)
    assert got[0].dropped == {"direction_at_close": 1}
    assert worker.residual.keys() == left.keys()
    assert all(torch.equal(worker.residual[n], left[n]) for n in left)
