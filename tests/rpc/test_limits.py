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

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames, iter_chunks
from btnode.errors import Overloaded
from btnode.model.config import ModelConfig
from btnode.protocol import PushHeader
from btnode.rpc import convert
from btnode.rpc.client import Retry, SwarmClient
from btnode.rpc.limits import JOIN, PeerLimiter, PeerLimits, peer_host
from btnode.rpc.server import CHANNEL_OPTIONS, serve
from btnode.store.models import init_block
from btnode.train.config import TrainConfig
from btnode.v2 import swarm_pb2 as pb
from btnode.v2 import swarm_pb2_grpc as pb_grpc

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
        yield pb.PushRequest(header=convert.push_header_to_pb(header))
        for c in chunks:
            yield pb.PushRequest(chunk=convert.chunk_to_pb(c))
        results.put(("sent", worker))
        release.wait()

    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        reply = pb_grpc.WorkerStub(channel).Push(messages(), timeout=120)
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



def serving(address: str, proc: subprocess.Popen) -> SwarmClient:
    """A client of the aggregator process at `address`, once it answers."""
    c = SwarmClient(address, timeout_s=5)
    deadline = time.monotonic() + 60
    while True:
        try:
            c.status()
            return c
        except Exception:  # noqa: BLE001 - starting
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)

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
    if outcome == ("sent", "w2"):  # its client may write every message before the refusal comes back
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
    call = channel.unary_stream(f"/btnode.v2.Worker/{method}", request_serializer=lambda b: b,
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


def test_a_relays_host_joins_on_the_relay_budget(limited):
    """Every child of a relay joins through it, from its one IP: once a relay has joined from a host,
    joins from there count against --max-relay-joins-per-minute, not the per-IP budget (3 here)."""
    address, agg, limiter = limited
    c = SwarmClient(address, timeout_s=10, retry=Retry(budget_s=0))
    c.join("relay-a", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), relay=True)  # one join of the 3
    join(c, CFG, *(f"child{i}" for i in range(5)))  # passed on by the relay: all taken
    c.close()
    assert agg.counters[("limited", "join_rate")] == 0
    other = PeerLimiter(PeerLimits(joins_per_minute=3, relay_joins_per_minute=4))
    other.trust_relay("ipv4:10.0.0.7:5000")
    admitted = [other._admit(h, JOIN) for h in ["10.0.0.7"] * 5 + ["10.0.0.8"] * 4]
    assert admitted == [None] * 4 + ["join_rate"] + [None] * 3 + ["join_rate"]


def test_a_join_refused_for_open_calls_does_not_spend_the_join_rate():
    """Joins refused because too many calls were open never ran: they leave the minute's budget alone
    (a relay passing on its children's joins at once lost every join for a minute)."""
    limiter = PeerLimiter(PeerLimits(joins_per_minute=2, max_calls=1))
    join_call = JOIN
    assert limiter._admit("h", join_call) is None
    assert [limiter._admit("h", join_call) for _ in range(5)] == ["calls"] * 5
    limiter._release("h", join_call)
    assert limiter._admit("h", join_call) is None  # the second join of the minute
    limiter._release("h", join_call)
    assert limiter._admit("h", join_call) == "join_rate"


def test_a_refused_pull_is_retried_with_backoff_until_a_transfer_slot_frees(tmp_path):
    """One transfer at a time over all peers and no queue: a pull made while a push holds the only slot
    is refused (counted by the server as transfer_budget), retried by the client, and served once the
    push ends."""
    agg = SwarmAggregator(CFG, AggregatorConfig(), tmp_path)
    join(agg, CFG, "w0", "w1")
    server, port, _ = serve(agg, "127.0.0.1:0", limits=PeerLimits(max_transfers=1, transfer_queue=0))
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



