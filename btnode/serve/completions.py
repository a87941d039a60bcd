"""The OpenAI completions vocabulary over a byte-level chain, as plain values: a request body →
`GenerationRequest` (`parse_completion`, `parse_chat`), the chat template, stop sequences cut
from the byte stream (`StopCutter`), and the reply and stream-chunk shapes. No HTTP here
(node/api.py serves these); every refusal is an InputError, which the server answers with 400."""

from __future__ import annotations

import codecs
import json
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from btnode.errors import InputError
from btnode.model.readout import Readout
from btnode.serve.request import GenerationRequest

MAX_BYTES = 4096  # max_tokens ceiling per request: a request's bytes, not a BPE token count
MAX_STOPS = 4  # as OpenAI
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default; chat without max_tokens runs to the context's end
MAX_SEED = 2**63 - 1
DRAWN_SEEDS = 2**53  # a drawn seed below 2^53: every JSON client (the page's JavaScript too) can send it back exactly
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (btnode generate's is 0: greedy)
CHAT_STOP = "\nUser:"  # chat requests without `stop` end where the model starts the next user turn

# fields the OpenAI clients send that a byte chain serves only at a neutral value: the values OpenAI
# documents as meaning "nothing" (their defaults, an empty list or map, "none"/"auto" without tools)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (1,), "frequency_penalty": (0,), "presence_penalty": (0,), "best_of": (1,), "echo": (False,),
    "logprobs": (False,), "top_logprobs": (0,), "logit_bias": ({},), "suffix": ("",),
    "parallel_tool_calls": (True, False), "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],),
    "function_call": ("none", "auto"), "response_format": ({"type": "text"},), "modalities": (["text"],),
    "audio": (), "prediction": (), "web_search_options": (), "reasoning_effort": ()}
_IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")  # no effect on the bytes
# btnode's own settings, beside OpenAI's (extra_body in the openai client): the request type's fields
_EXTENSIONS = ("readout", "k", "steps", "tail_steps", "draft_len")
_COMMON = ("model", "max_tokens", "temperature", "seed", "stop", "n", "stream", "stream_options", *_EXTENSIONS,
           *_NEUTRAL, *_IGNORED)
COMPLETION_FIELDS = frozenset(("prompt", *_COMMON))
CHAT_FIELDS = frozenset(("messages", "max_completion_tokens", *_COMMON))


