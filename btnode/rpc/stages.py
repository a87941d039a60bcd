"""Serving over gRPC: `StageServicer` exposes a local stage (a block, or a slice of the AR
baseline's layers), `RemoteBlockStage` / `RemoteARStage` are the same Stage protocol seen from the
previous stage, and `generate_remote` is the client of a chain's entry."""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import torch

from btnode.errors import ConfigError, InputError, MalformedInput
from btnode.model.noise import default_steps
from btnode.rpc.server import CHANNEL_OPTIONS, SERVER_OPTIONS, _guard, streaming
from btnode.rpc.status import error_from_rpc
from btnode.serve import driver
from btnode.serve.ar import ARState, LocalARStage
from btnode.serve.stages import LocalBlockStage, SegmentResult, SegmentState
from btnode.v1 import serve_pb2 as pb
from btnode.v1 import serve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
MAX_STATE_ELEMENTS = 1 << 22  # 16 MiB of float32: far above any state a configured model sends


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


def _segment_from_pb(r: pb.SegmentRequest) -> SegmentState:
    return SegmentState(request_id=r.request_id, context=bytes(r.context), segment=r.segment, k=r.k,
                        n_steps=r.n_steps, seed=r.seed, temperature=r.temperature,
                        z=tensor_from_pb(r.z, "segment state"), want_logits=r.want_logits)


def _segment_to_pb(s: SegmentState) -> pb.SegmentRequest:
    return pb.SegmentRequest(request_id=s.request_id, context=s.context, segment=s.segment, k=s.k, n_steps=s.n_steps,
                             seed=s.seed, temperature=s.temperature, z=tensor_to_pb(s.z), want_logits=s.want_logits)


def _result_to_pb(r: SegmentResult) -> pb.SegmentReply:
    reply = pb.SegmentReply(new_bytes=r.new_bytes, route=r.route)
    if r.logits is not None:
        reply.logits.CopyFrom(tensor_to_pb(r.logits))
    return reply


def _result_from_pb(m: pb.SegmentReply | pb.ARReply) -> SegmentResult:
    logits = tensor_from_pb(m.logits, "logits") if isinstance(m, pb.SegmentReply) and m.HasField("logits") else None
    return SegmentResult(new_bytes=bytes(m.new_bytes), logits=logits, route=list(m.route))


class StageServicer(pb_grpc.StageServicer):
    def __init__(self, stage: LocalBlockStage | LocalARStage, stop: threading.Event):
        self.stage = stage
        self.stop = stop
        self.is_ar = isinstance(stage, LocalARStage)

    @_guard
    def Info(self, request: pb.StageInfoRequest, context: grpc.ServicerContext) -> pb.StageInfo:
        s, cfg = self.stage, self.stage.cfg
        if isinstance(s, LocalARStage):
            return pb.StageInfo(kind="ar", first_layer=s.lo, n_layers=s.hi - s.lo, last=s.last, name=s.name,
                                fingerprint=cfg.fingerprint(), config_json=json.dumps(cfg.to_dict()))
        return pb.StageInfo(kind="block", block=s.index, last=s.next is None, name=s.name,
                            fingerprint=cfg.fingerprint(), config_json=json.dumps(cfg.to_dict()))

    @_guard
    def Forward(self, request: pb.SegmentRequest, context: grpc.ServicerContext) -> pb.SegmentReply:
        if self.is_ar:
            raise InputError("this stage serves the autoregressive chain (use ForwardAR)")
        return _result_to_pb(self.stage.forward(_segment_from_pb(request)))  # type: ignore[arg-type]

    @_guard
    def ForwardAR(self, request: pb.ARRequest, context: grpc.ServicerContext) -> pb.ARReply:
        if not self.is_ar:
            raise InputError("this stage serves a block of the one-sweep chain (use Forward)")
        hidden = tensor_from_pb(request.hidden, "hidden state") if request.HasField("hidden") else None
        state = ARState(request_id=request.request_id, tokens=bytes(request.tokens), step=request.step,
                        seed=request.seed, temperature=request.temperature, start=request.start, hidden=hidden,
                        reset=request.reset)
        result = self.stage.forward(state)  # type: ignore[arg-type]
        return pb.ARReply(new_bytes=result.new_bytes, route=result.route)

    @_guard
    @streaming
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateReply]:
        s, cfg = self.stage, self.stage.cfg
        if isinstance(s, LocalARStage):
            if not s.first:
                raise InputError(f"{s.name} is not the first stage of its chain; send requests to the entry")
            results = driver.generate_ar(s, cfg, bytes(request.prompt), n_bytes=request.n_bytes, seed=request.seed,
                                         temperature=request.temperature)
        else:
            if s.index != 0:
                raise InputError(f"{s.name} is not the first stage of its chain; send requests to the entry")
            k = request.k or max(cfg.segments)
            results = driver.generate(s, cfg, s.n_blocks, bytes(request.prompt), n_bytes=request.n_bytes, k=k,
                                      n_steps=request.n_steps or default_steps(cfg), seed=request.seed,
                                      temperature=request.temperature, want_logits=request.want_logits)
        for i, r in enumerate(results, start=1):
            if not context.is_active() or self.stop.is_set():
                return
            reply = pb.GenerateReply(new_bytes=r.new_bytes, traversals=i, route=r.route)
            if r.logits is not None:
                reply.logits.CopyFrom(tensor_to_pb(r.logits))
            yield reply