def one_slot_held(tmp_path: Path, *workers: str):
    """An aggregator on a real server with one transfer slot and a queue of two, `workers` joined, and
    w0's push holding the slot until `release` is set: (agg, limiter, server, address, release,
    results, the pushing thread)."""
    agg = SwarmAggregator(CFG, AggregatorConfig(), tmp_path)
    join(agg, CFG, *workers)
    limiter = PeerLimiter(PeerLimits(max_transfers=1, transfer_queue=2, transfer_wait_s=60))
    server, port, _ = serve(agg, "127.0.0.1:0", limits=limiter)
    address = f"127.0.0.1:{port}"
    release, results = threading.Event(), queue.Queue()
    pusher = threading.Thread(target=held_push, args=(address, CFG, "w0", release, results))
    pusher.start()
    return agg, limiter, server, address, release, results, pusher

def test_a_transfer_waits_for_a_slot_in_turn_instead_of_being_refused(tmp_path):
    """One transfer slot, a queue of two: while a push holds the slot, two pulls wait (no refusal, no
    retry) and are served in the order they came once it ends; a third finds the queue full and is
    refused (transfer_budget), and one that waits longer than --transfer-wait-s is refused
    (transfer_wait). Every wait and refusal is counted."""
    agg, limiter, server, address, release, results, pusher = one_slot_held(tmp_path, "w0", "w1", "w2", "w3", "w4")
    c = SwarmClient(address, timeout_s=30, retry=Retry(budget_s=0))
    served: queue.Queue = queue.Queue()

    def pull(worker: str) -> None:
        try:
            served.put((worker, c.pull(0, worker, agg.block(0).spec).info.version))
        except Exception as exc:  # noqa: BLE001 - handed to the test thread
            served.put((worker, exc))

    pullers = []
    try:
        assert results.get(timeout=20) == ("sent", "w0")  # the push holds the only slot
        for i, worker in enumerate(("w1", "w2")):
            pullers.append(threading.Thread(target=pull, args=(worker,)))
            pullers[-1].start()
            deadline = time.monotonic() + 20
            while limiter.waiting() < i + 1 and time.monotonic() < deadline:  # queued in this order
                time.sleep(0.01)
            assert limiter.waiting() == i + 1
        with pytest.raises(Overloaded) as err:  # the queue is full
            c.pull(0, "w3", agg.block(0).spec)
        assert err.value.reason == "transfer_budget"
        assert served.empty()  # the two queued pulls still wait: neither was refused
        release.set()
        # both served, neither refused; the order the clients finish in is not the slots' (each decodes its
        # bundle once its stream has ended: 1 run in 3 the second finished first), so it is not checked here
        assert sorted(served.get(timeout=20) for _ in range(2)) == [("w1", 0), ("w2", 0)]
        assert results.get(timeout=20)[0] == "ok"
        assert agg.counters[("queued", "transfer")] == 2 and limiter.waited == 2
        assert agg.counters[("limited", "transfer_budget")] == 1 and not c.retries
        assert limiter.open_streams() == 0 and limiter.waiting() == 0

        short = PeerLimiter(PeerLimits(max_transfers=1, transfer_queue=2, transfer_wait_s=0.5))
        server2, port2, _ = serve(agg, "127.0.0.1:0", limits=short)
        try:
            hold, again = threading.Event(), queue.Queue()
            holder = threading.Thread(target=held_push, args=(f"127.0.0.1:{port2}", CFG, "w4", hold, again))
            holder.start()
            assert again.get(timeout=20) == ("sent", "w4")
            c2 = SwarmClient(f"127.0.0.1:{port2}", timeout_s=30, retry=Retry(budget_s=0))
            t0 = time.monotonic()
            with pytest.raises(Overloaded) as err:  # waited its 0.5 s, then refused
                c2.pull(0, "w1", agg.block(0).spec)
            assert err.value.reason == "transfer_wait" and time.monotonic() - t0 >= 0.5
            assert agg.counters[("limited", "transfer_wait")] == 1 and short.waiting() == 0
            hold.set()
            holder.join(timeout=20)
            c2.close()
        finally:
            server2.stop(0).wait()
    finally:
        release.set()
        c.close()
        pusher.join(timeout=10)
        for t in pullers:
            t.join(timeout=10)
        server.stop(0).wait()


