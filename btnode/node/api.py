"""`btnode api`: an OpenAI-compatible HTTP server (Starlette on uvicorn) in front of a served chain.
Requests become the shared `GenerationRequest` (serve/completions.py), go to the chain's entry over
gRPC (rpc/entry.py) and come back as one JSON reply or as server-sent events, one per segment. Also
serves a page to try the model at `/` and the HTTP layer's Prometheus metrics at `/metrics`. Free of
torch, so that a proxy in front of a remote chain stays light; `btnode serve` (node/serving.py) runs
it in the process that holds the chain."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from btnode.durable import atomic_write
from btnode.errors import BtnodeError, ConfigError, InputError, Overloaded, PeerUnavailable, StageTimeout
from btnode.model.readout import Readout
from btnode.meter import Meter
from btnode.node.api_metrics import ApiCollector
from btnode.rpc.entry import ChainInfo, EntryClient, Segment
from btnode.serve.defaults import describe_settings, serving_defaults
from btnode.serve.identity import ModelIdentity
from btnode.serve.completions import (Completion, ReplyShape, StopCutter, chat_budget, parse_chat, parse_completion,
                                      usage)
from btnode.settings import flag

log = logging.getLogger(__name__)
PAGE = Path(__file__).with_name("api_page.html")


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


@dataclass(frozen=True)
class ApiConfig:
    """The HTTP server in front of a chain (local: every API server may differ)."""

    entries: tuple[str, ...] = flag("--entry", "HOST:PORT of the chain's first stage; a comma-separated list adds "
                                               "spare entries, tried in order.", default=(), param="entry",
                                    value=str, parse=_addresses, format=lambda e: ",".join(e) or None)
    listen: str = flag("--listen", "HOST:PORT the HTTP server listens on (port 0 picks one).",
                       default="127.0.0.1:8000")
    api_key: str = flag("--api-key", "Clients must send `Authorization: Bearer KEY` (empty: no key).",
                       default="")
    max_concurrent: int = flag("--max-concurrent", "Generation requests served at once; more are answered 429.",
                               default=32, min=1)
    segment_timeout_s: float = flag("--segment-timeout", "Seconds to wait for the chain's next segment before "
                                                         "answering 504.", default=60.0, min=0.01)
    max_body_bytes: int = flag("--max-body-bytes", "Largest request body accepted (413 above).", default=1 << 20,
                               min=1)
    port_file: Path | None = flag("--port-file", "Write the bound port here once listening.", default=None)
    model_name: str = flag("--model-name", "The model's name, first in its id NAME-vVERSION-HASH8 (default: the "
                                           "checkpoint folder's name, as the chain's entry reports it; else btnode-KIND).",
                           default="")


def error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
          param: str | None = None) -> JSONResponse:
    """OpenAI's error shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


_KINDS = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "requests", 500: "api_error",
          503: "service_unavailable", 504: "timeout"}


def error_for(exc: BtnodeError) -> JSONResponse:
    """A domain error as the HTTP status a client can act on."""
    if isinstance(exc, StageTimeout):
        return error(504, str(exc), "timeout", "stage_timeout")
    if isinstance(exc, Overloaded):  # the chain's own concurrency limits
        return error(429, str(exc), "requests", "chain_overloaded")
    if isinstance(exc, PeerUnavailable):
        return error(503, str(exc), "service_unavailable", "no_route")
    if isinstance(exc, InputError):
        return error(400, str(exc))
    return error(502, f"the chain failed the request: {exc}", "api_error", type(exc).__name__)


