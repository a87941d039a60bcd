"""Delegated verification over gRPC (btnode.v2 Verification; docs/security.md, "Delegated verification"):
real BlockWorkers, each with its own enrolled identity and SwarmClient under mutual TLS, replay each
other's rounds through Duties, VerifyInputs and Attest against a real aggregator; calls that are not
the caller's to make are refused with their status code, and change nothing."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.codecs import Codec
from btnode.data.corpus import bundled
from btnode.errors import Forbidden, MalformedInput, Refused
from btnode.model.config import ModelConfig
from btnode.aggregate.trust.identities import Role
from btnode.node.relay import run_relay
from btnode.protocol import Attestation, attest_statement
from btnode.rpc import security
from btnode.rpc.certs import sign
from btnode.rpc.client import SwarmClient
from btnode.rpc.enroll import SwarmAuthority, enroll, identity_security, serve_enrollment
from btnode.rpc.server import serve
from btnode.rpc.status import REASON_KEY
from btnode.rpc.verification import VERIFY_REFUSED
from btnode.swarm.verify import Verification
from btnode.swarm.worker import BlockWorker, WorkerConfig, WorkerStats
from btnode.train.config import TrainConfig
from btnode.v2 import swarm_pb2 as pb
from btnode.v2 import swarm_pb2_grpc as pb_grpc
from lab.cheats import AccusingWorker

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1,))
TRAIN = TrainConfig(batch=4, warmup=1, steps=100)
H = 2
NAMES = ("w0", "w1", "w2", "w3")
CORPUS = bundled().train.read(0, 200_000)


@dataclass
class Swarm:
    agg: SwarmAggregator
    address: str
    folder: Path  # each identity's enrolled folder is folder / name
    clients: dict[str, SwarmClient]

    def client(self, name: str) -> SwarmClient:
        c = self.clients[name] = SwarmClient(self.address, timeout_s=20, security=identity_security(self.folder / name))
        return c


@pytest.fixture
def swarm(tmp_path, request) -> Iterator[Swarm]:
    """An aggregator that replays every update (p = 1, no probation: every update drawn) and delegates the
    replays (4 replicas ≥ --verify-min-workers 3), with identities as a fresh swarm has them: its own CA,
    each worker enrolled with a join code, mutual TLS. Its deadlines and verdicts run on a thread, as the
    node runs them. Indirectly parametrized with the share of delegated replays it also replays itself
    (--verify-spot; default the shipped one)."""
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=60.0), claims=ClaimConfig.of(TRAIN, steps_per_round=H))
    spot = getattr(request, "param", acfg.delegation.spot)
    acfg = dataclasses.replace(acfg, audit=dataclasses.replace(acfg.audit, share=1.0, probation=0),
                               delegation=dataclasses.replace(acfg.delegation, spot=spot))
    authority = SwarmAuthority.create(tmp_path / "state")
    agg = SwarmAggregator(CFG, acfg, tmp_path / "state", corpus=CORPUS)
    enrollment, _ = serve_enrollment(authority, "127.0.0.1:0")
    server, port, stop = serve(agg, "127.0.0.1:0", security=authority.security())
    done = threading.Event()

    def tick() -> None:
        while not done.wait(0.02):
            agg.tick()
            agg.run_audits()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    for name in NAMES:
        code, _ = authority.mint(name=name, host="127.0.0.1")
        enroll(code, tmp_path / name)
    s = Swarm(agg, f"127.0.0.1:{port}", tmp_path, {})
    yield s
    for c in s.clients.values():
        c.close()
    done.set()
    stop.set()
    server.stop(0).wait()
    enrollment.stop(0).wait()
    ticker.join()


class Idle(BlockWorker):
    """Trains and pushes honestly, and leaves every verification duty undone."""

    def verify(self) -> int:
        return 0


def start_workers(s: Swarm, rounds: int, kind: type[BlockWorker] = BlockWorker,
                  stop: threading.Event | None = None,
                  kinds: dict[str, type[BlockWorker]] | None = None) -> tuple[list[BlockWorker], Callable[[], None]]:
    """The four workers (of `kind`, or as `kinds` names them), each over its own client, run() in threads until
    each made `rounds` pushes (or `stop` is set); returns them and a function that waits for them and checks
    that each ended cleanly."""
    workers = [(kinds or {}).get(n, kind)(CFG, TRAIN, WorkerConfig(worker_id=n, block=0, steps_per_round=H,
                                                                   codec=Codec.INT8, rounds=rounds, wait_timeout_s=60.0),
                                          s.client(n), CORPUS, device=torch.device("cpu"))
               for n in NAMES]
    results: dict[str, WorkerStats | BaseException] = {}

    def go(w: BlockWorker) -> None:
        try:
            results[w.wcfg.worker_id] = w.run(stop)
        except BaseException as exc:  # noqa: BLE001 - reported by `joined`
            results[w.wcfg.worker_id] = exc

    threads = [threading.Thread(target=go, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()

    def joined() -> None:
        for t in threads:
            t.join(timeout=120)
        assert all(isinstance(r, WorkerStats) for r in results.values()) and len(results) == 4, results

    return workers, joined


def until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("swarm", [0.0, 1.0], indirect=True, ids=["refereed", "spot_checked"])
def test_workers_verify_each_others_rounds_over_grpc(swarm):
    """Spot-checked (the aggregator replays each task too, and its verdict decides): every verifier's digest,
    replayed from what came over VerifyInputs, must equal the aggregator's own bit for bit, or it is revoked."""
    workers, joined = start_workers(swarm, rounds=3)
    joined()
    agg, delegated = swarm.agg, swarm.agg.delegated
    assert delegated is not None and delegated.counts.get("tasks", 0) > 0, delegated.counts if delegated else None
    done = {w.wcfg.worker_id: w.stats.verified for w in workers}
    assert sum(done.values()) > 0, done
    # the replays ran on the workers: each attested over gRPC under its own identity (its work is metered)
    assert delegated.work and set(delegated.work) <= set(NAMES), delegated.work
    assert agg.meter.snapshot()[1]["verify_inputs"][0] >= len(delegated.work)
    assert agg.audits is not None
    until(lambda: agg.audits.totals().counts.get(("passed", ""), 0) >= delegated.counts["tasks"] - 4)
    assert set(agg.audits.totals().counts) == {("passed", "")}, agg.audits.totals().counts  # every verdict passed
    assert not delegated.counts.get("disputes") and not agg.identities.revoked
    assert not [k for k in agg.counters if k[0] in (VERIFY_REFUSED, "revoked")], agg.counters
    assert agg.block(0).info.version == 3


