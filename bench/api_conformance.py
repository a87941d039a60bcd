"""OpenAI request cases against a running `btnode api` or `btnode serve` (bench/api.py's `conformance`):
each case sends one request and judges the answer by what OpenAI's API reference says a request like
it gets (status, object shape, ids, finish reasons, the error object), or, where a byte-level chain
cannot serve a value, by a 400 error object. `failed` counts the cases that do not behave so. Also
`proxy_rss_mb`: the resident memory of a `btnode api` process (the light proxy: no torch)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Check = Callable[[dict, "Server"], bool]


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: Any = None  # a dict (sent as JSON), bytes (sent raw) or None (no body)
    status: int = 200
    check: Check | None = None  # beyond the status: what the reply must hold


@dataclass
class Server:
    host: str
    port: int
    key: str = ""
    model: str = ""
    context: int = 0

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any, str]:
        """(status, the JSON reply or the list of SSE events, content type)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        raw = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
        try:
            conn.request(method, path, body=raw, headers=headers)
            r = conn.getresponse()
            data, kind = r.read(), r.getheader("content-type", "")
        finally:
            conn.close()
        if kind.startswith("text/event-stream"):
            events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
            return r.status, [e if e == "[DONE]" else json.loads(e) for e in events], kind
        try:
            return r.status, json.loads(data), kind
        except ValueError:
            return r.status, data.decode(errors="replace"), kind


def _error_object(reply: Any) -> bool:
    return isinstance(reply, dict) and isinstance(reply.get("error"), dict) and \
        set(reply["error"]) == {"message", "type", "param", "code"} and bool(reply["error"]["message"])


def _text(r: dict) -> str:
    c = r["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def _completion(r: dict, s: Server) -> bool:
    c = r["choices"][0]
    return r["object"] == "text_completion" and r["id"].startswith("cmpl-") and r["model"] == s.model and \
        c["finish_reason"] in ("stop", "length") and isinstance(c["text"], str) and \
        r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]


def _chat(r: dict, s: Server) -> bool:
    c = r["choices"][0]
    return r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-") and r["model"] == s.model and \
        c["message"]["role"] == "assistant" and c["finish_reason"] in ("stop", "length")


def _stream(chat: bool) -> Check:
    def check(events: Any, s: Server) -> bool:
        if not isinstance(events, list) or events[-1] != "[DONE]":
            return False
        chunks = events[:-1]
        obj, prefix = ("chat.completion.chunk", "chatcmpl-") if chat else ("text_completion", "cmpl-")
        ids = {c["id"] for c in chunks}
        ok = all(c["object"] == obj for c in chunks) and len(ids) == 1 and ids.pop().startswith(prefix)
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        if chat:
            ok = ok and chunks[0]["choices"][0]["delta"].get("role") == "assistant"
        return ok and finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    return check


def _usage_chunk(events: Any, s: Server) -> bool:
    return _stream(False)(events, s) and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] > 0


def _all(*checks: Check) -> Check:
    return lambda r, s: all(c(r, s) for c in checks)


def _bytes(n: int) -> Check:
    return lambda r, s: r["usage"]["completion_tokens"] == n or r["choices"][0]["finish_reason"] == "stop"


def _to_context_end(r: dict, s: Server) -> bool:
    """Chat without max_tokens: up to the context's end ("length"), unless a stop came first."""
    u, finish = r["usage"], r["choices"][0]["finish_reason"]
    return finish == "stop" or (finish == "length" and u["prompt_tokens"] + u["completion_tokens"] == s.context)


def _error(code: str | None = None) -> Check:
    return lambda r, s: code is None or r["error"]["code"] == code


def _seeded_twice(r: dict, s: Server) -> bool:
    """A given seed is reproducible."""
    again = s.call("POST", "/v1/completions", {"prompt": "The", "max_tokens": 12, "temperature": 1, "seed": 7})[1]
    return _text(r) == _text(again) and r["btnode"]["seed"] == 7


def _fresh_seeds(r: dict, s: Server) -> bool:
    """No seed: a fresh one per request, reported; sent back, it gives the same text."""
    body = {"prompt": "The", "max_tokens": 12, "temperature": 1}
    other = s.call("POST", "/v1/completions", body)[1]
    again = s.call("POST", "/v1/completions", {**body, "seed": r["btnode"]["seed"]})[1]
    return r["btnode"]["seed"] != other["btnode"]["seed"] and r["btnode"]["seed_drawn"] and \
        _text(again) == _text(r)


def _model_list(r: dict, s: Server) -> bool:
    return r["object"] == "list" and [m["id"] for m in r["data"]] == [s.model] and r["data"][0]["object"] == "model"


