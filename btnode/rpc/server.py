"""The aggregator's gRPC services (btnode.v2 Worker, Relay and Operator; Verification in rpc/verification.py):
a thin layer over SwarmAggregator.

Every handler runs inside `_guard`, which plays the interceptor: domain errors become their
status code (with the reason in trailing metadata), anything unexpected is logged and becomes
INTERNAL, and the process keeps serving. Message sizes are set explicitly on both ends.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc

from btnode.aggregate.round.deltas import DeltaFrames, StoredFrame
from btnode.aggregate.trust.identities import Identity, Role
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec, encode
from btnode.codec.frames import ChunkData, Frame, frame_from_raw
from btnode.errors import Forbidden, JoinPending, MalformedInput, PeerInputError, Refused
from btnode.protocol import ABORTED, EvidenceChild, PushHeader, VersionInfo, join_statement, receipt_statement
from btnode.rpc import convert
from btnode.rpc.health import NodeHealth
from btnode.rpc.limits import PeerLimiter, PeerLimits
from btnode.rpc.certs import peer_identity, verify_signed
from btnode.rpc.security import Security, bind, current, interceptors
from btnode.rpc.status import _abort, _guard, streaming
from btnode.rpc.verification import VerificationServicer
from btnode.rpc.wire import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES  # noqa: F401 - re-exported
from btnode.v2 import swarm_pb2 as pb
from btnode.v2 import swarm_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

STATE_REFUSED = "state_refused"  # the swarm event of a refused SubmitState, by reason
EVIDENCE_REFUSED = "evidence_refused"  # ... of a refused SubmitEvidence (aggregate/trust/evidence.py)
WAITING_WINDOW_BYTES = 32 << 10
# A server whose every call is read at once and answered at once (a serving stage): gRPC's own flow control,
# BDP probing on. A stage's batched traversal moves 256-512 KB a hop at 16 requests; with SERVER_OPTIONS
# (no BDP probing, a 32 KB lookahead) over the emulated WAN (40 ms RTT a hop), 16 streaming clients got
# 354-361 bytes/s in all against 446-474 with these, one client 50 against 59-61 (bench/api.py's lab, issue #41).
LATENCY_SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.http2.min_ping_interval_without_data_ms", 5_000)]
SERVER_OPTIONS = LATENCY_SERVER_OPTIONS + [
    # No BDP probing on what the server receives: with it, gRPC grows each connection's window to the
    # bandwidth-delay product it measures (on a LAN, past a whole 1 MB upload), and a push waiting for
    # a transfer slot (rpc/limits.py) had its payload read into the server anyway: most of a push's bytes
    # of RSS per waiting push, against almost none without (bench/conn_memory.py). Without it a stream's
    # window is 64 KB plus the message being read (a chunk ≤ 1 MiB); what the server sends is paced by
    # its clients' windows, which keep BDP probing.
    ("grpc.http2.bdp_probe", 0),
    # The stream window that leaves: what a push waiting for its transfer slot has read of its upload
    # before its handler asks for a message. gRPC's 64 KB made a waiting push cost ~107 KB of RSS against
    # ~74 KB at 32 KB (a sync server, 1,024 waiting pushes of 1 MiB messages; 16 KB: ~59 KB, but loopback
    # streaming fell from ~1.4 to ~1.0 GiB/s, where 32 KB kept it); bench/scale.py's flat N = 1,024 row at
    # a 42 MB block moved within its noise. A push being read is unaffected: its window also covers the
    # message asked for (docs/research.md, issue #40).
    ("grpc.http2.lookahead_bytes", WAITING_WINDOW_BYTES),
]
# What Pull and FetchDelta send per message. Every fetcher of a version reads the same file
# (aggregate/round/deltas.py), so what a stream holds of its own is the chunk in hand, about three
# times (read, message, serialized) while up to --max-transfers streams send at once: at 1 MiB, 32 pulls
# of a 42 MB block at once held ~1.8 MB each (the root's peak 489 MB, 431 at 256 KiB; docs/research.md,
# issue #40). Smaller is still valid on the wire (a chunk is at most CHUNK_BYTES).
SEND_CHUNK_BYTES = 256 << 10


class DecodeGuard(grpc.ServerInterceptor):
    """Parses requests itself, so that bytes which are not the expected message get
    INVALID_ARGUMENT and a reason, as other bad input does. (gRPC's own deserialisation answers
    INTERNAL, "Exception deserializing request!", which reads as a server bug.)"""

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse_raw = handler.request_deserializer

        def parse(data: bytes) -> Any:
            try:
                return parse_raw(data)
            except Exception:  # noqa: BLE001 - protobuf raises DecodeError, and others on odd input
                raise MalformedInput("decode", f"{details.method}: the request is not a valid message") from None

        def unary_in(request: bytes, context: grpc.ServicerContext, fn: Callable) -> Any:
            try:
                req = parse(request)
            except MalformedInput as exc:
                _abort(context, exc)
            return fn(req, context)

        def stream_in(requests: Iterator[bytes], context: grpc.ServicerContext, fn: Callable) -> Any:
            return fn(map(parse, requests), context)

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(lambda r, c: unary_in(r, c, handler.unary_unary),
                                                       response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(lambda r, c: unary_in(r, c, handler.unary_stream),
                                                        response_serializer=handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(lambda r, c: stream_in(r, c, handler.stream_unary),
                                                        response_serializer=handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(lambda r, c: stream_in(r, c, handler.stream_stream),
                                                     response_serializer=handler.response_serializer)


SERVICES = tuple(pb.DESCRIPTOR.services_by_name[name].full_name
                 for name in ("Worker", "Relay", "Verification", "Operator"))


class SwarmServicer(pb_grpc.WorkerServicer, pb_grpc.RelayServicer, pb_grpc.OperatorServicer):
    """One servicer behind the three services the aggregator carries (split by caller: docs/wire.md).
    `identities`: bind every call to its client certificate (under mutual TLS): the identity
    must be admitted for the call (aggregate/trust/identities.py) and any worker id it claims must be its name."""

    def __init__(self, agg: SwarmAggregator, stop: threading.Event, *, identities: bool = False, ca: bytes = b"",
                 relay_joined: Callable[[str], None] = lambda peer: None):
        """`relay_joined(peer)` once a relay has joined from that peer (the limiter gives its host the
        relay join budget: rpc/limits.PeerLimiter.trust_relay)."""
        self.agg = agg
        self.stop = stop
        self.relay_joined = relay_joined
        self.identities = identities
        self.ca = ca  # the swarm CA (PEM): the proofs relays pass on are checked against it
        self._verify = functools.partial(verify_signed, ca) if ca else None
        # the newest delta fetched of each block, as frames ready to send: after a publish every worker
        # fetches the same one, so it is read, hash-checked and compressed once, not once per worker
        self._deltas: dict[int, DeltaFrames] = {}
        self._deltas_lock = threading.Lock()
        self._thetas: dict[int, DeltaFrames] = {}  # block → its current θ's frames, what Pull sends
        self._thetas_lock = threading.Lock()

    def _who(self, context: grpc.ServicerContext, method: str, claimed: str = "") -> Identity | None:
        if not self.identities:
            return None
        who = peer_identity(context)
        self.agg.admit(who, method, claimed)
        return who

    @_guard
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        proof = convert.proof_from_pb(request.cert, request.signature, "join")
        # the settings as the JSON texts the aggregator reads (and the join signature covers)
        config = convert.model_text_from_pb(request.config if request.HasField("config") else None)
        training = convert.training_json_from_pb(request.training) if request.HasField("training") else ""
        who = self._who(context, "Join", "" if proof[0] and not request.relay else request.worker_id)
        via = _relay_name(who, request.relayed_by, "relayed_by") if not request.relay else ""
        if who is not None and who.name != request.worker_id:  # a relay passing on a worker's join
            who = self._proven(who, request.worker_id, proof, join_statement(
                request.worker_id, request.block, request.fingerprint, request.data_id, training))
        info = self.agg.join(request.worker_id, request.block, request.fingerprint, config,
                             request.data_id, who=who, training_json=training,
                             relay=request.relay, proof=proof if proof[0] else None, via=via)
        if request.relay and (who is None or who.role is Role.RELAY):  # under mutual TLS, a relay's certificate
            self.relay_joined(context.peer())
        return convert.join_to_pb(info)

    def _proven(self, relay: Identity, worker_id: str, proof: tuple[bytes, bytes], statement: bytes) -> Identity:
        """The worker's identity behind a join or push receipt that the relay `relay` passes on, once
        its certificate and signature prove it against the swarm CA; refused (Forbidden) otherwise."""
        return self.agg.proven(relay, worker_id, proof, statement, self._verify)

    @_guard
    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        who = self._who(context, "Leave")
        if who is not None and who.name != request.worker_id and who.role is not Role.RELAY:
            self.agg.admit(who, "Leave", request.worker_id)  # refused: one leaves under its own name only
        # (a relay tells its parent that a child's version stream ended: aggregate/relay/forward.py)
        self.agg.leave(request.worker_id, request.block)
        return pb.LeaveReply()

    @_guard
    @streaming
    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.PullReply]:
        self._who(context, "Pull", request.worker_id)
        if request.bundles:
            info, frames = self._theta_frames(request.block)
        else:  # a reader older than bundles: frames of θ, encoded as they go
            block = self.agg.block(request.block)
            info, theta = block.current()
            frames = (frame_from_raw(n, s, Codec.FP32, encode(Codec.FP32, theta[n])) for n, s in block.spec.items())
        yield from self._send(info, frames, "pull", pb.PullReply)

    def _theta_frames(self, b: int) -> tuple[VersionInfo, list[StoredFrame]]:
        """The current version's θ as compressed frames in a file, built once per version under a lock (the
        first Pulls after a publish wait for it, then every Pull sends chunks read from that file, as
        FetchDelta does); a stream still sending an older version keeps its file until it ends."""
        block = self.agg.block(b)
        with self._thetas_lock:
            cached = self._thetas.get(b)
            if cached is None or cached.info != block.current()[0]:
                cached = self._thetas[b] = block.theta_frames()
            return cached.info, cached.frames

    @_guard
    @streaming
    def FetchDelta(self, request: pb.FetchDeltaRequest,
                   context: grpc.ServicerContext) -> Iterator[pb.FetchDeltaReply]:
        self._who(context, "FetchDelta")
        if request.bundles:
            info, frames = self._delta_frames(request.block, request.version)
        else:  # a reader older than bundles: frames, read from the store a tensor at a time
            info, frames = self.agg.block(request.block).delta_pieces(request.version)
        yield from self._send(info, frames, "fetch_delta", pb.FetchDeltaReply)

    def _delta_frames(self, b: int, version: int) -> tuple[VersionInfo, list[StoredFrame]]:
        """The frames of the delta that produced `version`, compressed in a file (aggregate/round/deltas.py): the
        newest one asked for is cached (and built under a lock, so that concurrent first fetches read and
        compress it once); a stream already sending an older one keeps its file until it ends."""
        block = self.agg.block(b)
        with self._deltas_lock:
            cached = self._deltas.get(b)
            if cached is None or version >= cached.info.version:
                if cached is None or version > cached.info.version:
                    cached = self._deltas[b] = block.delta_frames(version)
                return cached.info, cached.frames
        built = block.delta_frames(version)  # an older version (a worker catching up): not cached
        return built.info, built.frames

    def _send(self, info: VersionInfo, frames: Iterable[Frame | StoredFrame], what: str,
              reply: type[pb.PullReply] | type[pb.FetchDeltaReply]) -> Iterator[Any]:
        """A version's info, then its frames in chunks (each a `reply`), each counted as it goes out."""
        t0 = time.perf_counter()
        meter = self.agg.meter
        yield reply(info=convert.info_to_pb(info))
        for frame in frames:
            meter.count(("sent", "raw"), frame.raw_bytes)
            meter.count(("sent", "wire"), frame.payload_bytes)
            for chunk in frame.chunks(SEND_CHUNK_BYTES):
                yield reply(chunk=convert.chunk_to_pb(chunk))
        meter.observe(what, time.perf_counter() - t0)

    def _pushed(self, request_iterator: Iterator[pb.PushRequest] | Iterator[pb.SubmitStateRequest], context: grpc.ServicerContext, method: str,
                refused: str) -> tuple[PushHeader, Iterator[ChunkData], Identity | None]:
        """A Push or SubmitState stream: its header (checked, and admitted for the caller's identity),
        then its chunks, read lazily; a refusal before the chunks is counted as the event `refused`."""
        who = self._who(context, method)
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise MalformedInput("no_header", f"a {method} stream must start with its header")
            header = convert.push_header_from_pb(first.header)
            if who is not None:  # a relay passes a child's update on for a replay audit under the child's id
                self.agg.admit(who, method, "" if who.passes_on(header) else header.worker_id, counted=False)
        except PeerInputError as exc:
            self.agg.count(refused, exc.reason)
            log.warning("refused %s: %s", method, exc)
            raise

        def chunks() -> Iterator[ChunkData]:
            try:
                for msg in request_iterator:
                    if msg.WhichOneof("kind") != "chunk":
                        raise MalformedInput("header", f"a {method} stream carries one header, then chunks only")
                    yield convert.chunk_from_pb(msg.chunk)
            except grpc.RpcError:  # the client went away mid-stream (killed, cancelled, network gone)
                raise MalformedInput(ABORTED, f"the client went away in the middle of the {method}") from None
            if not context.is_active():  # the stream may also just end when the connection drops
                raise MalformedInput(ABORTED, f"the client went away in the middle of the {method}")

        return header, chunks(), who

    @_guard
    def Push(self, request_iterator: Iterator[pb.PushRequest], context: grpc.ServicerContext) -> pb.PushReply:
        t0 = time.perf_counter()
        header, chunks, who = self._pushed(request_iterator, context, "Push", "rejected")
        try:
            judged = self.agg.push(header, chunks, who=who, verify=self._verify)
        except JoinPending:  # read the rest of the upload first: an asyncio client whose upload is cut short
            for _ in request_iterator:  # reads INTERNAL, not this status (grpc/grpc#36066), and would not retry
                pass
            raise
        self.agg.meter.observe("push", time.perf_counter() - t0)
        log.debug("push from %s judged %s in %.1f ms", header.worker_id, judged.outcome.value,
                  1e3 * (time.perf_counter() - t0))
        return convert.judgement_to_pb(judged)

    @_guard
    def Draw(self, request: pb.DrawRequest, context: grpc.ServicerContext) -> pb.DrawReply:
        """A relay commits a child's update before it counts it (aggregate/trust/commits.py); under mutual
        TLS the child's signed receipt must cover its header, claim and frames digest."""
        who = self._who(context, "Draw")
        header = convert.push_header_from_pb(request.header)
        if len(request.digest) != 32:
            raise MalformedInput("digest", "a Draw names the child's frames digest: 32 bytes")
        digest = request.digest.hex()
        if who is not None and who.name != header.worker_id:
            self._proven(who, header.worker_id, (header.cert, header.signature), receipt_statement(header, digest))
        relay = who.name if who is not None else (convert.name_from_pb(request.relay, "relay") if request.relay else "")
        drawn = self.agg.draw(header, digest, relay=relay, refused=request.refused)
        return pb.DrawReply(drawn=drawn.drawn, token=drawn.token)

    @_guard
    def SubmitState(self, request_iterator: Iterator[pb.SubmitStateRequest],
                    context: grpc.ServicerContext) -> pb.SubmitStateReply:
        """The start state of an update drawn for audit: its push header, then fp32 frames."""
        t0 = time.perf_counter()
        header, chunks, _ = self._pushed(request_iterator, context, "SubmitState", STATE_REFUSED)
        try:
            self.agg.submit_state(header, chunks)
        except PeerInputError as exc:
            self.agg.count(STATE_REFUSED, exc.reason)
            log.warning("refused the start state of update %s from %s: %s", header.update_id[:16], header.worker_id,
                        exc)
            raise
        self.agg.meter.observe("submit_state", time.perf_counter() - t0)
        return pb.SubmitStateReply()

    @_guard
    def SubmitEvidence(self, request_iterator: Iterator[pb.SubmitEvidenceRequest],
                       context: grpc.ServicerContext) -> pb.SubmitEvidenceReply:
        """A relay's evidence for a combined push drawn for audit (aggregate/trust/evidence.py)."""
        t0 = time.perf_counter()
        who = self._who(context, "SubmitEvidence")
        try:
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise MalformedInput("no_header", "a SubmitEvidence stream must start with its header")
            header = convert.push_header_from_pb(first.header.push)
            if who is not None:
                self.agg.identities.admit(who, "SubmitEvidence", header.worker_id)
        except PeerInputError as exc:
            self.agg.count(EVIDENCE_REFUSED, exc.reason)
            log.warning("refused SubmitEvidence: %s", exc)
            raise

        def parts() -> Iterator[EvidenceChild | ChunkData]:
            try:
                for msg in request_iterator:
                    kind = msg.WhichOneof("kind")
                    if kind == "child":
                        yield convert.evidence_child_from_pb(msg.child)
                    elif kind == "chunk":
                        yield convert.chunk_from_pb(msg.chunk)
                    else:
                        raise MalformedInput("header", f"a SubmitEvidence stream carries one header, then children and chunks "
                                                  f"only (got {kind or 'an unknown message'})")
            except grpc.RpcError:
                raise MalformedInput(ABORTED, "the relay went away in the middle of its evidence") from None
            if not context.is_active():
                raise MalformedInput(ABORTED, "the relay went away in the middle of its evidence")

        try:
            self.agg.submit_evidence(header, first.header.unit, parts(), who=who)
        except PeerInputError as exc:
            self.agg.count(EVIDENCE_REFUSED, exc.reason)
            log.warning("refused the evidence of combined push %s from %s: %s", header.update_id[:16],
                        header.worker_id, exc)
            raise
        self.agg.meter.observe("submit_evidence", time.perf_counter() - t0)
        return pb.SubmitEvidenceReply()

    @_guard
    @streaming
    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.WatchReply]:
        """Announce the current version, then every new one, until the client goes away."""
        who = self._who(context, "Watch", request.worker_id)
        block = self.agg.block(request.block)
        worker = request.worker_id
        revoked = self.agg.identities.revoked
        if worker in revoked:
            raise Forbidden("revoked", f"worker {worker!r} was revoked")
        if worker and not self.agg.has_joined(request.block, worker):  # a replica the round would wait for
            if self.agg.joins.pending(request.block, worker):
                raise JoinPending(f"{worker!r} watches block {request.block} while its join is still under way")
            raise Refused("not_joined", f"{worker!r} watches block {request.block} without having joined it")
        if worker:
            block.stream_opened(worker)
            context.add_callback(lambda: block.stream_closed(worker))
            self.agg.came_direct(worker)  # its verification duties are its own to ask for, not a relay's
        elif relay := _relay_name(who, request.relay, "relay"):  # its children's rounds here follow its streams
            block.relay_stream_opened(relay)
            context.add_callback(lambda: block.relay_stream_closed(relay))
        last = -1
        # a relay watches under no worker id; under mutual TLS its name says whose duties it fetches
        watcher = worker or (who.name if who is not None and who.role is Role.RELAY else "")

        def ended() -> bool:
            return worker in revoked or (who is not None and who.name in revoked)

        def handed() -> int:  # verification duties handed to the watcher so far (delegated verification)
            return self.agg.duties_handed(watcher) if watcher else 0

        told = 0  # duties handed before it watched are told at once too (a reconnect: one extra Duties call)
        while context.is_active() and not self.stop.is_set() and not ended():
            info = block.wait_for(last, timeout=0.5, cancelled=lambda: ended() or handed() > told)
            n = handed()
            if info is not None:
                last = info.version
                receipts = block.receipts_for(worker, info.version) if worker else ()
                yield pb.WatchReply(version=convert.info_to_pb(info),
                                    receipts=[convert.round_receipt_to_pb(r) for r in receipts],
                                    states_wanted=self.agg.replays.wanted(worker) if worker else (), duties=n > told)
            elif n > told:  # the current version again, only to say that duties wait
                yield pb.WatchReply(version=convert.info_to_pb(block.current()[0]), duties=True)
            told = n

    @_guard
    def RoundReceipt(self, request: pb.RoundReceiptRequest, context: grpc.ServicerContext) -> pb.RoundReceiptReply:
        """The round receipt of one of the caller's updates (under mutual TLS, its own name's only)."""
        self._who(context, "RoundReceipt", request.worker_id)
        found = self.agg.block(request.block).receipt(request.worker_id, request.update_id)
        wanted = self.agg.replays.wanted(request.worker_id)
        return (pb.RoundReceiptReply(receipt=convert.round_receipt_to_pb(found), states_wanted=wanted) if found
                else pb.RoundReceiptReply(states_wanted=wanted))

    @_guard
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        self._who(context, "Status")
        return convert.status_to_pb(self.agg.status(), server_time_unix=time.time())

    @_guard
    def Revoke(self, request: pb.RevokeRequest, context: grpc.ServicerContext) -> pb.RevokeReply:
        if not self.identities:
            raise Refused("no_identities", "this aggregator has no identities to revoke: start it with mutual TLS "
                                           "(--tls-client-auth) so that worker ids are certificates, not claims")
        self._who(context, "Revoke")
        return pb.RevokeReply(revoked_at_unix=self.agg.revoke(request.name))


