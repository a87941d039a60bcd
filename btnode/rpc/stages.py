"""Serving over gRPC: `StageServicer` exposes a local stage (a block, or a slice of the AR
baseline's layers), `RemoteBlockStage` / `RemoteARStage` are the same Stage protocol seen from the
previous stage, and `generate_remote` is the client of a chain's entry."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from functools import partial
from typing import Any

import grpc
import torch

from btnode import __version__
from btnode.errors import BtnodeError, InputError, MalformedInput
from btnode.model.config import ModelConfig, UnitKind
from btnode.protocol import Meter
from btnode.rpc import convert, security
from btnode.rpc.health import NodeHealth
from btnode.rpc.security import bind, interceptors
from btnode.rpc.server import CHANNEL_OPTIONS, LATENCY_SERVER_OPTIONS, DecodeGuard, _guard, streaming
from btnode.rpc.status import REASON_KEY, code_for, error_from_rpc, reason_for
from btnode.rpc.wire import request_from_pb, request_to_pb, weights_from_pb  # noqa: F401 - re-exported
from btnode.serve import driver
from btnode.serve.ar import ARResult, ARState, LocalARStage
from btnode.serve.batching import BatchingStage
from btnode.serve.identity import Weights
from btnode.serve.readouts import Carry
from btnode.serve.request import GenerationRequest
from btnode.serve.stages import LocalBlockStage, SegmentResult, SegmentState, initial_state
from btnode.v2 import serve_pb2 as pb
from btnode.v2 import serve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
MAX_STATE_ELEMENTS = 1 << 22  # 16 MiB of float32: far above any state a configured model sends
MAX_BATCH_SEGMENTS = 256  # segments in one ForwardBatch call
MAX_BATCH_BYTES = 3 << 20  # a ForwardBatch message stays under gRPC's 4 MiB (bigger batches go as several calls)
SERVICE = pb.DESCRIPTOR.services_by_name["Serving"].full_name  # what a stage carries, as Health names it


def tensor_to_pb(t: torch.Tensor) -> pb.StateTensor:
    t = t.detach().to("cpu", torch.float32).contiguous()
    return pb.StateTensor(shape=list(t.shape), data=t.numpy().tobytes())


def tensor_from_pb(m: pb.StateTensor, what: str) -> torch.Tensor:
    shape = tuple(int(d) for d in m.shape)
    if len(shape) > 4 or any(d < 0 for d in shape) or math.prod(shape) > MAX_STATE_ELEMENTS:
        raise MalformedInput("state", f"{what}: shape {shape} is not a valid state")
    if len(m.data) != 4 * math.prod(shape):
        raise MalformedInput("state", f"{what}: {len(m.data)} bytes of data for shape {shape} "
                                      f"(needs {4 * math.prod(shape)})")
    if not m.data:
        return torch.zeros(shape)
    return torch.frombuffer(bytearray(m.data), dtype=torch.float32).reshape(shape)


def _segment_from_pb(r: pb.SegmentRequest, cfg: ModelConfig | None = None) -> SegmentState:
    """The segment a message carries. A draft's segment (readout spec…) may leave out what the receiver
    has already (`_segment_to_pb`): z, never swept, is then the segment's initial state (the same bits
    on every host; needs the stage's `cfg`), and a missing pool beside the draft's log-probs is those
    log-probs (the first hop: block 0's reading is the whole pool so far)."""
    readout = convert.readout_from_pb(r.readout, r.n_tail)
    draft_logp = tensor_from_pb(r.draft_logp, "draft log-probs") if r.HasField("draft_logp") else None
    if r.HasField("pool"):
        pool = tensor_from_pb(r.pool, "pooled log-probs")
    else:
        pool = draft_logp.clone() if readout.drafts and draft_logp is not None else None
    if readout.drafts and not r.HasField("z") and cfg is not None and 0 < r.k <= cfg.context:
        z = initial_state(cfg, r.seed, r.segment, r.k, 2)  # z at σ_hi: the grid's size does not enter
    elif not r.HasField("z"):
        z = torch.zeros(0)  # none to make (no cfg here, or a K no stage serves): the stage refuses its shape
    else:
        z = tensor_from_pb(r.z, "segment state")
    return SegmentState(request_id=r.request_id, context=bytes(r.context), segment=r.segment, k=r.k,
                        n_steps=r.n_steps, seed=r.seed, temperature=r.temperature, z=z, readout=readout,
                        want_logits=r.want_logits, first_chunk=r.first_chunk, final=r.final,
                        use_cache=not r.no_cache, n_tail=r.n_tail,
                        carry=Carry(pool=pool, draft=bytes(r.draft), draft_logp=draft_logp))


def _segment_to_pb(s: SegmentState) -> pb.SegmentRequest:
    """A segment as a message. A draft's segment (readout spec…) leaves out z (no sweep reads it, and the
    receiver makes it from the seed) and, on the first hop, the pool (equal to the draft's log-probs):
    40 KB of the 48 KB a request's segment weighs at K = 16, V = 256, d = 128 on that hop, and the
    bandwidth a batched traversal of many requests spends between hosts."""
    drafts = s.readout.drafts
    req = pb.SegmentRequest(request_id=s.request_id, context=s.context, segment=s.segment, k=s.k, n_steps=s.n_steps,
                            seed=s.seed, temperature=s.temperature, want_logits=s.want_logits,
                            readout=convert.READOUTS.to_pb(s.readout), first_chunk=s.first_chunk, final=s.final,
                            no_cache=not s.use_cache, n_tail=s.n_tail, draft=s.carry.draft)
    if not drafts:
        req.z.CopyFrom(tensor_to_pb(s.z))
    pool, logp = s.carry.pool, s.carry.draft_logp
    if pool is not None and not (drafts and logp is not None and (pool is logp or torch.equal(pool, logp))):
        req.pool.CopyFrom(tensor_to_pb(pool))
    if logp is not None:
        req.draft_logp.CopyFrom(tensor_to_pb(logp))
    return req


def _result_to_pb(r: SegmentResult) -> pb.SegmentReply:
    reply = pb.SegmentReply(new_bytes=r.new_bytes, route=r.route, accepted=r.accepted)
    if r.logits is not None:
        reply.logits.CopyFrom(tensor_to_pb(r.logits))
    return reply


def _result_from_pb(m: pb.SegmentReply | pb.ARReply) -> SegmentResult:
    logits = tensor_from_pb(m.logits, "logits") if isinstance(m, pb.SegmentReply) and m.HasField("logits") else None
    accepted = m.accepted if isinstance(m, pb.SegmentReply) else 0
    return SegmentResult(new_bytes=bytes(m.new_bytes), logits=logits, route=list(m.route), accepted=accepted)


class StageServicer(pb_grpc.ServingServicer):
    def __init__(self, stage: LocalBlockStage | LocalARStage, stop: threading.Event, meter: Meter | None = None):
        self.stage = stage
        self.stop = stop
        self.is_ar = isinstance(stage, LocalARStage)
        self.meter = meter or Meter()  # requests by (chain, outcome), generated bytes, durations
        # a chain's entry batches the segments (AR: the steps) of concurrent requests into shared traversals
        first = stage.first if isinstance(stage, LocalARStage) else stage.index == 0
        self.entry = BatchingStage(stage, meter=self.meter, chain="ar" if self.is_ar else "block") if first else stage

    @_guard
    def Info(self, request: pb.StageInfoRequest, context: grpc.ServicerContext) -> pb.StageInfo:
        s, cfg = self.stage, self.stage.cfg
        common = dict(name=s.name, fingerprint=cfg.fingerprint(), config=convert.model_to_pb(cfg),
                      node_version=__version__, **_weights_fields(s))
        if isinstance(s, LocalARStage):
            return pb.StageInfo(kind=convert.UNIT_KINDS.to_pb(UnitKind.AR), first_layer=s.lo, n_layers=s.hi - s.lo,
                                last=s.last, **common)
        d = s.defaults
        return pb.StageInfo(kind=convert.UNIT_KINDS.to_pb(UnitKind.BLOCK), block=s.index, last=s.next is None,
                            default_readout=convert.READOUTS.to_pb(d.readout), default_k=d.k,
                            default_steps=d.n_steps or 0, **common)

    @_guard
    def Forward(self, request: pb.SegmentRequest, context: grpc.ServicerContext) -> pb.SegmentReply:
        if self.is_ar:
            raise InputError("this stage serves the autoregressive chain (use ForwardAR)")
        t0 = time.perf_counter()
        reply = _result_to_pb(self.stage.forward(_segment_from_pb(request, self.stage.cfg)))  # type: ignore[arg-type]
        self.meter.observe("forward", time.perf_counter() - t0)
        return reply

    @_guard
    def ForwardBatch(self, request: pb.SegmentBatch, context: grpc.ServicerContext) -> pb.SegmentBatchReply:
        """Several requests' segments in one traversal: each gets its reply or its own error."""
        if self.is_ar:
            raise InputError("this stage serves the autoregressive chain (use ForwardAR)")
        if len(request.segments) > MAX_BATCH_SEGMENTS:
            raise InputError(f"a batch of {len(request.segments)} segments; at most {MAX_BATCH_SEGMENTS}")
        return self._batch(request.segments, partial(_segment_from_pb, cfg=self.stage.cfg), pb.SegmentBatchReply(),
                           _result_to_pb)

    @_guard
    def ForwardAR(self, request: pb.ARRequest, context: grpc.ServicerContext) -> pb.ARReply:
        if not self.is_ar:
            raise InputError("this stage serves a block of the one-sweep chain (use Forward)")
        t0 = time.perf_counter()
        result = self.stage.forward(_ar_from_pb(request))  # type: ignore[arg-type]
        self.meter.observe("forward", time.perf_counter() - t0)
        return pb.ARReply(new_bytes=result.new_bytes, route=result.route)

    @_guard
    def ForwardARBatch(self, request: pb.ARBatch, context: grpc.ServicerContext) -> pb.ARBatchReply:
        """Several requests' steps in one traversal: each gets its reply or its own error."""
        if not self.is_ar:
            raise InputError("this stage serves a block of the one-sweep chain (use ForwardBatch)")
        if len(request.steps) > MAX_BATCH_SEGMENTS:
            raise InputError(f"a batch of {len(request.steps)} steps; at most {MAX_BATCH_SEGMENTS}")
        return self._batch(request.steps, _ar_from_pb, pb.ARBatchReply(),
                           lambda r: pb.ARReply(new_bytes=r.new_bytes, route=r.route))

    def _batch(self, items: Any, parse: Callable[[Any], Any], reply: Any, to_pb: Callable[[Any], Any]) -> Any:
        """One traversal for a batch: each item parsed (a bad one gets its own error outcome), the good ones
        through the stage's forward_batch together, each outcome in the items' order."""
        states: list[Any] = []
        for m in items:
            try:
                states.append(parse(m))
            except BtnodeError as exc:
                states.append(exc)
        good = [s for s in states if not isinstance(s, BtnodeError)]
        t0 = time.perf_counter()
        done = iter(self.stage.forward_batch(good) if good else [])  # type: ignore[union-attr]
        self.meter.observe("forward", time.perf_counter() - t0)
        for s in states:
            r = s if isinstance(s, BtnodeError) else next(done)
            if isinstance(r, BtnodeError):
                reply.outcomes.add(code=code_for(r).value[0], reason=reason_for(r), message=str(r))
            else:
                reply.outcomes.add(reply=to_pb(r))
        return reply

    @_guard
    @streaming
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateReply]:
        s, cfg = self.stage, self.stage.cfg
        if request.draft and not self.is_ar:
            raise InputError("a draft (speculative decoding) is for the autoregressive chain; this is a block chain")
        if isinstance(s, LocalARStage):
            if not s.first:
                raise InputError(f"{s.name} is not the first stage of its chain; send requests to the entry")
            if request.draft and s.drafter is None:
                raise InputError(f"{s.name} has no draft model, so it cannot decode speculatively "
                                 f"(draft={request.draft}); start the entry with --draft CHECKPOINT, or ask with draft=0")
        elif s.index != 0:
            raise InputError(f"{s.name} is not the first stage of its chain; send requests to the entry")
        chain = "ar" if self.is_ar else "block"
        t0 = time.perf_counter()
        drafted = accepted = 0
        try:
            req = request_from_pb(request)
            if isinstance(s, LocalARStage):
                results: Iterator[SegmentResult] = driver.generate_ar(self.entry, cfg, req, draft=s.drafter)
            else:
                req = req.checked(cfg, s.n_blocks, s.defaults)  # its defaults filled: K counts the draft bytes below
                results = driver.generate(self.entry, cfg, s.n_blocks, req)
            for i, r in enumerate(results, start=1):
                if not context.is_active() or self.stop.is_set():
                    self.meter.count(("request", chain, "cancelled"))
                    return
                reply = pb.GenerateReply(new_bytes=r.new_bytes, traversals=i, route=r.route)
                if isinstance(r, ARResult):  # accepted bytes per traversal = bytes / traversals − 1
                    drafted, accepted = drafted + r.drafted, accepted + len(r.new_bytes) - 1
                    reply.drafted, reply.accepted = drafted, accepted
                elif req.readout and req.readout.drafts:  # a draft of K per traversal, `accepted` of it kept
                    drafted, accepted = drafted + (req.k or 0), accepted + r.accepted
                    reply.drafted, reply.accepted = drafted, accepted
                if r.logits is not None:
                    reply.logits.CopyFrom(tensor_to_pb(r.logits))
                self.meter.count(("generated_bytes", chain), len(r.new_bytes))
                yield reply
        except BaseException:
            self.meter.count(("request", chain, "error"))
            raise
        self.meter.count(("request", chain, "ok"))
        self.meter.observe("request", time.perf_counter() - t0)