def _model_card(r: dict, s: Server) -> bool:
    return r["object"] == "model" and r["id"] == s.model and isinstance(r.get("prompt_bytes"), dict)


P = {"prompt": "The history of", "max_tokens": 8}
M = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
CASES = [
    Case("completion", "POST", "/v1/completions", P, check=_completion),
    Case("completion: prompt as a list of one string", "POST", "/v1/completions", {**P, "prompt": ["The"]},
         check=_completion),
    Case("completion: empty prompt", "POST", "/v1/completions", {**P, "prompt": ""}, check=_completion),
    Case("completion: no max_tokens is 16", "POST", "/v1/completions", {"prompt": "The"}, check=_bytes(16)),
    Case("completion: max_tokens null", "POST", "/v1/completions", {**P, "max_tokens": None}, check=_bytes(16)),
    Case("completion: logprobs null", "POST", "/v1/completions", {**P, "logprobs": None}, check=_completion),
    Case("completion: echo false", "POST", "/v1/completions", {**P, "echo": False}, check=_completion),
    Case("completion: best_of 1", "POST", "/v1/completions", {**P, "best_of": 1}, check=_completion),
    Case("completion: suffix null", "POST", "/v1/completions", {**P, "suffix": None}, check=_completion),
    Case("completion: top_p 1", "POST", "/v1/completions", {**P, "top_p": 1}, check=_completion),
    Case("completion: penalties 0", "POST", "/v1/completions", {**P, "frequency_penalty": 0, "presence_penalty": 0.0},
         check=_completion),
    Case("completion: logit_bias {}", "POST", "/v1/completions", {**P, "logit_bias": {}}, check=_completion),
    Case("completion: user", "POST", "/v1/completions", {**P, "user": "u-1"}, check=_completion),
    Case("completion: n 1", "POST", "/v1/completions", {**P, "n": 1}, check=_completion),
    Case("completion: stop list", "POST", "/v1/completions", {**P, "stop": ["\n\n", "."]}, check=_completion),
    Case("completion: stream", "POST", "/v1/completions", {**P, "stream": True}, check=_stream(False)),
    Case("completion: stream with usage", "POST", "/v1/completions",
         {**P, "stream": True, "stream_options": {"include_usage": True}}, check=_usage_chunk),
    Case("completion: a given seed is reproducible", "POST", "/v1/completions",
         {"prompt": "The", "max_tokens": 12, "temperature": 1, "seed": 7}, check=_seeded_twice),
    Case("completion: no seed draws a fresh one, reported", "POST", "/v1/completions",
         {"prompt": "The", "max_tokens": 12, "temperature": 1}, check=_fresh_seeds),
    Case("completion: model named", "POST", "/v1/completions", None, check=_completion),  # body set in run()
    Case("completion: no prompt", "POST", "/v1/completions", {"max_tokens": 8}, 400),
    Case("completion: prompt null", "POST", "/v1/completions", {"prompt": None}, 400),
    Case("completion: top_p 0.5 (unsupported)", "POST", "/v1/completions", {**P, "top_p": 0.5}, 400),
    Case("completion: logprobs 2 (unsupported)", "POST", "/v1/completions", {**P, "logprobs": 2}, 400),
    Case("completion: n 2 (unsupported)", "POST", "/v1/completions", {**P, "n": 2}, 400),
    Case("completion: max_tokens 0", "POST", "/v1/completions", {**P, "max_tokens": 0}, 400),
    Case("completion: temperature 3", "POST", "/v1/completions", {**P, "temperature": 3}, 400),
    Case("completion: unknown field", "POST", "/v1/completions", {**P, "frobnicate": 1}, 400),
    Case("completion: body not JSON", "POST", "/v1/completions", b"{nope", 400),
    Case("completion: body an array", "POST", "/v1/completions", b"[1]", 400),
    Case("completion: another model", "POST", "/v1/completions", {**P, "model": "gpt-4o"}, 404,
         _error("model_not_found")),
    Case("completion: body over the limit", "POST", "/v1/completions", {"prompt": "x" * (2 << 20)}, 413),
    Case("chat", "POST", "/v1/chat/completions", M, check=_chat),
    Case("chat: no max_tokens runs to the context's end", "POST", "/v1/chat/completions",
         {"messages": M["messages"], "stop": "\u0000\u0001"}, check=_all(_chat, _to_context_end)),
    Case("chat: max_completion_tokens", "POST", "/v1/chat/completions",
         {"messages": M["messages"], "max_completion_tokens": 5}, check=_all(_chat, _bytes(5))),
    Case("chat: logprobs false", "POST", "/v1/chat/completions", {**M, "logprobs": False}, check=_chat),
    Case("chat: top_logprobs 0", "POST", "/v1/chat/completions", {**M, "top_logprobs": 0}, check=_chat),
    Case("chat: response_format text", "POST", "/v1/chat/completions", {**M, "response_format": {"type": "text"}},
         check=_chat),
    Case("chat: parallel_tool_calls false", "POST", "/v1/chat/completions", {**M, "parallel_tool_calls": False},
         check=_chat),
    Case("chat: tools [] and tool_choice none", "POST", "/v1/chat/completions",
         {**M, "tools": [], "tool_choice": "none"}, check=_chat),
    Case("chat: modalities text", "POST", "/v1/chat/completions", {**M, "modalities": ["text"]}, check=_chat),
    Case("chat: store, metadata, service_tier", "POST", "/v1/chat/completions",
         {**M, "store": False, "metadata": {}, "service_tier": "auto"}, check=_chat),
    Case("chat: system and developer messages, content parts", "POST", "/v1/chat/completions",
         {**M, "messages": [{"role": "system", "content": "Be."}, {"role": "developer", "content": "Brief."},
                            {"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "k": 1}, check=_chat),
    Case("chat: stream", "POST", "/v1/chat/completions", {**M, "stream": True}, check=_stream(True)),
    Case("chat: stream_options include_obfuscation false", "POST", "/v1/chat/completions",
         {**M, "stream": True, "stream_options": {"include_usage": False, "include_obfuscation": False}},
         check=_stream(True)),
    Case("chat: response_format json_object (unsupported)", "POST", "/v1/chat/completions",
         {**M, "response_format": {"type": "json_object"}}, 400),
    Case("chat: a tool (unsupported)", "POST", "/v1/chat/completions",
         {**M, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, 400),
    Case("chat: no messages", "POST", "/v1/chat/completions", {"max_tokens": 8}, 400),
    Case("chat: messages empty", "POST", "/v1/chat/completions", {"messages": []}, 400),
    Case("chat: role tool", "POST", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400),
    Case("models", "GET", "/v1/models", check=_model_list),
    Case("models: retrieve the one served", "GET", "/v1/models/{model}", check=_model_card),
    Case("models: retrieve another", "GET", "/v1/models/gpt-4o", status=404, check=_error("model_not_found")),
    Case("unknown route", "GET", "/v1/nope", status=404),
    Case("unknown route, POST", "POST", "/v1/embeddings", {"input": "x"}, 404),
    Case("wrong method on completions", "GET", "/v1/completions", status=405),
    Case("wrong method on models", "DELETE", "/v1/models", status=405),
]


def conformance(host: str, port: int, key: str = "") -> dict[str, Any]:
    """Every case against the server at host:port: {"cases": [{name, request, expected, got, ok}], "failed": N}."""
    s = Server(host, port, key)
    status, models, _ = s.call("GET", "/v1/models")
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered {status}: {models}")
    s.model, s.context = models["data"][0]["id"], models["data"][0]["context"]
    out = []
    for case in CASES:
        body = {**P, "model": s.model} if case.name == "completion: model named" else case.body
        path = case.path.replace("{model}", s.model)
        try:
            status, reply, _ = s.call(case.method, path, body)
            shaped = _error_object(reply) if status >= 400 else status == 200
            ok = status == case.status and shaped and (case.check is None or bool(case.check(reply, s)))
            why = None if ok else (reply if status != case.status else "the reply's shape")
        except (OSError, http.client.HTTPException, KeyError, IndexError, TypeError, ValueError) as exc:
            status, ok, why = 0, False, f"{type(exc).__name__}: {exc}"
        shown = body if not isinstance(body, bytes) else body[:40].decode(errors="replace")
        if isinstance(shown, dict) and len(json.dumps(shown)) > 300:
            shown = {k: (v if len(json.dumps(v)) < 100 else f"<{len(json.dumps(v))} characters>") for k, v in shown.items()}
        out.append({"name": case.name, "request": f"{case.method} {path}", "body": shown, "expected": case.status,
                    "got": status, "ok": ok, **({"why": str(why)[:300]} if not ok else {})})
    return {"model": s.model, "cases": out, "failed": sum(not c["ok"] for c in out)}


def proxy_rss_mb(pid: int) -> tuple[float, bool]:
    """A process's resident memory in MB (VmRSS) and whether torch is mapped into it."""
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith("VmRSS:"))
    torch = "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    return rss_kb / 1024, torch