def test_a_waiting_transfer_whose_caller_leaves_leaves_the_queue(tmp_path):
    """A pull waiting for the only slot is cancelled by its client: it leaves the queue at once (not
    after --transfer-wait-s, 60 s here) and holds nothing; the next transfer gets the slot in turn."""
    agg, limiter, server, address, release, results, pusher = one_slot_held(tmp_path, "w0", "w1")
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        assert results.get(timeout=20) == ("sent", "w0")
        call = pb_grpc.WorkerStub(channel).Pull(pb.PullRequest(block=0, worker_id="w1"), timeout=60)
        deadline = time.monotonic() + 20
        while limiter.waiting() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert limiter.waiting() == 1
        call.cancel()
        t0 = time.monotonic()
        while limiter.waiting() and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        assert limiter.waiting() == 0 and time.monotonic() - t0 < 5
        assert agg.counters[("limited", "transfer_wait")] == 1  # counted as a wait that ended unserved
        release.set()
        assert results.get(timeout=20)[0] == "ok"
        assert limiter.open_streams() == 0
    finally:
        release.set()
        channel.close()
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
                             str(tmp_path / "s"), "--max-streams-per-peer", "64", "--max-joins-per-minute", "64",
                             "--no-identities", "--audit", "0"],  # dozens of worker ids from one test process: ids as claims
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=open(tmp_path / "agg.log", "wb"),
                            stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        c = serving(address, proc)
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
    from btnode.aggregate.trust.claims import ClaimConfig
    from btnode.aggregate.round.rounds import RoundConfig
    from btnode.swarm.worker import BlockWorker, WorkerConfig

    tc, h = TrainConfig(steps=200, warmup=2), ClaimConfig().steps_per_round  # the claims `held_push` makes
    agg = SwarmAggregator(CFG, AggregatorConfig(round=RoundConfig(deadline_s=2.0)), tmp_path)
    join(agg, CFG, "other")
    server, port, stop = serve(agg, "127.0.0.1:0", limits=PeerLimits(max_transfers=1, max_workers=1, transfer_queue=0))
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
        assert got.pushes == 2 and got.outcomes.get("pending", 0) >= 1 and set(got.outcomes) <= {"pending", "late"}
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


