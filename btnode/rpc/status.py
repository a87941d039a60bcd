"""Domain errors ⇄ gRPC status codes, in one table used by both the server and the client.
The reason label travels in trailing metadata so a client can count and report it."""

from __future__ import annotations

import grpc

from btnode.errors import (BtnodeError, CacheMiss, CheckpointError, ConfigError, ConfigMismatchError, Forbidden,
                           InputError, MalformedInput, Overloaded, PeerInputError, PeerUnavailable, Refused,
                           StageTimeout, StaleUpdate, TooLarge, Unauthenticated, UnknownBlock)
from btnode.rpc.limits import LIMIT_REASONS

REASON_KEY = "btnode-reason"
REFUSALS = ("not_joined", "second_push", "no_identities")  # FAILED_PRECONDITION reasons that come back as Refused

_CODES: list[tuple[type[BtnodeError], grpc.StatusCode]] = [
    (MalformedInput, grpc.StatusCode.INVALID_ARGUMENT),
    (Forbidden, grpc.StatusCode.PERMISSION_DENIED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (Refused, grpc.StatusCode.FAILED_PRECONDITION),
    (InputError, grpc.StatusCode.INVALID_ARGUMENT),
    (CacheMiss, grpc.StatusCode.FAILED_PRECONDITION),
    (TooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
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
