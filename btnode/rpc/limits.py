"""Per-peer limits (issue #7): how many streams one peer may have open at once, and how often it
may join. A peer is its IP address (ports change per connection). Over a limit the call is
refused with RESOURCE_EXHAUSTED before its handler runs, and counted.

Watch streams are long-lived by design (one per worker), so they have their own, larger limit;
the transfer streams (Push, SubmitState, Pull, FetchDelta) share `max_streams`. Frame, chunk and update sizes
are limited where they are parsed (codec/frames.py: a chunk ≤ 1 MiB, a frame ≤ its tensor's fp32
size plus slack, an update = exactly the block's tensors; gRPC messages ≤ 4 MiB).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from btnode.settings import flag

TRANSFERS = ("Push", "SubmitState", "Pull", "FetchDelta")


@dataclass(frozen=True)
class PeerLimits:
    max_streams: int = flag("--max-streams-per-peer", "Concurrent Push/SubmitState/Pull/FetchDelta streams one IP "
                                                     "may hold.",
                            default=8)
    max_watches: int = 64  # concurrent Watch streams per peer (one per worker on that host)
    joins_per_minute: int = flag("--max-joins-per-minute", "Join attempts one IP may make per minute.", default=30)


def peer_host(peer: str) -> str:
    """'ipv4:1.2.3.4:5678' → '1.2.3.4'; 'ipv6:[::1]:5678' → '::1'."""
    kind, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0] if kind in ("ipv4", "ipv6") else peer
    return host.strip("[]")


class PeerLimiter(grpc.ServerInterceptor):
    def __init__(self, limits: PeerLimits, on_refusal: Callable[[str], None] = lambda reason: None,
                 clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.on_refusal = on_refusal
        self.clock = clock
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], int] = defaultdict(int)  # (peer, "transfer"|"watch") → open streams
        self._joins: dict[str, deque[float]] = defaultdict(deque)

    def _admit(self, peer: str, method: str) -> str | None:
        """None if admitted (and counted), else the refusal reason."""
        with self._lock:
            if method == "Join":
                q, now = self._joins[peer], self.clock()
                while q and q[0] < now - 60:
                    q.popleft()
                if len(q) >= self.limits.joins_per_minute:
                    return "join_rate"
                q.append(now)
                return None
            kind = "watch" if method == "Watch" else "transfer" if method in TRANSFERS else ""
            if not kind:
                return None
            cap = self.limits.max_watches if kind == "watch" else self.limits.max_streams
            if self._open[(peer, kind)] >= cap:
                return f"{kind}_streams"
            self._open[(peer, kind)] += 1
            return None

    def open_streams(self, kind: str = "transfer") -> int:
        """Streams of `kind` ("transfer" or "watch") admitted and not yet ended, over all peers."""
        with self._lock:
            return sum(n for (_, k), n in self._open.items() if k == kind)

    def _release(self, peer: str, method: str) -> None:
        kind = "watch" if method == "Watch" else "transfer" if method in TRANSFERS else ""
        if kind:
            with self._lock:
                self._open[(peer, kind)] -= 1
                if self._open[(peer, kind)] <= 0:
                    del self._open[(peer, kind)]

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        limiter = self

        def guarded(fn: Callable, streaming_response: bool) -> Callable:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                peer = peer_host(context.peer())
                reason = limiter._admit(peer, method)
                if reason is not None:
                    limiter.on_refusal(reason)
                    context.set_trailing_metadata((("btnode-reason", reason),))
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"{method}: over the per-peer limit ({reason.replace('_', ' ')}) for {peer}")
                if method == "Join":
                    return fn(request, context)
                if streaming_response:
                    try:  # a request refused before its stream exists (one that does not parse) holds no slot
                        responses = fn(request, context)
                    except BaseException:
                        limiter._release(peer, method)
                        raise
                    return limiter._stream(responses, peer, method)
                try:
                    return fn(request, context)
                finally:
                    limiter._release(peer, method)
            return call

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(guarded(handler.unary_unary, False),
                                                       request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(guarded(handler.unary_stream, True),
                                                        request_deserializer=handler.request_deserializer,
                                                        response_serializer=handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(guarded(handler.stream_unary, False),
                                                        request_deserializer=handler.request_deserializer,
                                                        response_serializer=handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(guarded(handler.stream_stream, True),
                                                     request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)

    def _stream(self, responses: Iterator[Any], peer: str, method: str) -> Iterator[Any]:
        try:
            yield from responses
        finally:
            self._release(peer, method)
