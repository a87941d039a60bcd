"""Per-peer limits over real gRPC: concurrent transfer streams, join attempts per minute, and the
aggregator's memory while 50 pushes are in flight at once (a real process; RSS from /proc)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from btnode.aggregate.block import AggregatorConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames, iter_chunks
from btnode.errors import Overloaded
from btnode.model.config import ModelConfig
from btnode.protocol import PushHeader
from btnode.rpc import convert
from btnode.rpc.client import Retry, SwarmClient
from btnode.rpc.limits import PeerLimiter, PeerLimits, peer_host
from btnode.rpc.server import CHANNEL_OPTIONS, serve
from btnode.store.models import init_block
from btnode.train.config import TrainConfig
from btnode.v1 import swarm_pb2 as pb
from btnode.v1 import swarm_pb2_grpc as pb_grpc

from conftest import CFG
from procs import CLI, free_port, honest_terms

import grpc


def held_push(address: str, cfg: ModelConfig, worker: str, release: threading.Event, results: queue.Queue) -> None:
    """A push that sends its header and every chunk, then holds the stream open until `release`: an
    honest one of a worker that joined (one step of the default batch, moving each value 1e-3)."""
    spec = {n: tuple(t.shape) for n, t in init_block(cfg, 0, 0).state_dict().items()}
    header = PushHeader(worker_id=worker, block=0, base_version=0, samples=float(TrainConfig.batch), loss=1.0,
                        codec=Codec.INT8, update_id=f"{worker}-u", steps=(0,))
    chunks = list(iter_chunks(encode_frames({n: 1e-3 * torch.ones(s) for n, s in spec.items()}, Codec.INT8)))

    def messages():
        yield pb.PushMessage(header=convert.push_header_to_pb(header))
        for c in chunks:
            yield pb.PushMessage(chunk=convert.chunk_to_pb(c))
        results.put(("sent", worker))
        release.wait()

    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        reply = pb_grpc.SwarmStub(channel).Push(messages(), timeout=120)
        results.put(("ok", reply.outcome))
    except grpc.RpcError as err:
        results.put(("refused", err.code()))
    finally:
        channel.close()


def join(c: SwarmAggregator | SwarmClient, cfg: ModelConfig, *workers: str) -> None:
    """Join block 0 as workers that train with the default settings (the aggregator's claims)."""
    for w in workers:
        c.join(w, 0, cfg.fingerprint(), json.dumps(cfg.to_dict()), training_json=honest_terms())


@pytest.fixture
def limited(tmp_path):
    agg = SwarmAggregator(CFG, AggregatorConfig(), tmp_path)
    join(agg, CFG, "w0", "w1", "w2", "w9")  # in process: the join limit is the transport's, and counts none of these
    limiter = PeerLimiter(PeerLimits(max_streams=2, joins_per_minute=3))
    server, port, _ = serve(agg, "127.0.0.1:0", limits=limiter)
    yield f"127.0.0.1:{port}", agg, limiter
    server.stop(0).wait()


def test_a_peer_may_hold_only_so_many_transfer_streams(limited):
    address, agg, limiter = limited
    release, results = threading.Event(), queue.Queue()
    threads = [threading.Thread(target=held_push, args=(address, CFG, f"w{i}", release, results)) for i in range(3)]
    for t in threads[:2]:
        t.start()
    assert {results.get(timeout=30)[0] for _ in range(2)} == {"sent"}  # both clients have sent everything
    deadline = time.monotonic() + 30  # "sent" is the client's side: wait until the server holds both streams
    while limiter.open_streams() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert limiter.open_streams() == 2
    threads[2].start()
    outcome = results.get(timeout=30)
    assert outcome == ("refused", grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert agg.counters[("limited", "transfer_streams")] == 1
    release.set()
    for t in threads:
        t.join(timeout=30)
    assert [results.get(timeout=5)[0] for _ in range(2)] == ["ok", "ok"]
    again = queue.Queue()
    done = threading.Event()
    done.set()
    held_push(address, CFG, "w9", done, again)  # slots were released
    assert [again.get()[0], again.get()[0]] == ["sent", "ok"]


@pytest.mark.parametrize("method", ["Pull", "FetchDelta"])
def test_requests_that_do_not_parse_hold_no_stream_slot(limited, method):
    """They were refused before a stream existed, and each kept its slot: max_streams of them locked the
    peer out of every transfer, its pushes included (found by bench/fuzz.py)."""
    address, agg, limiter = limited
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    call = channel.unary_stream(f"/btnode.v1.Swarm/{method}", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    for _ in range(3):  # over max_streams = 2
        with pytest.raises(grpc.RpcError) as err:
            list(call(b"\xff\xff\xff", timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()
    assert limiter.open_streams() == 0 and not agg.counters[("limited", "transfer_streams")]
    c = SwarmClient(address, timeout_s=10)
    assert c.pull(0, "w0", agg.block(0).spec).info.version == 0  # still served
    c.close()


def test_joins_per_minute_are_limited_per_peer(limited):
    """Refused for now (Overloaded, a PeerUnavailable: worth retrying), not TooLarge; with no retry
    budget the client hands the refusal straight back."""
    address, agg, _ = limited
    c = SwarmClient(address, timeout_s=10, retry=Retry(budget_s=0))
    join(c, CFG, "w0", "w1", "w2")
    with pytest.raises(Overloaded, match="join rate") as err:
        join(c, CFG, "w3")
    c.close()
    assert err.value.reason == "join_rate"
    assert agg.counters[("limited", "join_rate")] == 1


def test_a_refused_pull_is_retried_with_backoff_until_a_transfer_slot_frees(tmp_path):
    """One transfer at a time over all peers: a pull made while a push holds the only slot is refused
    (counted by the server as transfer_budget), retried by the client, and served once the push ends."""
    agg = SwarmAggregator(CFG, AggregatorConfig(), tmp_path)
    join(agg, CFG, "w0", "w1")
    server, port, _ = serve(agg, "127.0.0.1:0", limits=PeerLimits(max_transfers=1))
    address = f"127.0.0.1:{port}"
    release, results = threading.Event(), queue.Queue()
    pusher = threading.Thread(target=held_push, args=(address, CFG, "w0", release, results))
    pusher.start()
    retried = threading.Event()
    c = SwarmClient(address, timeout_s=20, retry=Retry(budget_s=25, base_s=0.05, cap_s=0.2),
                    on_retry=lambda what, reason: retried.set())
    try:
        assert results.get(timeout=20) == ("sent", "w0")  # the push holds the slot
        pulled: queue.Queue = queue.Queue()
        puller = threading.Thread(target=lambda: pulled.put(c.pull(0, "w1", agg.block(0).spec)))
        puller.start()
        assert retried.wait(20)  # refused at least once and retried
        release.set()
        assert pulled.get(timeout=25).info.version == 0
        puller.join(timeout=5)
        assert results.get(timeout=20)[0] == "ok"
        assert c.retries[("pull", "transfer_budget")] >= 1
        assert agg.counters[("limited", "transfer_budget")] == sum(c.retries.values())
    finally:
        release.set()
        c.close()
        pusher.join(timeout=10)
        server.stop(0).wait()


def test_version_streams_have_their_own_budget(tmp_path):
    """Two connected workers at most: a third Watch is refused (watch_budget) while pushes and pulls,
    which draw on the transfer budget, are still served."""
    agg = SwarmAggregator(CFG, AggregatorConfig(), tmp_path)
    join(agg, CFG, "w0", "w1", "w2")
    server, port, _ = serve(agg, "127.0.0.1:0", limits=PeerLimits(max_workers=2))
    c = SwarmClient(f"127.0.0.1:{port}", timeout_s=10, retry=Retry(budget_s=0))
    try:
        held = [c.watch(0, f"w{i}") for i in range(2)]
        assert [next(w).version for w in held] == [0, 0]
        with pytest.raises(Overloaded) as err:
            next(c.watch(0, "w2"))
        assert err.value.reason == "watch_budget"
        assert agg.counters[("limited", "watch_budget")] == 1
        assert c.pull(0, "w2", agg.block(0).spec).info.version == 0
        counters = {(e["name"], e["labels"].get("reason", "")): e["value"] for e in c.status_dict()["counters"]}
        assert counters[("limited", "watch_budget")] == 1  # visible in btnode status (and so in metrics)
    finally:
        c.close()
        server.stop(0).wait()


def test_peer_host_parsing():
    assert peer_host("ipv4:10.1.2.3:5555") == "10.1.2.3"
    assert peer_host("ipv6:[::1]:5555") == "::1"
    assert peer_host("unix:/tmp/x") == "unix:/tmp/x"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_memory_stays_bounded_under_50_concurrent_pushes(tmp_path):
    """The default model (3.2 MB of fp32 per block); 50 pushes each send a whole int8 update and hold
    their stream open, so the aggregator holds 50 received updates at once."""
    cfg = ModelConfig()  # d=128, L=2: the swarm's default block
    port = free_port()
    proc = subprocess.Popen([*CLI, "join", "--role", "aggregator", "--listen", f"127.0.0.1:{port}", "--state-dir",
                             str(tmp_path / "s"), "--max-streams-per-peer", "64", "--max-joins-per-minute", "64"],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=open(tmp_path / "agg.log", "wb"),
                            stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        c = SwarmClient(address, timeout_s=5)
        deadline = time.monotonic() + 60
        while True:
            try:
                c.status()
                break
            except Exception:  # noqa: BLE001 - starting
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        join(c, cfg, *(f"w{i}" for i in range(50)))
        c.close()
        idle = rss_mb(proc.pid)
        release, results = threading.Event(), queue.Queue()
        threads = [threading.Thread(target=held_push, args=(address, cfg, f"w{i}", release, results))
                   for i in range(50)]
        for t in threads:
            t.start()
        sent = [results.get(timeout=120) for _ in range(50)]
        assert all(kind == "sent" for kind, _ in sent)
        time.sleep(1.0)  # the last chunks reach the server
        peak = rss_mb(proc.pid)
        release.set()
        for t in threads:
            t.join(timeout=60)
        outcomes = [results.get(timeout=10) for _ in range(50)]
        assert all(kind == "ok" for kind, _ in outcomes), outcomes[:3]
        block_mb = 4 * sum(t.numel() for t in init_block(cfg, 0, 0).parameters()) / 2**20
        growth = peak - idle
        print(f"aggregator RSS: idle {idle:.0f} MB, 50 pushes in flight {peak:.0f} MB (+{growth:.0f} MB; "
              f"block {block_mb:.1f} MB fp32)")
        # each held push: its decoded fp32 delta + its int8 codec bytes + the compressed chunks ≈ 1.6 blocks
        assert growth < 50 * 3 * block_mb + 150, growth
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_a_worker_outlives_a_refused_pull_and_a_refused_version_stream(tmp_path):
    """A real BlockWorker over gRPC against tight budgets (one transfer, one version stream at a
    time): its first pull is refused while another peer's push holds the transfer slot, and its
    version stream while another stream holds the only watch slot. Neither ends it: the pull is
    retried, the stream reopened with backoff, and it trains its two rounds (counted in its stats)."""
    from btnode.aggregate.claims import ClaimConfig
    from btnode.aggregate.rounds import RoundConfig
    from btnode.swarm.worker import BlockWorker, WorkerConfig

    tc, h = TrainConfig(steps=200, warmup=2), ClaimConfig().steps_per_round  # the claims `held_push` makes
    agg = SwarmAggregator(CFG, AggregatorConfig(round=RoundConfig(deadline_s=2.0)), tmp_path)
    join(agg, CFG, "other")
    server, port, stop = serve(agg, "127.0.0.1:0", limits=PeerLimits(max_transfers=1, max_workers=1))
    address = f"127.0.0.1:{port}"
    done = threading.Event()
    ticker = threading.Thread(target=lambda: [agg.tick() for _ in iter(lambda: done.wait(0.05), True)], daemon=True)
    ticker.start()
    release, results = threading.Event(), queue.Queue()
    pusher = threading.Thread(target=held_push, args=(address, CFG, "other", release, results))
    pusher.start()
    other = SwarmClient(address, timeout_s=20)
    link = SwarmClient(address, timeout_s=20, retry=Retry(budget_s=20, base_s=0.05, cap_s=0.2))
    worker = BlockWorker(CFG, tc, WorkerConfig(worker_id="w", block=0, steps_per_round=h, codec=Codec.INT8, rounds=2,
                                               train_while_waiting=False), link, bytes(range(256)) * 40,
                         device=torch.device("cpu"))
    link.on_retry = worker.count_retry
    outcome: queue.Queue = queue.Queue()
    try:
        assert results.get(timeout=20) == ("sent", "other")  # the only transfer slot is held
        held_watch = other.watch(0, "")  # and the only version-stream slot (an unregistered watcher)
        assert next(held_watch).version == 0
        runner = threading.Thread(target=lambda: outcome.put(_run(worker)))
        runner.start()
        deadline = time.monotonic() + 20
        while worker.stats.retries == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.stats.retries >= 1  # its pull was refused and retried
        release.set()  # the other push ends: the pull gets through
        while worker.stats.reconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.stats.reconnects >= 1  # its version stream was refused and is being reopened
        other.cancel_watches()  # the only watch slot frees
        got = outcome.get(timeout=30)
        assert not isinstance(got, BaseException), got
        # its first update may be late (the other peer's push closed round 0 while it trained): an answer too
        assert got.pushes == 2 and got.outcomes.get("accepted", 0) >= 1 and set(got.outcomes) <= {"accepted", "late"}
        assert got.version >= 2 and got.retries >= 1 and got.reconnects >= 1
        assert agg.counters[("limited", "transfer_budget")] >= 1 and agg.counters[("limited", "watch_budget")] >= 1
        runner.join(timeout=10)
    finally:
        release.set()
        done.set()
        link.close()
        other.close()
        stop.set()
        server.stop(0).wait()
        pusher.join(timeout=10)


def _run(worker):
    try:
        return worker.run()
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        return exc