def _weights_fields(stage: LocalBlockStage | LocalARStage) -> dict:
    """StageInfo's weights fields: this stage's and, asked now, the rest of the chain's (none when
    some stage further down cannot tell: an older build, or one that does not answer)."""
    try:
        w = stage.weights()
    except BtnodeError as exc:
        log.warning("%s: the weights of the stages after it are not known: %s", stage.name, exc)
        w = None
    own = stage.unit.own()
    if w is None:
        return dict(weights_name=own.name, weights_version=own.version)
    return dict(weights_name=w.name, weights_version=w.version, unit_sha256=list(w.units))


class RemoteBlockStage:
    """The next block's stage, across the network (one Forward call per segment)."""

    def __init__(self, address: str, *, timeout_s: float = 60.0):
        self.address = self.name = address
        self.timeout_s = timeout_s
        self.channel = security.channel(address, CHANNEL_OPTIONS)
        self.stub = pb_grpc.ServingStub(self.channel)

    def weights(self) -> Weights | None:
        """The weights of the chain from this stage on, as its Info says (None: it does not say)."""
        try:
            return weights_from_pb(self.stub.Info(pb.StageInfoRequest(), timeout=min(self.timeout_s, 10.0)))
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"stage {self.address}") from None

    def forward(self, state: SegmentState) -> SegmentResult:
        try:
            return _result_from_pb(self.stub.Forward(_segment_to_pb(state), timeout=self.timeout_s))
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"stage {self.address}") from None

    def forward_batch(self, states: Sequence[SegmentState]) -> list[SegmentResult | BtnodeError]:
        """One ForwardBatch call per slice of the batch that fits a message (MAX_BATCH_BYTES)."""
        return self._send_batch(states, [_segment_to_pb(s) for s in states], "segments",
                                lambda part: self.stub.ForwardBatch(pb.SegmentBatch(segments=part), timeout=self.timeout_s))

    def _send_batch(self, states: Sequence[Any], messages: list[Any], what: str,
                    call: Callable[[list[Any]], Any]) -> list[SegmentResult | BtnodeError]:
        """`call` per slice of `messages` that fits a message; an older stage (UNIMPLEMENTED) gets one call per
        state instead. Each outcome in order: a result, or that state's own error."""
        out: list[SegmentResult | BtnodeError] = []
        for part in _slices(messages):
            try:
                reply = call(part)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older stage: one call per state
                    out += [_forward_one(self, s) for s in states[len(out):len(out) + len(part)]]
                    continue
                raise error_from_rpc(err, f"stage {self.address}") from None
            if len(reply.outcomes) != len(part):
                raise MalformedInput("result", f"stage {self.address} answered {len(reply.outcomes)} outcomes "
                                               f"for {len(part)} {what}")
            for o in reply.outcomes:
                out.append(_result_from_pb(o.reply) if o.HasField("reply") else
                           error_from_rpc(_Failed(o), f"stage {self.address}"))
        return out

    def close(self) -> None:
        self.channel.close()