class ApiServer:
    """The app and what it keeps between requests: the entry client, the chain's info once read,
    the in-flight count (the concurrency limit) and the meter the metrics read."""

    def __init__(self, config: ApiConfig, identity: ModelIdentity | None = None):
        if not config.entries:
            raise ConfigError("give --entry HOST:PORT (the chain's first stage; spares after commas)")
        self.config = config
        self.given = identity  # `btnode serve` knows its weights; a proxy learns them from the entry's Info
        self.client = EntryClient(config.entries, segment_timeout_s=config.segment_timeout_s)
        self.chain: ChainInfo | None = None
        self.in_flight = 0
        self.meter = Meter()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(ApiCollector(self.meter, lambda: self.in_flight, self.served))
        routes = [Route("/", self.page), Route("/health", self.health), Route("/metrics", self.metrics),
                  Route("/v1/models", self.models), Route("/v1/models/{model:path}", self.model),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]
        # every error an OpenAI error object, unknown routes and wrong methods included
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _internal})
        self.app.add_middleware(_Counted, server=self)

    # what the chain serves

    async def info(self) -> ChainInfo:
        if self.chain is None:
            self.chain = await self.client.info()
            i = self.identity
            version = f"version {i.version}, weights sha256 {i.weights_sha256}" if i else \
                "its weights not known: a stage on the chain runs an older build, or did not answer"
            log.info("serving the %s chain at %s: model %s (%s)", self.chain.kind, self.chain.entry, self.model_id,
                     version)
        return self.chain

    @property
    def identity(self) -> ModelIdentity | None:
        """Which weights are served: given (`btnode serve`), else as the chain's entry reports them."""
        if self.given is not None:
            return self.given
        if self.chain is None or self.chain.weights is None:
            return None
        return ModelIdentity.of(self.chain.weights, self.config.model_name, f"btnode-{self.chain.kind}")

    @property
    def model_id(self) -> str:
        if (i := self.identity) is not None:
            return i.id
        assert self.chain is not None  # an older chain: its shape's fingerprint, as before weights had ids
        return f"{self.config.model_name or f'btnode-{self.chain.kind}'}-{self.chain.fingerprint[:12]}"

    def served(self) -> dict[str, str] | None:
        """The model's labels for btnode_api_model_info, once the chain has been read."""
        if self.chain is None:
            return None
        i = self.identity
        return {"model": self.model_id, "version": str(i.version) if i else "",
                "weights_sha256": i.weights_sha256 if i else ""}

    def model_card(self) -> dict[str, Any]:
        c = self.chain
        assert c is not None
        i = self.identity
        card: dict[str, Any] = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "btnode",
                                "kind": c.kind, "context": c.cfg.context, "byte_level": True,
                                "version": i.version if i else None, "weights_sha256": i.weights_sha256 if i else None}
        if c.kind == "ar":
            card.update(readout=None, k=1, layers=c.cfg.ar_layers, prompt_bytes={"1": c.cfg.context})
        else:
            # the prompt a segment of K may see: N − K + 1 bytes (serve/stages.max_prompt); drafting readouts
            # (spec, spec-fill) take any K in 1 … N/2 with the same budget
            d = c.defaults or serving_defaults(c.cfg)
            card.update(readout=d.readout.value, k=d.k, segments=list(c.cfg.segments),
                        readouts=[r.value for r in Readout], blocks=c.cfg.n_blocks,
                        prompt_bytes={str(k): c.cfg.context - k + 1 for k in sorted({*c.cfg.segments, d.k})},
                        settings=describe_settings(c.cfg, d))
        return card

    # routes

    async def page(self, request: Request) -> Response:
        return HTMLResponse(PAGE.read_text())

    async def health(self, request: Request) -> Response:
        try:
            self.chain = await EntryClient(self.config.entries, info_timeout_s=5.0).info()
        except BtnodeError as exc:
            return error_for(exc)
        return JSONResponse({"status": "ok", "model": self.model_id, "entry": self.chain.entry,
                             "in_flight": self.in_flight})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def _card_refused(self, request: Request) -> Response | None:
        """Why the model card cannot be given (a wrong key, an entry that does not answer), else None."""
        if (denied := self.check_key(request)) is not None:
            return denied
        try:
            await self.info()
        except BtnodeError as exc:
            return error_for(exc)
        return None

    async def models(self, request: Request) -> Response:
        if (refused := await self._card_refused(request)) is not None:
            return refused
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the card of the model served, 404 for any other id."""
        if (refused := await self._card_refused(request)) is not None:
            return refused
        wanted = request.path_params["model"]
        if wanted != self.model_id:
            return self.no_such_model(wanted)
        return JSONResponse(self.model_card())

    def no_such_model(self, name: str) -> JSONResponse:
        return error(404, f"The model {name!r} does not exist; this server serves {self.model_id!r} (GET /v1/models)",
                     code="model_not_found", param="model")

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, parse_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, parse_chat)

    # one generation request

    def check_key(self, request: Request) -> Response | None:
        if not self.config.api_key:
            return None
        sent = request.headers.get("authorization", "")
        if hmac.compare_digest(sent.encode(), f"Bearer {self.config.api_key}".encode()):
            return None
        return error(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    async def body(self, request: Request) -> Any:
        """The JSON body, read up to max_body_bytes: InputError, or TooLargeBody."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise TooLargeBody(int(declared), limit)
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise TooLargeBody(len(raw), limit)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(f"the request body is not valid JSON: {exc}") from None

    async def generate(self, request: Request, parse: Callable[[Any], Completion]) -> Response:
        if (denied := self.check_key(request)) is not None:
            return denied
        try:
            completion = parse(await self.body(request))
        except TooLargeBody as exc:
            return error(413, str(exc), code="request_too_large")
        except InputError as exc:
            return error(400, str(exc))
        if self.in_flight >= self.config.max_concurrent:
            return error(429, f"{self.in_flight} requests in flight, the limit is {self.config.max_concurrent}; "
                              "retry later", "requests", "rate_limit_exceeded")
        self.in_flight += 1
        release = True
        try:
            chain = await self.info()
            if completion.model not in (None, self.model_id):
                return self.no_such_model(completion.model)  # type: ignore[arg-type]
            if completion.chat and not completion.max_given:  # OpenAI: up to the context's end
                completion = dataclasses.replace(completion, request=dataclasses.replace(
                    completion.request, n_bytes=chat_budget(chain.cfg.context, len(completion.request.prompt))))
            req = completion.request  # checked by the entry (GenerationRequest.checked needs torch): 400 all the same
            shape = ReplyShape(model=self.model_id, chat=completion.chat,
                               system_fingerprint=self.identity.fingerprint if self.identity else None)
            t0 = time.perf_counter()
            segments = self.client.stream(req)
            try:
                first = await anext(segments, None)  # errors before the first byte get their status code
            except BaseException:
                await segments.aclose()
                raise
            self.meter.observe("ttfb", time.perf_counter() - t0)
            if completion.stream:
                release = False  # the stream releases its slot when it ends
                return _Stream(self.events(completion, shape, first, segments), segments, self.release)
            return await self.whole(request, completion, shape, first, segments)
        except BtnodeError as exc:
            return error_for(exc)
        finally:
            if release:
                self.release()

    def release(self) -> None:
        self.in_flight -= 1

    def about(self, completion: Completion) -> dict[str, Any]:
        """What a reply says of how it was made: the seed (drawn when none was sent: send it back to
        get the same text) and the served version."""
        return {"seed": completion.request.seed, "seed_drawn": not completion.seed_given,
                "version": self.identity.version if self.identity else None}

    async def whole(self, request: Request, completion: Completion, shape: ReplyShape, first: Segment | None,
                    segments: AsyncIterator[Segment]) -> Response:
        cutter = StopCutter(completion.stops)
        text, last = [], first
        async with aclosing(segments):
            seg = first
            while seg is not None:
                last = seg
                text.append(cutter.feed(seg.new_bytes))
                if cutter.stopped or await request.is_disconnected():
                    break
                seg = await anext(segments, None)
        text.append(cutter.finish())
        extra = {"traversals": last.traversals if last else 0, "route": last.route if last else [],
                 **self.about(completion)}
        return JSONResponse(shape.reply("".join(text), "stop" if cutter.stopped else "length",
                                        usage(completion.request.prompt, cutter.released), extra))

    async def events(self, completion: Completion, shape: ReplyShape, first: Segment | None,
                     segments: AsyncIterator[Segment]) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per segment, a last chunk with the finish reason, the usage
        when asked for, then [DONE]. A client that goes away cancels this generator, which closes
        the entry stream and so cancels the request down the chain."""
        cutter = StopCutter(completion.stops)
        try:
            async with aclosing(segments):
                if completion.chat:
                    yield _sse(shape.chunk("", None, role=True))
                seg = first
                try:
                    while seg is not None:
                        text = cutter.feed(seg.new_bytes)
                        yield _sse(shape.chunk(text, None, {"traversals": seg.traversals, "bytes": cutter.released,
                                                            **self.about(completion)}))
                        if cutter.stopped:
                            break
                        seg = await anext(segments, None)
                except BtnodeError as exc:  # after the headers: the error as an event, as OpenAI sends it
                    body = json.loads(error_for(exc).body)
                    self.meter.count(("stream_error", type(exc).__name__))
                    yield _sse(body)
                    return
            rest = cutter.finish()
            if rest:
                yield _sse(shape.chunk(rest, None))
            yield _sse(shape.chunk(None if completion.chat else "", "stop" if cutter.stopped else "length"))
            if completion.include_usage:
                yield _sse(shape.usage_chunk(usage(completion.request.prompt, cutter.released)))
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.meter.count(("cancelled",))
            raise


class _Stream(StreamingResponse):
    """The event stream of one request. However it ends (done, failed, its client gone before the
    first event was sent), the entry stream is closed, cancelling the call, and the slot released."""

    def __init__(self, events: AsyncIterator[bytes], segments: AsyncIterator[Segment], release: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.segments = segments
        self.release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.segments.aclose()  # type: ignore[attr-defined]
            finally:
                self.release()


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own answers (no such route, a wrong method) as OpenAI error objects."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path}): no such route"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    headers = dict(exc.headers or {})
    reply = error(exc.status_code, message, _KINDS.get(exc.status_code, "invalid_request_error"),
                  code={404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code))
    reply.headers.update(headers)  # 405's Allow
    return reply


async def _internal(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s %s", request.method, request.url.path)
    return error(500, f"internal error: {type(exc).__name__}", "api_error", "internal_error")


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class TooLargeBody(Exception):
    def __init__(self, size: int, limit: int):
        super().__init__(f"the request body is {size} bytes or more; at most {limit} are accepted")


class _Counted:
    """ASGI middleware: every HTTP answer counted by route and status code."""

    def __init__(self, app: Any, server: ApiServer):
        self.app = app
        self.server = server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ("/", "/health", "/metrics", "/v1/models", "/v1/completions",
                                 "/v1/chat/completions") else "/v1/models/{id}" if path.startswith("/v1/models/") \
            else "other"

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.server.meter.count(("http", route, str(message["status"])))
            await send(message)

        await self.app(scope, receive, counted)


def run_api(config: ApiConfig, identity: ModelIdentity | None = None,
            on_listening: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn handles both, finishing the requests in flight).
    `on_listening` gets the base URL once the socket is bound (`btnode serve` prints its curl line)."""
    import uvicorn

    server = ApiServer(config, identity)
    host, _, port = config.listen.rpartition(":")
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]") or "0.0.0.0", int(port)))
        sock.listen(1024)  # connections wait in the backlog until uvicorn accepts them
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot listen on {config.listen!r}: {exc}") from None
    bound = sock.getsockname()[1]
    if config.port_file is not None:
        atomic_write(config.port_file, f"{bound}\n".encode())
    log.info("OpenAI-compatible API on http://%s:%d/v1 (entries %s)", host or "0.0.0.0", bound,
             ",".join(config.entries))
    if on_listening is not None:
        on_listening(f"http://{host if host not in ('', '0.0.0.0', '[::]') else '127.0.0.1'}:{bound}")
    uv = uvicorn.Server(uvicorn.Config(server.app, loop="asyncio", log_level="warning", access_log=False,
                                       timeout_graceful_shutdown=5))
    uv.run(sockets=[sock])