def test_a_waiting_push_leaves_its_payload_with_its_sender(tmp_path):
    """A real aggregator process with one transfer slot and a queue: 24 workers each push once (so that
    every connection has carried a full upload, as a worker's has after its first round), then, while
    another push holds the slot, each pushes again and waits. The waiting pushes' payloads stay with
    their senders (HTTP/2 flow control; rpc/server.py turns off BDP probing, which let the server read
    a waiting push's whole upload): the server's RSS grows by a small part of their bytes. Then the
    slot frees and every waiting push is answered, none refused."""
    cfg = ModelConfig()  # the swarm's default block: 3.2 MB of fp32, ~0.8 MB an int8 upload
    k, port = 24, free_port()
    proc = subprocess.Popen([*CLI, "join", "--role", "aggregator", "--listen", f"127.0.0.1:{port}", "--state-dir",
                             str(tmp_path / "s"), "--max-transfers", "1", "--transfer-queue", "64",
                             "--max-streams-per-peer", "64", "--max-joins-per-minute", "64",
                             "--no-identities", "--audit", "0"],  # dozens of worker ids from one test process: ids as claims
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=open(tmp_path / "agg.log", "wb"),
                            stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    spec = {n: tuple(t.shape) for n, t in init_block(cfg, 0, 0).state_dict().items()}
    g = torch.Generator().manual_seed(0)  # random values: an upload zstd cannot shrink
    chunks = list(iter_chunks(encode_frames({n: 1e-3 * (torch.rand(s, generator=g) - 0.5) for n, s in spec.items()},
                                            Codec.INT8)))
    upload_mb = sum(len(c.data) for c in chunks) / 2**20
    channels = [grpc.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(k)]

    def push(i: int, attempt: int) -> int:
        header = PushHeader(worker_id=f"w{i}", block=0, base_version=0, samples=float(TrainConfig.batch), loss=1.0,
                            codec=Codec.INT8, update_id=f"w{i}-{attempt}", steps=(0,))
        messages = [pb.PushRequest(header=convert.push_header_to_pb(header)),
                    *(pb.PushRequest(chunk=convert.chunk_to_pb(c)) for c in chunks)]
        return pb_grpc.WorkerStub(channels[i]).Push(iter(messages), timeout=120).outcome

    try:
        c = serving(address, proc)
        join(c, cfg, "holder", *(f"w{i}" for i in range(k)))
        for i in range(k):  # one at a time: each connection carries a whole upload
            push(i, 0)
        release, held = threading.Event(), queue.Queue()
        holder = threading.Thread(target=held_push, args=(address, cfg, "holder", release, held))
        holder.start()
        assert held.get(timeout=60) == ("sent", "holder")
        time.sleep(0.5)
        before = rss_mb(proc.pid)
        answers: queue.Queue = queue.Queue()

        def second(i: int) -> None:
            try:
                answers.put(("answered", push(i, 1)))
            except grpc.RpcError as err:
                answers.put(("refused", err.code()))

        pushers = [threading.Thread(target=second, args=(i,)) for i in range(k)]
        for t in pushers:
            t.start()

        def queued() -> float:
            return sum(e["value"] for e in c.status_dict()["counters"] if e["name"] == "queued")

        deadline = time.monotonic() + 60
        while queued() < k and time.monotonic() < deadline:
            time.sleep(0.1)
        assert queued() == k and answers.empty()  # all waiting, none refused
        time.sleep(2.0)  # what each sender may send without a slot has arrived
        waiting = rss_mb(proc.pid)
        release.set()
        got = [answers.get(timeout=120) for _ in range(k)]
        assert all(kind == "answered" for kind, _ in got), got[:3]
        growth = waiting - before
        print(f"aggregator RSS: {before:.0f} MB with the slot held, {waiting:.0f} MB with {k} pushes of "
              f"{upload_mb:.2f} MB waiting (+{growth / k:.3f} MB a push)")
        assert growth < 0.25 * k * upload_mb, (growth, k * upload_mb)
        c.close()
    finally:
        for ch in channels:
            ch.close()
        proc.terminate()
        proc.wait(timeout=60)


def test_a_waiting_push_has_sent_no_more_than_the_servers_small_window(tmp_path):
    """A push waiting for the only transfer slot holds a server thread and what HTTP/2 let its sender send
    before its handler reads: the server's stream window (WAITING_WINDOW_BYTES, not gRPC's 64 KB: ~74 KB
    of RSS a waiting push on a bare sync server, against ~107 KB; docs/research.md, issue #40). Its
    1 KiB messages, counted as the client's gRPC takes them, stop at about the window (plus the few a
    client buffers); once the slot frees it is read and answered."""
    from btnode.rpc.server import WAITING_WINDOW_BYTES

    agg, limiter, server, address, release, results, pusher = one_slot_held(tmp_path, "w0", "w1")
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    taken, piece = [], pb.PushRequest(chunk=pb.Chunk(data=os.urandom(1 << 10)))

    def messages():
        yield pb.PushRequest(header=convert.push_header_to_pb(PushHeader(
            worker_id="w1", block=0, base_version=0, samples=float(TrainConfig.batch), loss=1.0, codec=Codec.INT8,
            update_id="w1-u", steps=(0,))))
        for _ in range(256):  # 256 KiB in all, four times gRPC's default window
            taken.append(1)
            yield piece

    outcome: queue.Queue = queue.Queue()
    caller = threading.Thread(target=lambda: outcome.put(_code(lambda: pb_grpc.WorkerStub(channel).Push(
        messages(), timeout=60))))
    try:
        assert results.get(timeout=20) == ("sent", "w0")
        caller.start()
        deadline = time.monotonic() + 20
        while limiter.waiting() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert limiter.waiting() == 1
        time.sleep(1.0)  # what the window lets through has gone
        assert len(taken) * 1.0 <= WAITING_WINDOW_BYTES / 1024 + 8, (len(taken), WAITING_WINDOW_BYTES)
        release.set()
        caller.join(timeout=30)
        assert not caller.is_alive() and not outcome.empty()  # answered once it had the slot
    finally:
        release.set()
        pusher.join(timeout=10)
        channel.close()
        server.stop(0).wait()


def _code(call) -> grpc.StatusCode:
    """A call's status code (OK when it returns)."""
    try:
        call()
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()