def _forward_one(stage: RemoteBlockStage, state: SegmentState) -> SegmentResult | BtnodeError:
    try:
        return stage.forward(state)
    except BtnodeError as exc:
        return exc


def _slices(parts: list[pb.SegmentRequest]) -> Iterator[list[pb.SegmentRequest]]:
    """The batch cut into messages of at most MAX_BATCH_BYTES (one segment each at least)."""
    part: list[pb.SegmentRequest] = []
    size = 0
    for m in parts:
        n = m.ByteSize()
        if part and (size + n > MAX_BATCH_BYTES or len(part) == MAX_BATCH_SEGMENTS):
            yield part
            part, size = [], 0
        part.append(m)
        size += n
    if part:
        yield part


class _Failed:
    """One failed outcome of a batch, read as the failed call it stands for (rpc/status.py)."""

    def __init__(self, o: pb.SegmentOutcome):
        self.o = o

    def code(self) -> grpc.StatusCode:
        return next((c for c in grpc.StatusCode if c.value[0] == self.o.code), grpc.StatusCode.UNKNOWN)

    def details(self) -> str:
        return self.o.message

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((REASON_KEY, self.o.reason),)


def _ar_to_pb(state: ARState) -> pb.ARRequest:
    req = pb.ARRequest(request_id=state.request_id, tokens=state.tokens, step=state.step, seed=state.seed,
                       temperature=state.temperature, start=state.start, reset=state.reset, draft=state.draft)
    if state.hidden is not None:
        req.hidden.CopyFrom(tensor_to_pb(state.hidden))
    return req


