"""Call limits (issues #7, #25): per peer, how many streams one IP may hold and how often it may
join; over all peers, separate budgets for version streams (Watch), transfers and other calls, so
that a thousand held version streams never starve a push or a pull. A transfer that finds the
transfer budget full waits for a slot (first come, first served) before its handler reads a byte,
so that HTTP/2 flow control holds its sender (the server reads no payload it has no slot for:
rpc/server.py turns off BDP probing, which would open each stream's window to its whole upload);
it is refused only when --transfer-queue transfers already wait or it waited --transfer-wait-s.
Over a limit the call is refused with RESOURCE_EXHAUSTED before its handler runs, with its
reason in trailing metadata, counted (`on_refusal`) and logged (at most one line per reason
every LOG_EVERY_S).

The server's threads and gRPC's own cap are sized from these budgets (`PeerLimits.threads`), so
gRPC's silent refusal is never the one a worker meets. Frame, chunk and update sizes are limited
where they are parsed (codec/frames.py: a chunk ≤ 1 MiB, a frame ≤ its tensor's fp32 size plus
slack, an update = exactly the block's tensors; gRPC messages ≤ 4 MiB).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from btnode.settings import flag
from btnode.v2 import swarm_pb2 as pb

log = logging.getLogger(__name__)


def method_path(service: str, method: str) -> str:
    """The path gRPC names a call by ("/btnode.v2.Worker/Push" for "Worker", "Push"); KeyError for a method the
    schema does not have, so that a renamed one fails the import rather than leave a budget unused."""
    descriptor = pb.DESCRIPTOR.services_by_name[service]
    return f"/{descriptor.full_name}/{descriptor.methods_by_name[method].name}"


JOIN = method_path("Worker", "Join")  # the call the per-peer join rate limits
TRANSFERS = frozenset([*(method_path("Worker", m) for m in ("Push", "SubmitState", "Pull", "FetchDelta")),
                       method_path("Relay", "SubmitEvidence"),
                       *(method_path("Verification", m) for m in ("VerifyInputs", "SubmitDisputeState"))])
LOG_EVERY_S = 10.0  # a refusal's log line, at most once per reason in this long (with the count since)
LIMIT_REASONS = ("join_rate", "watch_streams", "transfer_streams", "calls", "watch_budget", "transfer_budget",
                 "call_budget", "transfer_wait")  # a refusal's reason: a client backs off and retries
SPARE_THREADS = 32  # past the budgets: room for calls that are only being refused


@dataclass(frozen=True)
class PeerLimits:
    """Local settings: a node may size its own (nothing here is swarm-wide)."""

    max_workers: int = flag("--max-workers", "Connected workers this node serves: each holds one version stream "
                                             "(Watch), and the server's threads and its budget of version streams "
                                             "are sized from it.", default=1100, min=1)
    max_transfers: int = flag("--max-transfers", "Push/SubmitState/Pull/FetchDelta streams in progress at once over "
                                                 "all peers (a push holds its compressed upload until one of "
                                                 "--decode-slots decodes it; a pull, one tensor's frame at a time); "
                                                 "more are refused for now and retried by their clients.",
                              default=64, min=1)
    transfer_queue: int = flag("--transfer-queue", "Transfers that may wait for a slot when --max-transfers are in "
                                                   "progress (each holds a server thread and at most one flow-control "
                                                   "window of its upload, not the upload); more are refused for now.",
                               default=1024, min=0)
    transfer_wait_s: float = flag("--transfer-wait-s", "How long a transfer may wait for a slot (less if its own "
                                                       "deadline comes sooner) before it is refused for now.",
                                  default=60.0, min=0)
    max_calls: int = 64  # other calls in progress at once (Join, Leave, Status, Revoke, health)
    max_streams: int = flag("--max-streams-per-peer", "Concurrent Push/SubmitState/Pull/FetchDelta streams one IP "
                                                     "may hold.",
                            default=16, min=1)
    max_watches: int = flag("--max-watches-per-peer", "Version streams one IP may hold: one per worker on that host "
                                                      "(a relay or a load-test host needs one per worker it runs).",
                            default=256, min=1)
    joins_per_minute: int = flag("--max-joins-per-minute", "Join attempts one IP may make per minute.", default=30)
    relay_joins_per_minute: int = flag("--max-relay-joins-per-minute",
                                       "Join attempts per minute from an IP a relay joined from: its children's "
                                       "joins, which it passes on one by one.", default=600, min=1)

    @property
    def threads(self) -> int:
        """Server threads (and gRPC's own cap on calls in progress): every budget and the transfer queue
        full, plus spare."""
        return self.max_workers + self.max_transfers + self.transfer_queue + self.max_calls + SPARE_THREADS


def kind_of(full_method: str) -> str:
    """'watch', 'transfer' or 'call': which global budget a call draws on."""
    if full_method.rpartition("/")[2] == "Watch":  # ours, and gRPC Health's: both are held open
        return "watch"
    return "transfer" if full_method in TRANSFERS else "call"


def peer_host(peer: str) -> str:
    """'ipv4:1.2.3.4:5678' → '1.2.3.4'; 'ipv6:[::1]:5678' → '::1'."""
    kind, _, rest = peer.partition(":")
    host = rest.rsplit(":", 1)[0] if kind in ("ipv4", "ipv6") else peer
    return host.strip("[]")


class _Waiter:
    """A transfer waiting for a slot: woken (`woken`) when a call hands it its slot (`granted`) or
    when its caller goes away. It sleeps until then: a thousand waiters that polled every half
    second starved the node's other threads: the watchdog's keep-alives fell far apart (bench/scale.py)."""

    __slots__ = ("granted", "woken")

    def __init__(self) -> None:
        self.granted = False
        self.woken = threading.Event()


class PeerLimiter(grpc.ServerInterceptor):
    def __init__(self, limits: PeerLimits, on_refusal: Callable[[str], None] = lambda reason: None,
                 clock: Callable[[], float] = time.monotonic, on_queued: Callable[[], None] = lambda: None):
        """`on_refusal(reason)` counts each refusal; `on_queued()` each transfer that had to wait for a slot."""
        self.limits = limits
        self.on_refusal, self.on_queued = on_refusal, on_queued
        self.clock = clock
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], int] = defaultdict(int)  # (peer, kind) → open calls
        self._total: Counter[str] = Counter()  # kind → open calls over all peers
        self._joins: dict[str, deque[float]] = defaultdict(deque)
        self._relay_hosts: set[str] = set()  # hosts a relay joined from: their joins are its children's
        self._quiet: dict[str, tuple[float, int]] = {}  # reason → (last logged at, refused since)
        self._waiting: deque[_Waiter] = deque()  # transfers waiting for a slot, first come first served
        self.waited = 0  # transfers that waited for a slot and got one
        self.most_waiting = 0  # the longest the queue has been

    def _budget(self, kind: str) -> tuple[int, int]:
        """(per peer, over all peers) for calls of `kind`."""
        lim = self.limits
        return {"watch": (lim.max_watches, lim.max_workers), "transfer": (lim.max_streams, lim.max_transfers),
                "call": (lim.max_calls, lim.max_calls)}[kind]

    def trust_relay(self, peer: str) -> None:
        """A relay joined from `peer` (an rpc peer string or a host): the joins from its host are its
        children's, passed on one by one, and count against --max-relay-joins-per-minute. Without mutual
        TLS any peer may say it is a relay; its joins are still each checked, and that budget bounds it."""
        with self._lock:
            self._relay_hosts.add(peer_host(peer))

    def _admit(self, peer: str, full_method: str) -> str | _Waiter | None:
        """None if admitted (and counted); a _Waiter if it is queued for a transfer slot (counted against
        its peer's streams already); else the refusal reason. A join refused because too many calls are
        open does not count against the join rate: it would spend the minute's budget on attempts that
        never ran (a relay passing on 64 children's joins at once lost its joins for a minute)."""
        kind = kind_of(full_method)
        with self._lock:
            joins: deque[float] | None = None
            if full_method == JOIN:
                joins, now = self._joins[peer], self.clock()
                while joins and joins[0] < now - 60:
                    joins.popleft()
                rate = (self.limits.relay_joins_per_minute if peer in self._relay_hosts
                        else self.limits.joins_per_minute)
                if len(joins) >= rate:
                    return "join_rate"
            per_peer, overall = self._budget(kind)
            if self._open[(peer, kind)] >= per_peer:
                return f"{kind}_streams" if kind != "call" else "calls"
            if self._total[kind] >= overall or (kind == "transfer" and self._waiting):  # no overtaking the queue
                if kind != "transfer" or len(self._waiting) >= self.limits.transfer_queue:
                    return f"{kind}_budget"
                self._open[(peer, kind)] += 1
                waiter = _Waiter()
                self._waiting.append(waiter)
                self.most_waiting = max(self.most_waiting, len(self._waiting))
                self.on_queued()
                return waiter
            if joins is not None:
                joins.append(now)
            self._open[(peer, kind)] += 1
            self._total[kind] += 1
            return None

    def _wait(self, waiter: _Waiter, peer: str, context: grpc.ServicerContext) -> str | None:
        """Wait for the slot `waiter` queued for: None once it has it, else the refusal reason (and out
        of the queue). Bounded by --transfer-wait-s and by the call's own deadline."""
        left = context.time_remaining()
        wait_s = min(self.limits.transfer_wait_s, math.inf if left is None else max(0.0, left - 1.0))
        if context.add_callback(waiter.woken.set):  # False: the call has ended already
            waiter.woken.wait(wait_s)
        with self._lock:
            if waiter.granted:  # granted, perhaps just as it gave up: the slot is its own
                self.waited += 1
                return None
            self._waiting.remove(waiter)
            self._open[(peer, "transfer")] -= 1
            if self._open[(peer, "transfer")] <= 0:
                del self._open[(peer, "transfer")]
        return "transfer_wait"

    def open_streams(self, kind: str = "transfer") -> int:
        """Calls of `kind` ("transfer", "watch" or "call") admitted and not yet ended, over all peers."""
        with self._lock:
            return self._total[kind]

    def _release(self, peer: str, full_method: str) -> None:
        """End a call; a transfer's slot passes to the first one waiting, if any."""
        kind = kind_of(full_method)
        with self._lock:
            self._open[(peer, kind)] -= 1
            if self._open[(peer, kind)] <= 0:
                del self._open[(peer, kind)]
            if kind == "transfer" and self._waiting:
                waiter = self._waiting.popleft()  # its peer's stream was counted when it queued
                waiter.granted = True
                waiter.woken.set()
            else:
                self._total[kind] -= 1

    def waiting(self) -> int:
        """Transfers waiting for a slot now."""
        with self._lock:
            return len(self._waiting)

    def _refused(self, reason: str, method: str, peer: str) -> None:
        """Count every refusal; log the first of a reason, then at most one line per LOG_EVERY_S."""
        self.on_refusal(reason)
        now = self.clock()
        with self._lock:
            last, since = self._quiet.get(reason, (-LOG_EVERY_S, 0))
            if now - last < LOG_EVERY_S:
                self._quiet[reason] = (last, since + 1)
                return
            self._quiet[reason] = (now, 0)
        held = ", ".join(f"{k} {n}" for k, n in sorted(self._total.items()))
        held += f", {len(self._waiting)} waiting for a transfer slot" if self._waiting else ""
        log.warning("refused %s from %s: over the limit (%s; in progress: %s)%s", method, peer, reason, held or "none",
                    f"; {since} more refused since the last line" if since else "")

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        full_method = details.method
        method = full_method.rsplit("/", 1)[-1]
        limiter = self

        def guarded(fn: Callable, streaming_response: bool) -> Callable:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                peer = peer_host(context.peer())
                reason = limiter._admit(peer, full_method)
                if isinstance(reason, _Waiter):  # its payload stays with its sender while it waits
                    reason = limiter._wait(reason, peer, context)
                if reason is not None:
                    limiter._refused(reason, method, peer)
                    context.set_trailing_metadata((("btnode-reason", reason),))
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"{method}: over the limit ({reason.replace('_', ' ')}) for {peer}; retry later")
                if streaming_response:
                    try:  # a request refused before its stream exists (one that does not parse) holds no slot
                        responses = fn(request, context)
                    except BaseException:
                        limiter._release(peer, full_method)
                        raise
                    return limiter._stream(responses, peer, full_method)
                try:
                    return fn(request, context)
                finally:
                    limiter._release(peer, full_method)
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

    def _stream(self, responses: Iterator[Any], peer: str, full_method: str) -> Iterator[Any]:
        try:
            yield from responses
        finally:
            self._release(peer, full_method)