def _relay_name(who: Identity | None, stated: str, what: str) -> str:
    """The relay behind a call that names one (a Watch, a join it passes on): under mutual TLS its
    certificate's name when it is a relay's (else none), without it the name it states ("": none)."""
    if who is not None:
        return who.name if who.role is Role.RELAY else ""
    return convert.name_from_pb(stated, what) if stated else ""


def serve(agg: SwarmAggregator, address: str, *, security: Security | None = None,
          limits: PeerLimits | PeerLimiter | None = None,
          health: NodeHealth | None = None) -> tuple[grpc.Server, int, threading.Event]:
    """Start serving on `address` ("host:port", port 0 picks one); returns (server, port, stop event).
    Health and reflection come too; without a `health` to drive, Health says SERVING from the start.

    The limiter's budgets (rpc/limits.py) refuse a call before gRPC's own cap would: the thread
    pool and `maximum_concurrent_rpcs` are sized past them (`PeerLimits.threads`; a sync server
    holds one thread per call in progress, a held version stream and a transfer waiting for its
    slot included, a few KB of RSS each: bench/conn_memory.py). A `PeerLimiter` given in place of `limits` is used as it is (a caller that wants to
    watch its open streams)."""
    stop = threading.Event()
    sec = security or current()
    refused = lambda: agg.count("unauthenticated", "token")  # noqa: E731
    limited = lambda reason: agg.count("limited", reason)  # noqa: E731
    limiter = limits if isinstance(limits, PeerLimiter) else PeerLimiter(limits or PeerLimits())
    limiter.on_refusal = limited
    limiter.on_queued = lambda: agg.count("queued", "transfer")
    threads = limiter.limits.threads
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
                         options=SERVER_OPTIONS, maximum_concurrent_rpcs=threads,
                         interceptors=[*interceptors(sec, refused), limiter,
                                       DecodeGuard()])
    servicer = SwarmServicer(agg, stop, identities=sec.client_auth,
                             ca=sec.ca.read_bytes() if sec.client_auth and sec.ca else b"",
                             relay_joined=limiter.trust_relay)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    pb_grpc.add_RelayServicer_to_server(servicer, server)
    pb_grpc.add_OperatorServicer_to_server(servicer, server)
    # delegated verification, bound to the callers' identities as the other calls are (rpc/verification.py)
    pb_grpc.add_VerificationServicer_to_server(VerificationServicer(agg, servicer._who, servicer._proven), server)
    (health or NodeHealth(serving=True)).add_to(server, SERVICES)
    port = bind(server, address, sec)
    server.start()
    lim = limiter.limits
    log.info("serving up to %d connected workers (version streams), %d transfers (%d more waiting) and %d other "
             "calls at once (%d threads at most)", lim.max_workers, lim.max_transfers, lim.transfer_queue,
             lim.max_calls, threads)
    return server, port, stop
