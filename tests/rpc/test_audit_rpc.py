"""Work claims and replay audits over gRPC (docs/security.md, "Work claims and replay audits"): a
worker's claims cross the wire with its pushes, an update drawn for audit makes its worker send its
start state over SubmitState, and a state nobody waits for, or one its claim does not commit to, is
refused with its status code and reason."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest
import torch

from btnode.aggregate.trust.audit import AuditConfig
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.codec.frames import lazy_frames
from btnode.errors import MalformedInput
from btnode.protocol import PushHeader
from btnode.rpc.client import SwarmClient
from btnode.rpc.server import serve
from btnode.rpc.status import REASON_KEY
from btnode.swarm.worker import BlockWorker, WorkerConfig
from lab.fuzz import AUDITED, AUDITEE, CFG, await_state, start_state
from btnode.train.config import TrainConfig
from btnode.v2 import swarm_pb2 as pb
from btnode.v2 import swarm_pb2_grpc as pb_grpc
from procs import TINY_TRAIN, cli_fails, identity_env, operator, start, stop_all, wait_port

CORPUS = bytes(range(256)) * 16
TRAIN = TrainConfig(batch=4, warmup=1, steps=100)


@pytest.fixture
def audited(tmp_path):
    """An aggregator replaying every update (p = 1; probation 1) behind a real gRPC server, with
    its deadlines and audits run by a background thread, as the node runs them."""
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=30.0), audit=AuditConfig(share=1.0, probation=1),
                            claims=ClaimConfig.of(TRAIN, steps_per_round=2))
    agg = SwarmAggregator(CFG, acfg, tmp_path, corpus=CORPUS)
    server, port, stop = serve(agg, "127.0.0.1:0")
    done = threading.Event()

    def tick() -> None:
        while not done.wait(0.02):
            agg.tick()
            agg.run_audits()

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    yield agg, f"127.0.0.1:{port}"
    done.set()
    stop.set()
    server.stop(0).wait()
    t.join()


def until(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def state_header(update_id: str, worker: str = AUDITEE) -> PushHeader:
    """The push header a state upload names its update by (SubmitState matches it by ids alone)."""
    return PushHeader(worker_id=worker, block=0, base_version=0, samples=1.0, loss=1.0, codec=Codec.FP32,
                      update_id=update_id)


def test_drawn_updates_send_their_start_state_over_submit_state_and_pass_their_replay(audited):
    agg, address = audited
    link = SwarmClient(address, timeout_s=20)
    wcfg = WorkerConfig(worker_id="w", block=0, steps_per_round=2, codec=Codec.INT8, rounds=3, wait_timeout_s=60.0)
    worker = BlockWorker(CFG, TRAIN, wcfg, link, CORPUS, device=torch.device("cpu"))
    try:
        stats = worker.run()
    finally:
        link.close()
    # the first update (fresh optimizer: no state to send) is held on probation, replayed, then applied;
    # the next two are drawn, held until their verdict (answered PROBATION: not applied yet), and their
    # start states sent over SubmitState before their replays
    assert stats.outcomes == {"probation": 3}
    assert stats.applied == 3 and stats.dropped == {}  # each round receipt came with the next version
    assert agg.audits is not None
    until(lambda: agg.audits.totals().counts == {("passed", ""): 3})  # the last state is in; its replay follows
    assert agg.meter.snapshot()[1]["submit_state"][0] == 2
    assert [(r.name, r.audited, r.failed) for r in agg.status().identities] == [("w", 3, 0)]
    until(lambda: agg.block(0).info.version == 3)  # every round closed with its one update applied
    assert agg.block(0).info.accepted == 1


def test_a_state_no_audit_waits_for_is_invalid_argument_with_reason_no_audit(audited):
    agg, address = audited
    stub = pb_grpc.WorkerStub(grpc.insecure_channel(address))
    header = pb.PushHeader(worker_id="w", block=0, samples=1.0, codec=pb.CODEC_FP32, update_id="nobody")
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitState(iter([pb.SubmitStateRequest(header=header)]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(err.value.trailing_metadata())[REASON_KEY] == "no_audit"
    client = SwarmClient(address, timeout_s=10)
    with pytest.raises(MalformedInput, match="no audit waits for the state of update 'nobody'") as exc:
        client.submit_state(state_header("nobody", "w"), lazy_frames(start_state(), Codec.FP32))
    client.close()
    assert exc.value.reason == "no_audit" and agg.counters[("state_refused", "no_audit")] == 2
    with pytest.raises(grpc.RpcError) as err:  # a stream without its header
        stub.SubmitState(iter([pb.SubmitStateRequest(chunk=pb.Chunk(data=b"x"))]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(err.value.trailing_metadata())[REASON_KEY] == "no_header"


def test_a_state_its_claim_did_not_commit_to_is_refused_and_the_right_one_still_taken(audited):
    agg, address = audited
    await_state(agg)
    client = SwarmClient(address, timeout_s=10)
    with pytest.raises(MalformedInput, match="does not hash to the one its update's claim committed") as exc:
        client.submit_state(state_header(AUDITED), lazy_frames(start_state(seed=1), Codec.FP32))
    assert exc.value.reason == "state"
    # not a verdict: without mutual TLS anyone who saw the update id could have sent it
    assert agg.audits is not None and agg.audits.waiting_for(AUDITED) is not None
    assert not agg.identities.is_revoked(AUDITEE)
    client.submit_state(state_header(AUDITED), lazy_frames(start_state(), Codec.FP32))
    client.close()
    assert agg.audits.waiting_for(AUDITED) is None


def test_a_state_stream_cut_short_may_be_sent_again(audited):
    agg, address = audited
    await_state(agg)
    client = SwarmClient(address, timeout_s=10)
    state = start_state()
    with pytest.raises(MalformedInput) as exc:
        client.submit_state(state_header(AUDITED), lazy_frames(dict(list(state.items())[:-1]), Codec.FP32))
    assert exc.value.reason == "truncated"
    assert agg.audits is not None and agg.audits.waiting_for(AUDITED) is not None  # still waiting
    client.submit_state(state_header(AUDITED), lazy_frames(state, Codec.FP32))  # taken: its hashes fit the claim
    client.close()
    assert agg.audits.waiting_for(AUDITED) is None and agg.counters[("state_refused", "truncated")] == 1


def test_worker_processes_push_claims_to_an_auditing_aggregator_process(tmp_path):
    """Real processes: an aggregator with --audit 1 --probation 1 and two workers. Every push must
    carry a claim that fits its worker's chain, or it is rejected (reason claim or chain) and its
    worker revoked; both first updates are held on probation, replayed from the training terms the
    workers joined with, found bit for bit equal across processes, and then applied."""
    state = tmp_path / "agg"
    state.mkdir()
    procs = [start(["join", "--role", "aggregator", "--listen", "127.0.0.1:0", "--state-dir", str(state),
                    "--port-file", str(state / "port"), "--deadline", "5", "--audit", "1", "--probation", "1",
                    "--steps-per-round", "2", *TINY_TRAIN], state / "aggregator.log")]
    try:
        address = f"127.0.0.1:{wait_port(state / 'port', procs[0])}"
        workers = [start(["join", "--role", "worker", "--block", "0", "--peer", address, "--worker-id", w,
                          "--rounds", "1", "--steps-per-round", "2", "--codec", "int8", *TINY_TRAIN],
                         tmp_path / f"{w}.log", env=identity_env(state, w)) for w in ("w0", "w1")]
        procs += workers
        client = SwarmClient(address, timeout_s=10, security=operator(state))  # identities: the default

        def updates() -> dict[str, float]:
            assert procs[0].poll() is None, "the aggregator exited"
            return {c["labels"]["outcome"]: c["value"] for c in client.status_dict()["counters"] if c["name"] == "updates"}

        try:
            until(lambda: all(w.poll() is not None for w in workers), timeout_s=240)
            assert [w.returncode for w in workers] == [0, 0]
            assert updates() == {"probation": 2, "pending": 2, "applied": 2}  # held, audited, admitted, applied
            # each first update replayed on the aggregator's data and passed; the workers share the auditor's
            # recipe (CPU, one thread, this torch), so a pass is the bit-for-bit one (aggregate/audit.py). Each
            # worker sent its start state, which it keeps only when JoinReply.audits says the swarm replays
            st = client.status_dict()
            audited = {r["name"]: (r["audited"], r["failed"], r["revoked_at_unix"]) for r in st["identities"]
                       if r["role"] == "worker"}
            assert audited == {"w0": (1, 0, None), "w1": (1, 0, None)}, st["identities"]
            assert not [c for c in st["counters"] if c["name"] == "revoked"], st["counters"]
        finally:
            client.close()
    finally:
        stop_all(procs)


def test_an_auditing_aggregator_refuses_a_data_id_other_than_its_data(tmp_path):
    cli_fails("join", "--role", "aggregator", "--state-dir", str(tmp_path), "--audit", "0.5", "--data-id",
              "sha256:" + "0" * 64, *TINY_TRAIN, match="is not the id of --data (bundled:wikitext-2)")