def _ar_from_pb(m: pb.ARRequest) -> ARState:
    hidden = tensor_from_pb(m.hidden, "hidden state") if m.HasField("hidden") else None
    return ARState(request_id=m.request_id, tokens=bytes(m.tokens), step=m.step, seed=m.seed,
                   temperature=m.temperature, start=m.start, hidden=hidden, reset=m.reset, draft=bytes(m.draft))


class RemoteARStage(RemoteBlockStage):
    def forward(self, state: ARState) -> SegmentResult:  # type: ignore[override]
        try:
            return _result_from_pb(self.stub.ForwardAR(_ar_to_pb(state), timeout=self.timeout_s))
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"stage {self.address}") from None

    def forward_batch(self, states: Sequence[ARState]) -> list[SegmentResult | BtnodeError]:  # type: ignore[override]
        """One ForwardARBatch call per slice of the batch that fits a message (MAX_BATCH_BYTES)."""
        return self._send_batch(states, [_ar_to_pb(s) for s in states], "steps",
                                lambda part: self.stub.ForwardARBatch(pb.ARBatch(steps=part), timeout=self.timeout_s))


def generate_remote(entry: str, request: GenerationRequest, *, timeout_s: float = 3600.0) -> Iterator[pb.GenerateReply]:
    """Stream a request's segments from the chain whose first stage is at `entry`; draft_len = G > 0
    asks an AR chain's entry for speculative decoding (one reply per traversal, 1…G+1 bytes each)."""
    channel = security.channel(entry, CHANNEL_OPTIONS)
    try:
        call = pb_grpc.ServingStub(channel).Generate(request_to_pb(request), timeout=timeout_s)
        try:
            yield from call
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"chain at {entry}") from None
    finally:
        channel.close()


def stage_info(address: str, timeout_s: float = 10.0) -> pb.StageInfo:
    channel = security.channel(address, CHANNEL_OPTIONS)
    try:
        return pb_grpc.ServingStub(channel).Info(pb.StageInfoRequest(), timeout=timeout_s)
    except grpc.RpcError as err:
        raise error_from_rpc(err, f"stage {address}") from None
    finally:
        channel.close()


def serve_stage(stage: LocalBlockStage | LocalARStage, address: str, *, max_workers: int = 160,
                meter: Meter | None = None, health: NodeHealth | None = None) -> tuple[grpc.Server, int, threading.Event]:
    """Serve `stage` on `address`, with Health (SERVING from the start unless `health` drives it) and reflection."""
    stop = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="stage"),
                         options=LATENCY_SERVER_OPTIONS, interceptors=[*interceptors(), DecodeGuard()])
    pb_grpc.add_ServingServicer_to_server(StageServicer(stage, stop, meter), server)
    (health or NodeHealth(serving=True)).add_to(server, [SERVICE])
    port = bind(server, address)
    server.start()
    return server, port, stop
