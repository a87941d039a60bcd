"""Who may talk to a node: TLS or mutual TLS through gRPC credentials, and a swarm token checked
on every RPC (design §3.5).

A node has one identity, so the settings are process-wide: the CLI calls `configure()` once and
every channel and server made here uses them (tests pass a `Security` explicitly instead).

- Token: clients send `authorization: Bearer <token>` on every call; servers compare it with
  `hmac.compare_digest` (constant time) and answer UNAUTHENTICATED when it is missing or wrong,
  before any handler runs. One method is open: `grpc.health.v1.Health/Check`, because
  Kubernetes probes, grpc_health_probe and load balancers send no token; it says SERVING or
  NOT_SERVING and nothing else. Health/Watch (it holds a stream) and reflection need the token.
- TLS: a server with `cert` and `key` listens with TLS; with `ca` and `client_auth` too it demands
  a client certificate signed by that CA (mutual TLS). A client with `ca` verifies the server
  against it; with `cert` and `key` it presents its own certificate.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from btnode.errors import ConfigError

TOKEN_KEY = "authorization"
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})  # answered without the token (see above)


@dataclass(frozen=True)
class Security:
    token: str = ""
    cert: Path | None = None  # this node's certificate chain (PEM)
    key: Path | None = None  # its private key (PEM)
    ca: Path | None = None  # the CA that signs the swarm's certificates (PEM)
    client_auth: bool = False  # servers: require client certificates (mutual TLS)
    server_name: str = ""  # clients: expected name in the server certificate, when not the host dialled

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        if self.client_auth and (self.ca is None or self.cert is None):
            raise ConfigError("mutual TLS needs --tls-ca (to check clients) and the server's --tls-cert/--tls-key")

    @property
    def tls(self) -> bool:
        return self.cert is not None or self.ca is not None


_current = Security()


def configure(security: Security) -> None:
    global _current
    _current = security


def current() -> Security:
    return _current


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None


class _TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self.header = (TOKEN_KEY, f"Bearer {token}")

    def _details(self, d: Any) -> Any:
        return d._replace(metadata=[*(d.metadata or ()), self.header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def _credentials(sec: Security, options: list[tuple[str, Any]]) -> tuple[grpc.ChannelCredentials | None, list]:
    opts = list(options)
    if not sec.tls:
        return None, opts
    if sec.server_name:
        opts.append(("grpc.ssl_target_name_override", sec.server_name))
    return grpc.ssl_channel_credentials(root_certificates=_read(sec.ca, "CA certificate"),
                                        private_key=_read(sec.key, "TLS key"),
                                        certificate_chain=_read(sec.cert, "TLS certificate")), opts


def channel(address: str, options: list[tuple[str, Any]], security: Security | None = None) -> grpc.Channel:
    """A channel to `address` with this node's TLS settings and token."""
    sec = security or _current
    creds, opts = _credentials(sec, options)
    ch = grpc.secure_channel(address, creds, options=opts) if creds else grpc.insecure_channel(address, options=opts)
    if sec.token:
        ch = grpc.intercept_channel(ch, _TokenClientInterceptor(sec.token))
    return ch


def aio_channel(address: str, options: list[tuple[str, Any]],
                security: Security | None = None) -> tuple[grpc.aio.Channel, tuple[tuple[str, str], ...]]:
    """An asyncio channel to `address` with this node's TLS settings, and the metadata every call on
    it must send (the token: asyncio channels take no client interceptor of the sync kind)."""
    sec = security or _current
    creds, opts = _credentials(sec, options)
    ch = grpc.aio.secure_channel(address, creds, options=opts) if creds else \
        grpc.aio.insecure_channel(address, options=opts)
    return ch, ((TOKEN_KEY, f"Bearer {sec.token}"),) if sec.token else ()


class TokenServerInterceptor(grpc.ServerInterceptor):
    """Refuses every call without the swarm token, before its handler runs (but OPEN_METHODS)."""

    def __init__(self, token: str, on_refusal: Callable[[], None] = lambda: None):
        self.expected = f"Bearer {token}".encode()
        self.on_refusal = on_refusal

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in OPEN_METHODS:
            return continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else bytes(sent), self.expected):
            return continuation(handler_call_details)
        self.on_refusal()
        handler = continuation(handler_call_details)
        if handler is None:
            return None

        def deny(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong swarm token")

        def deny_stream(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong swarm token")
            yield  # pragma: no cover - abort raises

        kind = (handler.request_streaming, handler.response_streaming)
        make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
        fn = deny_stream if handler.response_streaming else deny
        return make[kind](fn, request_deserializer=handler.request_deserializer,
                          response_serializer=handler.response_serializer)


def interceptors(security: Security | None = None, on_refusal: Callable[[], None] = lambda: None) -> list:
    sec = security or _current
    return [TokenServerInterceptor(sec.token, on_refusal)] if sec.token else []


def bind(server: grpc.Server, address: str, security: Security | None = None) -> int:
    """Listen on `address` (TLS when configured); returns the port, raising ConfigError when it cannot."""
    sec = security or _current
    try:
        if sec.cert is not None:
            creds = grpc.ssl_server_credentials([(_read(sec.key, "TLS key"), _read(sec.cert, "TLS certificate"))],
                                                root_certificates=_read(sec.ca, "CA certificate"),
                                                require_client_auth=sec.client_auth)
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise ConfigError(f"cannot listen on {address}: the address is in use or not local")
    return port


def speaks_tls(address: str, timeout_s: float = 3.0) -> bool:
    """Whether the server at `address` answers a TLS handshake (certificates not checked): tells a
    node that dials a swarm with identities (mutual TLS, the default) without one why it gets no
    answer, instead of retrying as if the server were down."""
    import socket
    import ssl

    host, _, port = address.rpartition(":")
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as raw, \
                ctx.wrap_socket(raw, server_hostname=host.strip("[]") or None) as tls:
            tls.recv(1)  # under TLS 1.3 a missing client certificate is refused after the handshake
        return True
    except ssl.SSLError as exc:
        return "ALERT" in (exc.reason or "")  # the server spoke TLS, and refused us
    except (OSError, ValueError):
        return False


def identity_hint(address: str) -> str:
    """Why a node without TLS settings gets no answer from `address`, if that is the reason ("" if not)."""
    if current().tls or not speaks_tls(address):
        return ""
    return (f"{address} speaks TLS: its swarm admits identities (the default), and this node has none. Enroll it "
            f"once with the join code from the swarm's operator (`btnode --join-code CODE join ...`; the operator "
            f"mints it with `btnode codes mint`)")
