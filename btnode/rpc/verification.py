"""The aggregator's btnode.v2 Verification service (delegated verification: aggregate/trust/delegate.py,
docs/security.md): a thin layer over SwarmAggregator's duties, verify_inputs, attest, submit_trace and
submit_dispute_state. Under mutual TLS every call is bound to the caller's identity: the worker id it
names (Attest: the verifier) must be its certificate's name, as for a push, or, from a relay, a child
that pushes through it; an attestation or trace a relay passes on carries the child's signature
(protocol.attest_statement, trace_statement), checked here. A relay serves the same service to its
children: their duties from its mailbox (aggregate/relay/duties.py), the rest passed on to its parent."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import grpc

from btnode.aggregate.service import SwarmAggregator
from btnode.aggregate.trust.identities import Identity, Role
from btnode.codec.codecs import Codec
from btnode.codec.frames import FrameAssembler, lazy_frames
from btnode.errors import MalformedInput, PeerInputError, Refused
from btnode.protocol import ABORTED, attest_statement, trace_statement
from btnode.rpc import convert
from btnode.rpc.status import _guard, streaming
from btnode.v2 import swarm_pb2 as pb
from btnode.v2 import swarm_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

VERIFY_REFUSED = "verify_refused"  # the swarm event of a refused Verification call, by reason
Who = Callable[[grpc.ServicerContext, str, str], "Identity | None"]  # SwarmServicer._who
Proven = Callable[[Identity, str, tuple[bytes, bytes], bytes], Identity]  # SwarmServicer._proven


class VerificationServicer(pb_grpc.VerificationServicer):
    """`who(context, method, claimed)`: the caller's identity, admitted for `method` under the worker id
    it claims (None without mutual TLS: worker ids are then claims); `proven(relay, worker, proof,
    statement)`: the identity behind a statement a relay passes on, once its signature proves it."""

    def __init__(self, agg: SwarmAggregator, who: Who, proven: Proven | None = None):
        self.agg, self.who, self.proven = agg, who, proven

    @contextlib.contextmanager
    def _counted(self, method: str) -> Iterator[None]:
        """Count and log a refusal of `method` (VERIFY_REFUSED, by reason) before it goes back as its status."""
        try:
            yield
        except PeerInputError as exc:
            self.agg.count(VERIFY_REFUSED, exc.reason)
            log.warning("refused %s: %s", method, exc)
            raise

    def _caller(self, context: grpc.ServicerContext, method: str, claimed: str) -> str:
        """The worker id a call names, once the caller may act for it: itself, or a relay it pushes through."""
        worker = convert.name_from_pb(claimed, "worker_id")
        caller = self.who(context, method, "")  # the caller, admitted for the method in its own name
        if caller is not None and caller.name != worker and not (
                caller.role is Role.RELAY and self.agg.relays_for(worker) == caller.name):
            self.who(context, method, worker)  # refused: another's name (counted; an impersonation revokes)
        return worker

    def _signed(self, context: grpc.ServicerContext, method: str, worker: str, proof: tuple[bytes, bytes],
                statement: bytes) -> None:
        """A statement in `worker`'s name: from itself, or from a relay with `worker`'s signature over it
        (a relay that passes on what the child did not sign is refused, `signature`)."""
        caller = self.who(context, method, "")
        if caller is None or caller.name == worker:
            return
        if caller.role is not Role.RELAY or self.proven is None:
            self.who(context, method, worker)  # refused
            return
        self.proven(caller, worker, proof, statement)

    @_guard
    def Duties(self, request: pb.DutiesRequest, context: grpc.ServicerContext) -> pb.DutiesReply:
        with self._counted("Duties"):
            worker = self._caller(context, "Duties", request.worker_id)
            return convert.duties_to_pb(self.agg.duties(worker))

    @_guard
    @streaming
    def VerifyInputs(self, request: pb.VerifyInputsRequest,
                     context: grpc.ServicerContext) -> Iterator[pb.VerifyInputsReply]:
        """θ^base's fp32 frames (`base`), then the author's start state's (`start`)."""
        t0 = time.perf_counter()
        with self._counted("VerifyInputs"):
            worker = self._caller(context, "VerifyInputs", request.worker_id)
            base, start = self.agg.verify_inputs(request.block, convert.name_from_pb(request.task_id, "task_id"),
                                                 worker)
        meter = self.agg.meter
        for part, tensors in (("base", base), ("start", start)):
            for frame in lazy_frames(tensors, Codec.FP32):
                meter.count(("sent", "raw"), frame.header.raw_bytes)
                meter.count(("sent", "wire"), frame.header.payload_bytes)
                for chunk in frame.chunks():
                    yield pb.VerifyInputsReply(**{part: convert.chunk_to_pb(chunk)})
        meter.observe("verify_inputs", time.perf_counter() - t0)

    @_guard
    def Attest(self, request: pb.AttestRequest, context: grpc.ServicerContext) -> pb.AttestReply:
        with self._counted("Attest"):
            a = convert.attestation_from_pb(request)
            self._signed(context, "Attest", a.verifier, (a.cert, a.signature), attest_statement(request.block, a))
            self.agg.attest(request.block, a)
        return pb.AttestReply()

    @_guard
    def SubmitTrace(self, request: pb.SubmitTraceRequest, context: grpc.ServicerContext) -> pb.SubmitTraceReply:
        with self._counted("SubmitTrace"):
            worker = convert.name_from_pb(request.worker_id, "worker_id")
            task_id, trace = convert.name_from_pb(request.task_id, "task_id"), convert.trace_from_pb(request.trace)
            proof = convert.proof_from_pb(request.cert, request.signature, "trace")
            self._signed(context, "SubmitTrace", worker, proof, trace_statement(request.block, task_id, worker, trace))
            self.agg.submit_trace(request.block, task_id, worker, trace, proof=proof if proof[0] else None)
        return pb.SubmitTraceReply()

    @_guard
    def SubmitDisputeState(self, request_iterator: Iterator[pb.SubmitDisputeStateRequest],
                           context: grpc.ServicerContext) -> pb.SubmitDisputeStateReply:
        """A party's whole state after k steps of a disputed round: a header, then fp32 frames of the state
        RoundReplay.state_spec names (θ as theta.*, the optimizer as opt.*)."""
        t0 = time.perf_counter()
        with self._counted("SubmitDisputeState"):
            self.who(context, "SubmitDisputeState", "")  # a revoked identity or a wrong role stops here
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise MalformedInput("no_header", "a SubmitDisputeState stream must start with its header")
            h = first.header
            task_id = convert.name_from_pb(h.task_id, "task_id")
            worker = self._caller(context, "SubmitDisputeState", h.worker_id)
            if h.k < 1:
                raise MalformedInput("k", "a dispute's state comes after at least one step (k ≥ 1)")
            if self.agg.upstream is not None:  # a relay: the child's state goes on as it came
                self.agg.pass_dispute_state(h.block, task_id, worker, int(h.k),
                                            (convert.chunk_from_pb(m.chunk) for m in request_iterator
                                             if _only_chunks(m)))
                self.agg.meter.observe("submit_dispute_state", time.perf_counter() - t0)
                return pb.SubmitDisputeStateReply()
            replayer = self.agg.replayers.get(h.block)
            if self.agg.delegated is None or replayer is None:
                raise Refused("no_delegation", f"this aggregator does not delegate the replays of block {h.block}")
            asm = FrameAssembler.for_spec(replayer.replay.state_spec(), [Codec.FP32])
            try:
                for msg in request_iterator:
                    if msg.WhichOneof("kind") != "chunk":
                        raise MalformedInput("header", "a SubmitDisputeState stream carries one header, then chunks only")
                    asm.add(convert.chunk_from_pb(msg.chunk))
            except grpc.RpcError:  # the client went away mid-stream
                raise MalformedInput(ABORTED, "the client went away in the middle of its state") from None
            if not context.is_active():
                raise MalformedInput(ABORTED, "the client went away in the middle of its state")
            self.agg.submit_dispute_state(task_id, worker, int(h.k), asm.finish())
        self.agg.meter.observe("submit_dispute_state", time.perf_counter() - t0)
        return pb.SubmitDisputeStateReply()


def _only_chunks(msg: pb.SubmitDisputeStateRequest) -> bool:
    if msg.WhichOneof("kind") != "chunk":
        raise MalformedInput("header", "a SubmitDisputeState stream carries one header, then chunks only")
    return True
