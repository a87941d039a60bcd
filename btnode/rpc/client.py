"""`SwarmClient`: the worker's Upstream (btnode.protocol) over gRPC. Status codes come back as domain errors;
a push that was judged by content (stale, invalid) comes back as a Judgement the worker can act on.
A call the server refused for now (Overloaded: over one of its limits) is retried with a jittered
exponential backoff for up to `Retry.budget_s`, and each retry counted; an unreachable server
(PeerUnavailable) is left to the caller, which knows how long an outage it may wait through."""

from __future__ import annotations

import functools
import json
import logging
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
import torch

from btnode.codec.codecs import Codec
from btnode.codec.frames import Bundle, ChunkData, Frame, FrameAssembler, iter_chunks, lazy_frames, stream_digest
from btnode.errors import Forbidden, MalformedInput, Overloaded, PeerInputError, Refused
from btnode.model.config import ModelConfig
from btnode.protocol import (
    EMPTY_STATE,
    OPTIMIZER_PREFIX,
    RESIDUAL_PREFIX,
    Attestation,
    Drawn,
    Duties,
    EvidenceChild,
    JoinInfo,
    Judgement,
    Outcome,
    Pulled,
    PushHeader,
    RoundReceipt,
    Transfer,
    VerifyTask,
    VersionInfo,
    attest_statement,
    join_statement,
    receipt_statement,
    trace_statement,
)
from btnode.rpc import convert
from btnode.rpc.certs import sign
from btnode.rpc.security import Security, channel, current
from btnode.rpc.server import CHANNEL_OPTIONS
from btnode.rpc.status import error_from_rpc
from btnode.store.models import init_unit
from btnode.train.terms import TrainingTerms
from btnode.train.trainers import optimizer_spec
from btnode.v2 import swarm_pb2 as pb
from btnode.v2 import swarm_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Retry:
    """How a refused call is retried: waits drawn uniformly from [0, min(cap_s, base_s · 2^n)] ("full
    jitter", so that a thousand refused workers do not come back together), for up to budget_s."""

    budget_s: float = 120.0  # then the Overloaded error is raised to the caller
    base_s: float = 0.2
    cap_s: float = 5.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.cap_s, self.base_s * 2**attempt))