def _same(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, 1.0 is 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


@dataclass(frozen=True)
class Completion:
    """One parsed HTTP request: what to generate, and what the reply needs besides."""

    request: GenerationRequest
    stops: tuple[bytes, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    chat: bool = False
    model: str | None = None
    max_given: bool = True  # False: no max_tokens was sent (chat then runs to the context's end: node/api.py)
    seed_given: bool = True  # False: the seed was drawn for this request (the reply says which)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputError(f"{name} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise InputError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _object(body: Any) -> None:
    if not isinstance(body, dict):
        raise InputError("the request body must be a JSON object")


def _common(body: Any, allowed: frozenset[str], prompt: bytes, *, max_name: str = "max_tokens",
            default_stop: str | None = None, chat: bool = False) -> Completion:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InputError(f"unrecognized request argument(s): {', '.join(unknown)}")
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in neutral):
            only = " or ".join(json.dumps(v) for v in (None, *neutral))
            raise InputError(f"{name}={value!r} is not supported by a byte-level chain (only {only})")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InputError(f"model must be a string, got {model!r}")
    n_bytes = _int(body, max_name, None, 1, MAX_BYTES)
    if n_bytes is None:
        n_bytes = _int(body, "max_tokens", None, 1, MAX_BYTES)
    max_given = n_bytes is not None
    n_bytes = n_bytes or DEFAULT_MAX_TOKENS
    temperature = body.get("temperature", DEFAULT_TEMPERATURE)
    if temperature is None:
        temperature = DEFAULT_TEMPERATURE
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or not 0 <= temperature <= 2:
        raise InputError(f"temperature must be a number in [0, 2], got {temperature!r}")
    if _int(body, "n", 1, 1, 1) != 1:  # pragma: no cover - _int refuses it
        raise InputError("n must be 1")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InputError(f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"} \
            or any(not isinstance(v, bool) for v in options.values()):
        raise InputError(f"stream_options takes include_usage (and include_obfuscation, ignored), got {options!r}")
    stop = body.get("stop", default_stop)
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or any(not isinstance(s, str) or not s for s in stops):
        raise InputError(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them, got {stop!r}")
    readout = body.get("readout")
    if readout is not None and not isinstance(readout, str):
        raise InputError(f"readout must be a string, got {readout!r}")
    seed = _int(body, "seed", None, 0, MAX_SEED)
    seed_given = seed is not None
    if seed is None:  # OpenAI: no seed, no reproducibility: each request its own draw
        seed = secrets.randbelow(DRAWN_SEEDS)
    request = GenerationRequest(prompt, n_bytes, seed=seed,
                                temperature=float(temperature), k=_int(body, "k", None, 1, 4096),
                                n_steps=_int(body, "steps", None, 1, 4096),
                                readout=Readout.parse(readout) if readout else None,
                                n_tail=_int(body, "tail_steps", 0, 0, 4096) or 0,
                                draft_len=_int(body, "draft_len", 0, 0, 4096) or 0)
    return Completion(request=request, stops=tuple(s.encode() for s in stops), stream=stream,
                      include_usage=bool(options.get("include_usage")), chat=chat, model=model, max_given=max_given,
                      seed_given=seed_given)


def parse_completion(body: Any) -> Completion:
    """POST /v1/completions. `prompt` is a string (or a list of one string: n = 1); required, as OpenAI
    requires it (an empty string is a prompt: the text starts after a newline)."""
    _object(body)
    if "prompt" not in body or body["prompt"] is None:
        raise InputError("prompt is required (a string; \"\" starts the text after a newline)")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InputError(f"prompt must be a string (or a list of one string), got {type(prompt).__name__}")
    return _common(body, COMPLETION_FIELDS, prompt.encode())


def render_chat(messages: Any) -> str:
    """The chat template (docs/serving.md): a system message as its own paragraph, then one line per
    turn, "User: …" or "Assistant: …", ending with "Assistant:" for the model to continue. The model
    is a byte-level LM trained on plain text, not a chat model: this only frames the prompt."""
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InputError(f"each message needs a role and a content, got {m!r}")
        role, content = m["role"], m.get("content")
        if isinstance(content, list):  # content parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in content):
                raise InputError("a byte-level model reads text content parts only")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InputError(f"message content must be a string, got {type(content).__name__}")
        if role in ("system", "developer"):
            out.append(f"{content}\n\n")
        elif role == "user":
            out.append(f"User: {content}\n")
        elif role == "assistant":
            out.append(f"Assistant: {content}\n")
        else:
            raise InputError(f"message role must be system, developer, user or assistant, got {role!r}")
    return "".join(out) + "Assistant:"


def parse_chat(body: Any) -> Completion:
    """POST /v1/chat/completions: the messages rendered by `render_chat`; `max_completion_tokens`
    is read as max_tokens; without `stop` the reply ends at the next "\\nUser:"."""
    _object(body)
    if "messages" not in body or body["messages"] is None:
        raise InputError("messages is required (a non-empty list of {role, content})")
    messages = body.get("messages")
    return _common(body, CHAT_FIELDS, render_chat(messages).encode(), max_name="max_completion_tokens",
                   default_stop=CHAT_STOP, chat=True)


class StopCutter:
    """Cuts the byte stream at the first stop sequence and decodes it as UTF-8 (a character split
    across two segments comes out whole with the second; invalid bytes become U+FFFD). Bytes that
    may begin a stop sequence are held back until the next segment says whether they do."""

    def __init__(self, stops: tuple[bytes, ...]):
        self.stops = stops
        self.pending = b""  # generated, not yet released
        self.released = 0  # bytes released to the client
        self.stopped = False
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, new: bytes) -> str:
        """The text a segment's bytes release; after a stop sequence, nothing more."""
        if self.stopped:
            return ""
        self.pending += new
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(cut, final=True)
        hold = max((n for s in self.stops for n in range(len(s) - 1, 0, -1) if self.pending.endswith(s[:n])),
                   default=0)
        return self._release(len(self.pending) - hold, final=False)

    def finish(self) -> str:
        """The rest, at the end of the stream (held-back bytes that began no stop sequence)."""
        return "" if self.stopped else self._release(len(self.pending), final=True)

    def _release(self, n: int, final: bool) -> str:
        out, self.pending = self.pending[:n], self.pending[n:]
        self.released += len(out)
        return self.decoder.decode(out, final=final)


@dataclass
class ReplyShape:
    """The JSON of replies and stream chunks for one request (OpenAI's shapes, plus a `btnode`
    object: traversals so far and the chain's route)."""

    model: str
    chat: bool
    system_fingerprint: str | None = None  # the served weights' version and hash (OpenAI's field for the backend)
    id: str = ""  # chatcmpl-… for chat, cmpl-… otherwise, as OpenAI's
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint}

    def reply(self, text: str, finish: str, usage: dict[str, int], extra: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage, "btnode": extra}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage, "btnode": extra}

    def chunk(self, text: str | None, finish: str | None, extra: dict[str, Any] | None = None,
              *, role: bool = False) -> dict[str, Any]:
        """One SSE chunk: `text` None makes the final chunk's empty delta."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            out = {**self._head("chat.completion.chunk"),
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        else:
            out = {**self._head("text_completion"),
                   "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}
        if extra is not None:
            out["btnode"] = extra
        return out

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}


def chat_budget(context: int, prompt_bytes: int) -> int:
    """The bytes a chat reply without max_tokens runs to: up to the context's end (N − prompt), at
    least 1 and at most MAX_BYTES; its finish_reason is then "length" unless a stop came first."""
    return max(1, min(MAX_BYTES, context - prompt_bytes))


def usage(prompt: bytes, completion_bytes: int) -> dict[str, int]:
    """Usage counts bytes: a byte-level model's tokens."""
    return {"prompt_tokens": len(prompt), "completion_tokens": completion_bytes,
            "total_tokens": len(prompt) + completion_bytes}