class RemoteBlockStage:
    """The next block's stage, across the network (one Forward call per segment)."""

    def __init__(self, address: str, *, timeout_s: float = 60.0):
        self.address = self.name = address
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.StageStub(self.channel)

    def forward(self, state: SegmentState) -> SegmentResult:
        try:
            return _result_from_pb(self.stub.Forward(_segment_to_pb(state), timeout=self.timeout_s))
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"stage {self.address}") from None

    def close(self) -> None:
        self.channel.close()


class RemoteARStage(RemoteBlockStage):
    def forward(self, state: ARState) -> SegmentResult:  # type: ignore[override]
        req = pb.ARRequest(request_id=state.request_id, tokens=state.tokens, step=state.step, seed=state.seed,
                           temperature=state.temperature, start=state.start, reset=state.reset)
        if state.hidden is not None:
            req.hidden.CopyFrom(tensor_to_pb(state.hidden))
        try:
            return _result_from_pb(self.stub.ForwardAR(req, timeout=self.timeout_s))
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"stage {self.address}") from None


def generate_remote(entry: str, prompt: bytes, *, n_bytes: int, k: int = 0, n_steps: int = 0, seed: int = 0,
                    temperature: float = 0.0, want_logits: bool = False,
                    timeout_s: float = 3600.0) -> Iterator[pb.GenerateReply]:
    """Stream a request's segments from the chain whose first stage is at `entry`."""
    channel = grpc.insecure_channel(entry, options=CHANNEL_OPTIONS)
    try:
        call = pb_grpc.StageStub(channel).Generate(
            pb.GenerateRequest(prompt=prompt, n_bytes=n_bytes, k=k, n_steps=n_steps, seed=seed,
                               temperature=temperature, want_logits=want_logits), timeout=timeout_s)
        try:
            yield from call
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"chain at {entry}") from None
    finally:
        channel.close()


def stage_info(address: str, timeout_s: float = 10.0) -> pb.StageInfo:
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        return pb_grpc.StageStub(channel).Info(pb.StageInfoRequest(), timeout=timeout_s)
    except grpc.RpcError as err:
        raise error_from_rpc(err, f"stage {address}") from None
    finally:
        channel.close()


def serve_stage(stage: LocalBlockStage | LocalARStage, address: str, *,
                max_workers: int = 16) -> tuple[grpc.Server, int, threading.Event]:
    stop = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="stage"),
                         options=SERVER_OPTIONS)
    pb_grpc.add_StageServicer_to_server(StageServicer(stage, stop), server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise ConfigError(f"cannot listen on {address}: the address is in use or not local")
    server.start()
    return server, port, stop
