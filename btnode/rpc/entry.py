"""An asyncio client of a chain's entry, for servers that talk to many clients at once (the HTTP
API, node/api.py): what the chain serves (`chain_info`) and one request's segments as they come
(`EntryClient.stream`), over spare entries tried in order, each segment awaited with a deadline.
Closing the stream early cancels the gRPC call, and the entry then stops the request. Free of torch
(rpc/wire.py): the HTTP proxy in front of a remote chain stays light."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from btnode.errors import MalformedInput, PeerUnavailable, StageTimeout
from btnode.model.config import ModelConfig, UnitKind
from btnode.rpc import security
from btnode.rpc.status import error_from_rpc
from btnode.rpc.wire import CHANNEL_OPTIONS, READOUTS, UNIT_KINDS, model_from_pb, request_to_pb, weights_from_pb
from btnode.serve.defaults import MEASURED_READOUT, ServingDefaults
from btnode.serve.identity import Weights
from btnode.serve.request import GenerationRequest
from btnode.v2 import serve_pb2 as pb
from btnode.v2 import serve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChainInfo:
    """The chain behind an entry, from its Info: its model and, for a block chain, B."""

    kind: UnitKind
    cfg: ModelConfig
    fingerprint: str
    entry: str  # the entry that answered
    defaults: ServingDefaults | None = None  # a block chain's serving defaults (None: AR, or an older entry)
    weights: Weights | None = None  # the weights the chain serves (None: an older stage on it, or one did not say)

    @property
    def n_blocks(self) -> int | None:
        """B scoring blocks for GenerationRequest.checked; None: the AR chain."""
        return None if self.kind is UnitKind.AR else self.cfg.n_blocks


@dataclass(frozen=True)
class Segment:
    """One reply of the entry: a traversal's bytes."""

    new_bytes: bytes
    traversals: int
    route: list[str] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0


class EntryClient:
    """The chain's entries, primary first. A spare entry is tried when one is unavailable before
    its first segment; after that a failure ends the request (segments are seeded by their index,
    so a retry elsewhere would not continue the same text)."""

    def __init__(self, entries: Sequence[str], *, segment_timeout_s: float = 60.0, info_timeout_s: float = 10.0):
        if not entries:
            raise ValueError("an entry client needs at least one entry address")
        self.entries = list(entries)
        self.segment_timeout_s = segment_timeout_s
        self.info_timeout_s = info_timeout_s

    async def info(self) -> ChainInfo:
        errors = []
        for entry in self.entries:
            channel, metadata = security.aio_channel(entry, CHANNEL_OPTIONS)
            try:
                m = await pb_grpc.ServingStub(channel).Info(pb.StageInfoRequest(), timeout=self.info_timeout_s,
                                                          metadata=metadata)
                cfg = model_from_pb(m.config)
                kind = UNIT_KINDS.from_pb(m.kind, "kind") or UnitKind(cfg.kind)  # UNSPECIFIED: the config's
                defaults = None
                if kind is UnitKind.BLOCK and m.default_k:
                    defaults = ServingDefaults(readout=READOUTS.from_pb(m.default_readout, "readout")
                                               or MEASURED_READOUT, k=m.default_k, n_steps=m.default_steps or None,
                                               source="entry")
                try:
                    weights = weights_from_pb(m)
                except MalformedInput as exc:
                    log.warning("entry %s: its weights are not known (%s)", entry, exc)
                    weights = None
                return ChainInfo(kind=kind, cfg=cfg, fingerprint=m.fingerprint, entry=entry, defaults=defaults,
                                 weights=weights)
            except grpc.aio.AioRpcError as err:
                exc = error_from_rpc(err, f"entry {entry}")
                if not isinstance(exc, PeerUnavailable):
                    raise exc from None
                errors.append(str(exc))
            finally:
                await channel.close()
        raise PeerUnavailable("no entry of the chain answered: " + "; ".join(errors))

    async def stream(self, request: GenerationRequest) -> AsyncIterator[Segment]:
        """The request's segments as the chain serves them. PeerUnavailable when no entry is left,
        StageTimeout when a segment takes longer than segment_timeout_s; other domain errors as the
        entry raised them (InputError for a request it refuses)."""
        errors = []
        for entry in self.entries:
            channel, metadata = security.aio_channel(entry, CHANNEL_OPTIONS)
            call = pb_grpc.ServingStub(channel).Generate(request_to_pb(request), metadata=metadata)
            started = False
            try:
                while True:
                    try:
                        reply = await asyncio.wait_for(call.read(), self.segment_timeout_s)
                    except asyncio.TimeoutError:
                        raise StageTimeout(f"chain at {entry}: no segment within {self.segment_timeout_s:g} s") from None
                    if reply is grpc.aio.EOF:
                        return
                    started = True
                    yield Segment(new_bytes=bytes(reply.new_bytes), traversals=reply.traversals,
                                  route=list(reply.route), drafted=reply.drafted, accepted=reply.accepted)
            except grpc.aio.AioRpcError as err:
                exc = error_from_rpc(err, f"chain at {entry}")
                if started or not isinstance(exc, PeerUnavailable) or isinstance(exc, StageTimeout):
                    raise exc from None
                log.warning("entry %s unavailable (%s); %s", entry, exc,
                            "trying the next" if entry != self.entries[-1] else "no entry left")
                errors.append(str(exc))
            finally:
                call.cancel()  # a no-op after the end; otherwise the entry sees the client go
                await channel.close()
        raise PeerUnavailable("no entry of the chain answered: " + "; ".join(errors))
