"""Domain errors ⇄ gRPC status codes, in one table used by both the server and the client.
The reason label travels in trailing metadata so a client can count and report it. `_guard` is
the server's half: it wraps every handler (rpc/server.py, rpc/verification.py, rpc/stages.py)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from btnode.errors import (BtnodeError, CacheMiss, CheckpointError, ConfigError, ConfigMismatchError, Forbidden,
                           InputError, JoinPending, MalformedInput, Overloaded, PeerInputError, PeerUnavailable, Refused,
                           StageTimeout, StaleUpdate, TooLarge, Unauthenticated, UnknownBlock)
from btnode.rpc.limits import LIMIT_REASONS

log = logging.getLogger(__name__)
REASON_KEY = "btnode-reason"
REFUSALS = ("not_joined", "second_push", "no_identities", "no_delegation")  # FAILED_PRECONDITION reasons that come back as Refused

_CODES: list[tuple[type[BtnodeError], grpc.StatusCode]] = [
    (MalformedInput, grpc.StatusCode.INVALID_ARGUMENT),
    (Forbidden, grpc.StatusCode.PERMISSION_DENIED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (Refused, grpc.StatusCode.FAILED_PRECONDITION),
    (InputError, grpc.StatusCode.INVALID_ARGUMENT),
    (CacheMiss, grpc.StatusCode.FAILED_PRECONDITION),
    (TooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (JoinPending, grpc.StatusCode.ABORTED),  # before Overloaded: a race with the caller's own join, not a limit
    (UnknownBlock, grpc.StatusCode.NOT_FOUND),
    (StaleUpdate, grpc.StatusCode.FAILED_PRECONDITION),
    (ConfigMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PeerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (CheckpointError, grpc.StatusCode.INTERNAL),
]


def code_for(exc: BtnodeError) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def reason_for(exc: BtnodeError) -> str:
    if isinstance(exc, (PeerInputError, Overloaded)):
        return exc.reason
    if isinstance(exc, ConfigMismatchError):
        return "fingerprint"
    return type(exc).__name__


def error_from_rpc(err: grpc.RpcError, what: str) -> BtnodeError:
    """The domain error a failed call stands for (client side)."""
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    reason = ""
    for key, value in (err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") else ():
        if key == REASON_KEY:
            reason = value
    message = f"{what}: {details}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or code == grpc.StatusCode.UNAVAILABLE and reason == "StageTimeout":
        return StageTimeout(message)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return PeerUnavailable(message)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(f"{message} (check the swarm token: BTNODE_TOKEN or --token-file)")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return Forbidden(reason or "forbidden", message)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if reason == "InputError":
            return InputError(message)
        return MalformedInput(reason or "invalid", message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if reason in LIMIT_REASONS:
            return Overloaded(reason, message)
        if not reason and "Concurrent RPC limit" in details:  # gRPC's own cap (sized never to be met first)
            return Overloaded("grpc_cap", message)
        return TooLarge(reason or "too_large", message)
    if code == grpc.StatusCode.ABORTED and reason == "join_pending":
        return JoinPending(message)
    if code == grpc.StatusCode.NOT_FOUND:
        return UnknownBlock(reason or "not_found", message)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        if reason == "fingerprint":
            return ConfigMismatchError(message, [])
        if reason in REFUSALS:
            return Refused(reason, message)
        if reason == "cache_miss":
            return CacheMiss(message)
        return StaleUpdate(reason or "stale", message)
    return BtnodeError(f"{message} ({code.name if code else 'unknown status'})")


def _abort(context: grpc.ServicerContext, exc: BtnodeError) -> None:
    context.set_trailing_metadata(((REASON_KEY, reason_for(exc)),))
    context.abort(code_for(exc), str(exc))


def _guard(method: Callable) -> Callable:
    """Map errors to status codes for unary and server-streaming handlers alike."""

    def handle(self: Any, context: grpc.ServicerContext, exc: BaseException) -> None:
        if isinstance(exc, BtnodeError):
            _abort(context, exc)
        log.exception("internal error in %s", method.__name__)
        context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}: {type(exc).__name__}")

    if getattr(method, "streaming", False):
        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - the guard is the last line
                handle(self, context, exc)
        return stream

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001
            handle(self, context, exc)
    return unary


def streaming(method: Callable) -> Callable:
    method.streaming = True  # type: ignore[attr-defined]
    return method