class SwarmClient:
    def __init__(self, address: str, *, timeout_s: float = 120.0, security: Security | None = None,
                 retry: Retry = Retry(), on_retry: Callable[[str, str], None] = lambda what, reason: None,
                 relay_id: str = ""):
        """`on_retry(what, reason)` is called before each retry of a refused call (a worker counts them).
        `relay_id`: a relay's link to its parent, under that name: its version streams and the joins it
        passes on say so, for a parent without mutual TLS (docs/relays.md, "Membership")."""
        self.address = address
        self.relay_id = relay_id
        self.timeout_s = timeout_s
        self.retry, self.on_retry = retry, on_retry
        self.retries: Counter[tuple[str, str]] = Counter()  # (call, reason) → retries
        self._rng = random.Random()
        self.channel = channel(address, CHANNEL_OPTIONS, security)
        self.security = security or current()  # its certificate and key sign joins and pushes under mutual TLS
        self.stub = pb_grpc.WorkerStub(self.channel)
        self.relay_stub = pb_grpc.RelayStub(self.channel)
        self.operator_stub = pb_grpc.OperatorStub(self.channel)
        self._watches: list[tuple[str, grpc.Future]] = []  # (worker id, call)
        self._receipts: OrderedDict[str, RoundReceipt] = OrderedDict()  # update id → its receipt, from Watch
        self._wanted: dict[str, tuple[str, ...]] = {}  # worker id → the start states its last Watch reply asked for
        self._duties_told: set[str] = set()  # worker ids whose Watch said verification duties wait
        self._configs: dict[int, str] = {}  # block → the model settings (JSON) joined with: a task's tensors' shapes
        self._tasks: OrderedDict[str, VerifyTask] = OrderedDict()  # task id → the verification task Duties gave
        self.verify_stub = pb_grpc.VerificationStub(self.channel)

    def _retrying(self, what: str, attempt: Callable[[], T], *, replayable: bool = True) -> T:
        """attempt(), again after a backoff while the server refuses it for now (Overloaded)."""
        start, n = time.monotonic(), 0
        while True:
            try:
                return attempt()
            except Overloaded as exc:
                wait = self.retry.delay(n, self._rng)
                if not replayable or time.monotonic() - start + wait > self.retry.budget_s:
                    raise
                self.retries[(what, exc.reason)] += 1
                self.on_retry(what, exc.reason)
                log.debug("%s refused for now (%s); retrying in %.2f s", what, exc.reason, wait)
                time.sleep(wait)
                n += 1

    def _call(self, what: str, fn, *args, replayable: bool = True, **kwargs):
        def once():
            try:
                return fn(*args, timeout=self.timeout_s, **kwargs)
            except grpc.RpcError as err:
                raise error_from_rpc(err, f"{what} at {self.address}") from None
        return self._retrying(what, once, replayable=replayable)

    def _credentials(self) -> tuple[bytes, bytes] | None:
        """This node's certificate and key (PEM), when it has both: it signs with them."""
        sec = self.security
        if sec.cert is None or sec.key is None:
            return None
        return sec.cert.read_bytes(), sec.key.read_bytes()

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str = "", *,
             training_json: str = "", relay: bool = False, proof: tuple[bytes, bytes] | None = None) -> JoinInfo:
        """`proof`: a worker's certificate and signature over the join, passed on by a relay; without
        it a worker with a certificate signs its own join (protocol.join_statement) over the JSON text
        the aggregator rebuilds from the typed settings (the same as `training_json` for any text
        TrainingTerms.to_json wrote). Settings that are not TrainingTerms raise MalformedInput here."""
        training = convert.training_to_pb(TrainingTerms.from_json(training_json)) if training_json else None
        mine = self._credentials() if proof is None and not relay else None
        if mine is not None:
            text = convert.training_json_from_pb(training) if training is not None else ""
            proof = mine[0], sign(mine[1], join_statement(worker_id, block, fingerprint, data_id, text))
        cert, signature = proof or (b"", b"")
        self._configs[block] = config_json
        reply = self._call("join", self.stub.Join, pb.JoinRequest(worker_id=worker_id, block=block,
                                                                  fingerprint=fingerprint,
                                                                  config=convert.model_text_to_pb(config_json),
                                                                  data_id=data_id, training=training,
                                                                  relay=relay, cert=cert, signature=signature,
                                                                  relayed_by="" if relay else self.relay_id))
        return convert.join_from_pb(reply)

    def signed(self, header: PushHeader, frames: list[Frame | Bundle]) -> PushHeader:
        """A worker's push header signed with its certificate's key (protocol.receipt_statement), so that
        a relay's manifest can carry the proof to the root; as it was without a certificate."""
        mine = self._credentials()
        if mine is None or header.manifest or header.signature:
            return header
        digest = stream_digest(frames)
        return replace(header, cert=mine[0], signature=sign(mine[1], receipt_statement(header, digest)))

    def leave(self, worker_id: str, block: int) -> None:
        self._call("leave", self.stub.Leave, pb.LeaveRequest(worker_id=worker_id, block=block))

    def _tensor_stream(self, what: str, call, spec: Mapping[str, tuple[int, ...]], codecs: list[Codec]) -> Pulled:
        """Read one info message then chunks, validating every frame against `spec`."""
        t0 = time.perf_counter()
        asm = FrameAssembler.for_spec(spec, codecs)
        info = None
        try:
            for msg in call:
                kind = msg.WhichOneof("kind")
                if kind == "info" and info is None:
                    info = convert.info_from_pb(msg.info)
                elif kind == "chunk" and info is not None:
                    asm.add(convert.chunk_from_pb(msg.chunk))
                else:
                    raise MalformedInput("stream", f"{what}: unexpected {kind} message")
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"{what} at {self.address}") from None
        except PeerInputError:
            call.cancel()
            raise
        if info is None:
            raise MalformedInput("truncated", f"{what}: stream ended before its version info")
        tensors = asm.finish()
        raw = sum(len(b) for b in asm.raw.values())
        return Pulled(info=info, tensors=tensors, transfer=Transfer(raw=raw, wire=asm.wire_bytes,
                                                                  seconds=time.perf_counter() - t0), raw=asm.raw)

    def pull(self, block: int, worker_id: str, spec: Mapping[str, tuple[int, ...]]) -> Pulled:
        request = pb.PullRequest(block=block, worker_id=worker_id, bundles=True)
        return self._retrying("pull", lambda: self._tensor_stream(
            "pull", self.stub.Pull(request, timeout=self.timeout_s), spec, [Codec.FP32]))

    def fetch_delta(self, block: int, version: int, spec: Mapping[str, tuple[int, ...]]) -> Pulled:
        request = pb.FetchDeltaRequest(block=block, version=version, bundles=True)
        return self._retrying("fetch delta", lambda: self._tensor_stream(
            "fetch delta", self.stub.FetchDelta(request, timeout=self.timeout_s), spec, list(Codec)))

    def push(self, header: PushHeader, frames: Iterable[Frame | Bundle], *, raising: tuple[str, ...] = ()) -> Judgement:
        """Push an update; invalid or stale updates come back as REJECTED/STALE judgements (a refusal
        whose reason is in `raising` is raised instead: FailoverLink joins again on `not_joined`).
        `frames` may be a lazy iterator, consumed by gRPC's sending thread chunk by chunk; then a
        refused push is not retried here (its frames are spent). An iterable that makes fresh frames
        each time it is iterated (a list, `ReplayableFrames`) is retried."""
        if self._credentials() is not None and not header.manifest:
            frames = list(frames)  # the receipt signs the frames' digest, which the header carries before them
            header = self.signed(header, frames)
        try:
            reply = self._call("push", lambda timeout: self.stub.Push(_messages(header, frames), timeout=timeout),
                               replayable=not isinstance(frames, Iterator))
        except Forbidden:  # this identity may not push (revoked, another's worker id): retrying cannot help
            raise
        except PeerInputError as exc:
            if exc.reason in raising:
                raise
            outcome = Outcome.STALE if exc.reason == "stale" else Outcome.REJECTED
            return Judgement(outcome=outcome, reason=str(exc), round_version=header.base_version)
        return convert.judgement_from_pb(reply)

    def draw(self, header: PushHeader, digest: str, relay: str = "", *, refused: bool = False) -> Drawn:
        """A relay's commit of a child's update (`header`, its frames' `digest`) to a root that replays
        audits (aggregate/trust/commits.py); `relay`: its name (read by a root without mutual TLS only);
        `refused`: one it answered LATE or STALE, whose claim only moves the worker's chain on.
        A refusal raises its PeerInputError (chain, claim, revoked, ...)."""
        reply = self._call("draw", self.relay_stub.Draw, pb.DrawRequest(header=convert.push_header_to_pb(header),
                                                                  digest=bytes.fromhex(digest), relay=relay,
                                                                  refused=refused))
        return Drawn(drawn=reply.drawn, token=bytes(reply.token))

    def submit_state(self, header: PushHeader, frames: Iterable[Frame | ChunkData]) -> None:
        """Send the start state of an update drawn for audit (Upstream (btnode.protocol).submit_state): its push
        header, then its fp32 frames (or their chunks as received, which a relay passes on). A refusal
        raises its PeerInputError (no_audit, state, ...)."""
        self._call("state upload",
                   lambda timeout: self.stub.SubmitState(_messages(header, frames, pb.SubmitStateRequest),
                                                         timeout=timeout),
                   replayable=not isinstance(frames, Iterator))

    def submit_evidence(self, header: PushHeader, unit: float, parts: Iterable[EvidenceChild | Frame]) -> None:
        """A relay's evidence for its combined push `header` (aggregate/trust/evidence.py): each child's
        EvidenceChild, then its frames, read lazily (re-read on a retry unless `parts` is an iterator).
        A refusal raises its PeerInputError (no_audit, evidence, ...)."""

        def messages() -> Iterator[pb.SubmitEvidenceRequest]:
            yield pb.SubmitEvidenceRequest(header=pb.EvidenceHeader(push=convert.push_header_to_pb(header), unit=unit))
            for p in parts:
                if isinstance(p, EvidenceChild):
                    yield pb.SubmitEvidenceRequest(child=convert.evidence_child_to_pb(p))
                else:
                    for chunk in iter_chunks([p]):
                        yield pb.SubmitEvidenceRequest(chunk=convert.chunk_to_pb(chunk))

        self._call("evidence upload", lambda timeout: self.relay_stub.SubmitEvidence(messages(), timeout=timeout),
                   replayable=not isinstance(parts, Iterator))

    def watch(self, block: int, worker_id: str) -> Iterator[VersionInfo]:
        """Version announcements as they happen; ends (PeerUnavailable) when the stream breaks."""
        call = self.stub.Watch(pb.WatchRequest(block=block, worker_id=worker_id,
                                               relay="" if worker_id else self.relay_id))
        self._watches.append((worker_id, call))
        last = -1
        try:
            for msg in call:
                info = convert.info_from_pb(msg.version)
                if msg.duties:
                    self._duties_told.add(worker_id)  # `duties_waiting` says so once
                if info.version == last:
                    continue  # the same version again: it came only to say that duties wait
                last = info.version
                for r in msg.receipts:  # before the version is handed on: its reader may ask for them at once
                    self._keep_receipt(convert.round_receipt_from_pb(r))
                self._wanted[worker_id] = tuple(msg.states_wanted)
                yield info
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"watch at {self.address}") from None
        finally:
            if (worker_id, call) in self._watches:
                self._watches.remove((worker_id, call))

    def _keep_receipt(self, r: RoundReceipt) -> None:
        self._receipts[r.update_id] = r
        while len(self._receipts) > 64:
            self._receipts.popitem(last=False)

    def receipt(self, block: int, worker_id: str, update_id: str) -> RoundReceipt | None:
        """The round receipt the watch stream brought with its version, else asked for (RoundReceipt);
        None while pending, unknown there, or from an older aggregator without receipts."""
        if (kept := self._receipts.get(update_id)) is not None:
            return kept
        request = pb.RoundReceiptRequest(block=block, worker_id=worker_id, update_id=update_id)
        try:
            reply = self.stub.RoundReceipt(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise error_from_rpc(err, f"round receipt at {self.address}") from None
        return convert.round_receipt_from_pb(reply.receipt) if reply.HasField("receipt") else None

    def duties_waiting(self, block: int, worker_id: str) -> bool:
        """Whether the version stream said duties wait for `worker_id` since the last call (no call made)."""
        if worker_id in self._duties_told:
            self._duties_told.discard(worker_id)
            return True
        return False

    def states_wanted(self, block: int, worker_id: str) -> tuple[str, ...]:
        """The start states the last version's Watch reply asked for (taken once), else asked for with a
        RoundReceipt call (a worker without a watch stream)."""
        if (kept := self._wanted.pop(worker_id, None)) is not None:
            return kept
        request = pb.RoundReceiptRequest(block=block, worker_id=worker_id)
        try:
            reply = self.stub.RoundReceipt(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return ()
            raise error_from_rpc(err, f"round receipt at {self.address}") from None
        return tuple(reply.states_wanted)

    # -- delegated verification (swarm/verify.py; the server's side is rpc/verification.py) ---------------
    def duties(self, block: int, worker_id: str) -> Duties:
        """The verification work handed to `worker_id` since it last asked; none from an older aggregator
        (UNIMPLEMENTED). Its tasks are kept, so that their inputs can be checked against their claims."""
        try:
            reply = self.verify_stub.Duties(pb.DutiesRequest(block=block, worker_id=worker_id), timeout=self.timeout_s)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return Duties()
            raise error_from_rpc(err, f"duties at {self.address}") from None
        duties = convert.duties_from_pb(reply)
        for d in (duties, *duties.children.values()):  # a relay fetches its children's inputs through here too
            for task in [*d.tasks, *(t.task for t in d.traces), *(s.task for s in d.states)]:
                self._tasks[task.task_id] = task
                self._tasks.move_to_end(task.task_id)
        while len(self._tasks) > 4096:
            self._tasks.popitem(last=False)
        return duties

    def verify_inputs(self, block: int, task_id: str, worker_id: str) -> tuple[dict[str, torch.Tensor],
                                                                                dict[str, torch.Tensor]]:
        """(θ^base, the author's start state) of a task Duties gave, each frame checked against the shapes of
        the block this client joined and the start state its task's claim names."""
        base_spec, start_spec = self._inputs_spec(block, task_id)
        request = pb.VerifyInputsRequest(block=block, task_id=task_id, worker_id=worker_id)

        def attempt() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
            call = self.verify_stub.VerifyInputs(request, timeout=self.timeout_s)
            parts = {"base": _fp32_assembler(base_spec), "start": _fp32_assembler(start_spec)}
            try:
                for msg in call:
                    kind = msg.WhichOneof("kind")
                    if kind not in parts:
                        raise MalformedInput("stream", f"verify inputs: unexpected {kind} message")
                    parts[kind].add(convert.chunk_from_pb(getattr(msg, kind)))
            except grpc.RpcError as err:
                raise error_from_rpc(err, f"verify inputs at {self.address}") from None
            except PeerInputError:
                call.cancel()
                raise
            return dict(parts["base"].finish()), dict(parts["start"].finish())

        return self._retrying("verify inputs", attempt)

    def _inputs_spec(self, block: int, task_id: str) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        task, config = self._tasks.get(task_id), self._configs.get(block)
        if task is None or config is None or task.header.claim is None:
            raise Refused("no_task", f"no verification task {task_id[:16]!r} of block {block} came to this client")
        shapes, optimizer = _unit_spec(config, block)
        claim = task.header.claim
        start: dict[str, tuple[int, ...]] = {}  # as the aggregator's Replayer.start_spec (aggregate/trust/audit.py)
        if claim.optimizer_start != EMPTY_STATE:
            start.update({OPTIMIZER_PREFIX + n: s for n, s in optimizer})
        if claim.residual_start != EMPTY_STATE:
            start.update({RESIDUAL_PREFIX + n: s for n, s in shapes})
        return dict(shapes), start

    def attest(self, block: int, attestation: Attestation) -> None:
        """A verifier's result, signed with this node's key when it has one and the attestation is not
        signed yet (one a relay passes on is); MalformedInput(no_task) when the task is not its own, or closed."""
        mine = self._credentials()
        if mine is not None and not attestation.signature:
            attestation = replace(attestation, cert=mine[0],
                                  signature=sign(mine[1], attest_statement(block, attestation)))
        self._call("attest", self.verify_stub.Attest, convert.attestation_to_pb(block, attestation))

    def submit_trace(self, block: int, task_id: str, worker_id: str, trace: tuple[str, ...], *,
                     proof: tuple[bytes, bytes] | None = None) -> None:
        """A dispute's trace, signed as an attestation is; `proof`: a child's, which a relay passes on."""
        mine = self._credentials() if proof is None else None
        if mine is not None:
            proof = mine[0], sign(mine[1], trace_statement(block, task_id, worker_id, trace))
        cert, signature = proof or (b"", b"")
        self._call("trace upload", self.verify_stub.SubmitTrace,
                   pb.SubmitTraceRequest(block=block, task_id=task_id, worker_id=worker_id,
                                         trace=convert.trace_to_pb(trace), cert=cert, signature=signature))

    def submit_dispute_state(self, block: int, task_id: str, worker_id: str, k: int,
                             state: Mapping[str, torch.Tensor] | Iterable[ChunkData]) -> None:
        """The whole state after `k` steps that a dispute asked for: a header, then its fp32 frames.
        `state`: the tensors, or the chunks of a child's as they came (a relay passing it on, once)."""
        header = pb.DisputeStateHeader(block=block, task_id=task_id, worker_id=worker_id, k=k)
        whole = isinstance(state, Mapping)

        def messages() -> Iterator[pb.SubmitDisputeStateRequest]:
            yield pb.SubmitDisputeStateRequest(header=header)
            for chunk in iter_chunks(lazy_frames(state, Codec.FP32)) if whole else state:
                yield pb.SubmitDisputeStateRequest(chunk=convert.chunk_to_pb(chunk))

        self._call("dispute state upload",
                   lambda timeout: self.verify_stub.SubmitDisputeState(messages(), timeout=timeout), replayable=whole)

    def revoke(self, name: str) -> float:
        """Revoke the identity `name` (this client must hold an operator's certificate); returns
        the aggregator's time of the revocation."""
        return self._call("revoke", self.operator_stub.Revoke, pb.RevokeRequest(name=name)).revoked_at_unix

    def status(self) -> pb.StatusReply:
        return self._call("status", self.operator_stub.Status, pb.StatusRequest())

    def model_config(self) -> ModelConfig:
        """The swarm's model settings, from its Status."""
        return convert.model_from_pb(self.status().config)

    def status_dict(self) -> dict:
        """Status as plain data (for `btnode status` and `btnode doctor`); `node_version`: the build the
        aggregator runs."""
        t0 = time.time()
        st = self.status()
        rtt = time.time() - t0

        def info(v) -> dict:
            i = convert.info_from_pb(v)
            return {"version": i.version, "sha256": i.sha256, "accepted": i.accepted, "late": i.late,
                    "stale": i.stale, "rejected": i.rejected, "closed_by": i.closed_by, "mean_loss": i.mean_loss,
                    "included": list(i.included)}

        return {
            "fingerprint": st.fingerprint, "node_version": st.node_version,
            "config": convert.model_from_pb(st.config).to_dict(), "server_time_unix": st.server_time_unix,
            "sent_at_unix": t0, "rtt_s": rtt, "data_id": st.data_id,
            "blocks": [{"block": b.block, **{k: v for k, v in info(b.current).items()
                                             if k in ("version", "sha256")},
                        "replicas": list(b.replicas), "data_keys": dict(sorted(b.data_keys.items())),
                        "round_age_s": b.round_age_s,
                        "accepted_in_round": b.accepted_in_round,
                        "recent": [{**info(r.version), "closed_at_unix": r.closed_at_unix} for r in b.recent],
                        "relays": [{"name": r.name, "children": list(r.children), "last_version": r.last_version,
                                    "last_weight": r.last_weight, "pushes": r.pushes, "refused": r.refused}
                                   for r in b.relays]}
                       for b in st.blocks],
            "counters": [{"name": c.name, "labels": dict(c.labels), "value": c.value} for c in st.counters],
            "identities": [{"name": r.name, "role": _role_name(r.role), "fingerprint": r.fingerprint, "joined": list(r.joined),
                            "accepted": r.accepted, "refused": dict(sorted(r.refused.items())), "audited": r.audited,
                            "failed": r.failed, "revoked_at_unix": r.revoked_at_unix or None, "applied": r.applied,
                            "dropped": dict(sorted(r.dropped.items())), "verified": r.verified,
                            "verify_seconds": r.verify_seconds}
                           for r in st.identities],
        }

    def cancel_watches(self, worker_id: str | None = None) -> None:
        for wid, call in list(self._watches):
            if worker_id is None or wid == worker_id:
                call.cancel()

    def close(self) -> None:
        self.cancel_watches()
        self.channel.close()


def _fp32_assembler(spec: Mapping[str, tuple[int, ...]]) -> FrameAssembler:
    """An assembler of fp32 frames of `spec`; of none (a fresh start state), one that refuses every frame."""
    return FrameAssembler.for_spec(spec, [Codec.FP32]) if spec else FrameAssembler({}, codecs=[Codec.FP32],
                                                                                     max_frame_bytes=0)


@functools.lru_cache(maxsize=8)
def _unit_spec(config_json: str, block: int) -> tuple[tuple[tuple[str, tuple[int, ...]], ...],
                                                      tuple[tuple[str, tuple[int, ...]], ...]]:
    """(θ's, the optimizer state's) names and shapes of `block` under these model settings, as RoundReplay's."""
    model = init_unit(ModelConfig.from_dict(json.loads(config_json)), block, 0)
    return (tuple((n, tuple(t.shape)) for n, t in model.state_dict().items()), tuple(optimizer_spec(model).items()))


def _role_name(number: int) -> str:
    """An identity's role as `btnode status` prints it ("" while none is recorded, or for a role this build does
    not know)."""
    role = convert.ROLES.member(number)
    return role.value if role is not None else ""


def _messages(header: PushHeader, frames: Iterable[Frame | Bundle | ChunkData],
              message: type[pb.PushRequest] | type[pb.SubmitStateRequest] = pb.PushRequest) -> Iterator[Any]:
    """A Push or SubmitState stream (`message`): the header, then the frames' chunks (chunks given pass as they
    are)."""
    yield message(header=convert.push_header_to_pb(header))
    for item in frames:
        for chunk in [item] if isinstance(item, ChunkData) else iter_chunks([item]):
            yield message(chunk=convert.chunk_to_pb(chunk))