def test_verification_calls_not_the_callers_to_make_are_refused_and_change_nothing(swarm):
    """Workers that leave their duties undone leave their first round's tasks open (and the round with them:
    every update waits for its verdict); another identity cannot attest one, read its inputs, or send a
    dispute state nobody asked for; its own verifier still can."""
    stop = threading.Event()
    _, joined = start_workers(swarm, rounds=1, kind=Idle, stop=stop)
    agg, delegated = swarm.agg, swarm.agg.delegated
    assert delegated is not None
    # an update drawn and handed to verifiers (one pushed before two others had is replayed by the aggregator)
    until(lambda: len(delegated.tasks) >= 1)
    with delegated.lock:
        task_id, open_task = next(iter(delegated.tasks.items()))
        verifier, author = open_task.verifiers[0], open_task.author
    stranger = next(n for n in NAMES if n not in (author, *open_task.verifiers))
    client = swarm.clients[stranger]
    before = (agg.block(0).info.sha256, dict(agg.counters))
    digest = "0" * 64
    with pytest.raises(MalformedInput, match="has no open verification task") as exc:  # INVALID_ARGUMENT
        client.attest(0, Attestation(task_id, stranger, digest, 1.0))
    assert exc.value.reason == "no_task"
    with pytest.raises(Refused, match="no verification task"):  # none came to it: nothing to check its inputs by
        client.verify_inputs(0, task_id, stranger)
    with pytest.raises(MalformedInput, match="unknown tensor 'x'"):  # checked against RoundReplay.state_spec
        client.submit_dispute_state(0, task_id, stranger, 1, {"x": torch.zeros(1)})
    whole = {n: torch.zeros(shape) for n, shape in agg.replayers[0].replay.state_spec().items()}
    with pytest.raises(MalformedInput, match="no dispute asks"):  # a whole state, but no dispute asked for it
        client.submit_dispute_state(0, task_id, stranger, 1, whole)
    assert not delegated.tasks[task_id].attests and not agg.identities.revoked  # the task and the swarm as they were
    assert agg.block(0).info.sha256 == before[0]
    assert agg.counters[(VERIFY_REFUSED, "no_task")] == before[1].get((VERIFY_REFUSED, "no_task"), 0) + 2
    assert not [k for k in agg.counters if k[0] == "identity_refused"]
    # the raw wire: another's inputs, a bad digest and a dispute state without a header are INVALID_ARGUMENT
    stub = pb_grpc.VerificationStub(client.channel)
    with pytest.raises(grpc.RpcError) as err:
        next(stub.VerifyInputs(pb.VerifyInputsRequest(task_id=task_id, worker_id=stranger), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and dict(err.value.trailing_metadata())[REASON_KEY] == "no_task"
    with pytest.raises(grpc.RpcError) as err:
        stub.Attest(pb.AttestRequest(task_id=task_id, verifier=stranger, digest=b"short", seconds=1.0), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and dict(err.value.trailing_metadata())[REASON_KEY] == "digest"
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitDisputeState(iter([pb.SubmitDisputeStateRequest(chunk=pb.Chunk(data=b"x"))]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and dict(err.value.trailing_metadata())[REASON_KEY] == "no_header"
    # the task's own verifier does its duties over gRPC (Duties, VerifyInputs, the replay, Attest): taken
    assert Verification(CFG, 0, CORPUS, swarm.clients[verifier], verifier).run() >= 1
    assert task_id not in delegated.tasks or verifier in delegated.tasks[task_id].attests
    assert delegated.work.get(verifier, 0) > 0 and not agg.identities.revoked
    # attesting in another's name is impersonation: refused and revoked, as any call under a foreign worker id
    with pytest.raises(Forbidden):
        client.attest(0, Attestation(task_id, verifier, digest, 1.0))
    assert agg.identities.is_revoked(stranger)
    stop.set()
    joined()


@pytest.fixture
def relayed(tmp_path) -> Iterator[Swarm]:
    """The `swarm` fixture's root (every update drawn, replays delegated) with its four workers behind one
    relay (the daemon's own, run_relay, under its enrolled relay identity): the root sees the children only
    through the relay, and hands their duties to it."""
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=60.0), claims=ClaimConfig.of(TRAIN, steps_per_round=H))
    acfg = dataclasses.replace(acfg, audit=dataclasses.replace(acfg.audit, share=1.0, probation=0))
    authority = SwarmAuthority.create(tmp_path / "state")
    agg = SwarmAggregator(CFG, acfg, tmp_path / "state", corpus=CORPUS)
    enrollment, _ = serve_enrollment(authority, "127.0.0.1:0")
    server, port, stop = serve(agg, "127.0.0.1:0", security=authority.security())
    for name in NAMES:
        enroll(authority.mint(name=name, host="127.0.0.1")[0], tmp_path / name)
    enroll(authority.mint(name="r1", role=Role.RELAY, host="127.0.0.1")[0], tmp_path / "r1")
    done = threading.Event()

    def tick() -> None:
        while not done.wait(0.02):
            agg.tick()
            agg.run_audits()

    before = security.current()
    security.configure(identity_security(tmp_path / "r1"))  # run_relay serves and dials as the process's identity
    port_file = tmp_path / "relay.port"
    threads = [threading.Thread(target=tick, daemon=True),
               threading.Thread(target=run_relay, args=(CFG, AggregatorConfig(round=RoundConfig(deadline_s=60.0),
                                                                             claims=acfg.claims)), daemon=True,
                                kwargs={"peers": [f"127.0.0.1:{port}"], "listen": "127.0.0.1:0", "blocks": [0],
                                        "state_dir": tmp_path / "relay", "name": "r1", "port_file": port_file,
                                        "stop": done})]
    for t in threads:
        t.start()
    try:
        until(lambda: port_file.exists() and port_file.read_text().strip() != "")
        s = Swarm(agg, f"127.0.0.1:{int(port_file.read_text())}", tmp_path, {})
        s.root = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
        yield s
        for c in s.clients.values():
            c.close()
    finally:
        done.set()
        for t in threads:
            t.join(timeout=30)
        security.configure(before)
        stop.set()
        server.stop(0).wait()
        enrollment.stop(0).wait()


def test_children_behind_a_relay_verify_each_other_through_it(relayed):
    """Four workers behind a relay: the root hands their duties to the relay, which keeps them for each child
    and tells it on its version stream; the children fetch the inputs, replay and attest through the relay
    (each attestation signed by its verifier, checked at the root), and every verdict passes."""
    workers, joined = start_workers(relayed, rounds=3)
    joined()
    agg, delegated = relayed.agg, relayed.agg.delegated
    assert delegated is not None and delegated.counts.get("tasks", 0) > 0, delegated.counts if delegated else None
    assert {agg.relays_for(n) for n in NAMES} == {"r1"}  # from its commits (Draw)
    done = {w.wcfg.worker_id: w.stats.verified for w in workers}
    assert sum(done.values()) > 0, done
    assert delegated.work and set(delegated.work) <= set(NAMES), delegated.work  # the children's work, not the relay's
    assert agg.audits is not None
    until(lambda: agg.audits.totals().counts.get(("passed", ""), 0) >= delegated.counts["tasks"] - 4)
    assert set(agg.audits.totals().counts) == {("passed", "")}, agg.audits.totals().counts
    assert not delegated.counts.get("disputes") and not agg.identities.revoked
    assert not [k for k in agg.counters if k[0] in (VERIFY_REFUSED, "revoked", "identity_refused")], agg.counters
    assert all(w.stats.pushes == 3 and not w.stats.dropped for w in workers), [w.stats for w in workers]
    # each identity's verifier work, as `btnode status` shows it
    records = {r.name: r for r in agg.status().identities}
    assert sum(records[n].verified for n in NAMES) == sum(delegated.upheld.values()) > 0
    assert all(records[n].verify_s == delegated.work.get(n, 0.0) for n in NAMES) and records["r1"].verified == 0


def test_a_dispute_behind_a_relay_is_refereed_through_it(relayed):
    """A child that accuses every round it verifies: the traces (signed by each party) and the accuser's
    final state reach the root through the relay, the referee encodes that state once, and the accuser
    alone is revoked; the authors' updates stand."""
    stop = threading.Event()
    _, joined = start_workers(relayed, rounds=2, kinds={"w3": AccusingWorker}, stop=stop)
    agg, delegated = relayed.agg, relayed.agg.delegated
    assert delegated is not None
    until(lambda: agg.identities.is_revoked("w3"), timeout_s=90)
    stop.set()
    joined()
    assert set(agg.identities.revoked) == {"w3"} and delegated.counts.get("disputes", 0) >= 1, delegated.counts
    assert "local_after_dispute" not in delegated.counts  # decided by the traces and one encode, not a replay
    assert agg.counters[("revoked", "verifier")] == 1
    assert not [k for k in agg.counters if k[0] in (VERIFY_REFUSED, "identity_refused")], agg.counters


def test_a_relay_cannot_forge_its_childrens_verdicts(relayed):
    """The relay's own identity, calling the root: an attestation or a trace in a child's name without the
    child's signature (or with one over something else) is refused (`signature`) and changes nothing; a call
    for a worker that does not push through it is another's name: refused, and the relay revoked."""
    stop = threading.Event()
    _, joined = start_workers(relayed, rounds=1, kind=Idle, stop=stop)
    agg, delegated = relayed.agg, relayed.agg.delegated
    assert delegated is not None
    until(lambda: len(delegated.tasks) >= 1 and all(agg.relays_for(n) == "r1" for n in NAMES))
    with delegated.lock:
        task_id, open_task = next(iter(delegated.tasks.items()))
        verifier = open_task.verifiers[0]
    relay = SwarmClient(relayed.root, timeout_s=20, security=identity_security(relayed.folder / "r1"))
    child = identity_security(relayed.folder / verifier)
    try:
        forged = Attestation(task_id, verifier, "0" * 64, 1.0, cert=child.cert.read_bytes(), signature=b"\x30\x06")
        with pytest.raises(Forbidden) as exc:
            relay.attest(0, forged)  # signed by nobody: the relay's own client signs only what is unsigned
        assert exc.value.reason == "signature"
        honest = Attestation(task_id, verifier, "1" * 64, 1.0)
        signed = dataclasses.replace(honest, cert=child.cert.read_bytes(),
                                     signature=sign(child.key.read_bytes(), attest_statement(0, honest)))
        with pytest.raises(Forbidden) as exc:  # the child's signature, over another digest
            relay.attest(0, dataclasses.replace(signed, digest="0" * 64))
        assert exc.value.reason == "signature"
        with pytest.raises(Forbidden) as exc:
            relay.submit_trace(0, task_id, verifier, ("0" * 64,), proof=(child.cert.read_bytes(), signed.signature))
        assert exc.value.reason == "signature"
        assert not delegated.tasks[task_id].attests and not agg.identities.revoked
        stub = pb_grpc.VerificationStub(relay.channel)  # (the client itself reads only tasks that came to it)
        with pytest.raises(grpc.RpcError) as err:  # a name that does not push through r1
            next(stub.VerifyInputs(pb.VerifyInputsRequest(block=0, task_id=task_id, worker_id="w-elsewhere"),
                                   timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert agg.identities.is_revoked("r1")
    finally:
        relay.close()
        stop.set()
        joined()
