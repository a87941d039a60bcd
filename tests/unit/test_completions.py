"""The OpenAI vocabulary over a byte chain (serve/completions.py): bodies → the shared request type,
the chat template, stop sequences cut from a stream of segments, and a stage timeout that stays one
as it crosses a failover stage."""

from __future__ import annotations

import pytest

from btnode.errors import InputError, PeerUnavailable, StageTimeout
from btnode.model.readout import Readout
from btnode.serve.completions import (CHAT_STOP, ReplyShape, StopCutter, chat_budget, parse_chat, parse_completion,
                                      render_chat)
from btnode.serve.stages import FailoverStage


def test_a_completion_body_becomes_the_shared_request():
    c = parse_completion({"model": "m", "prompt": ["héllo"], "max_tokens": 40, "temperature": 0.5, "seed": 7,
                          "stop": "\n\n", "stream": True, "stream_options": {"include_usage": True},
                          "readout": "spec", "k": 16, "top_p": 1, "user": "u"})
    r = c.request
    assert (r.prompt, r.n_bytes, r.temperature, r.seed, r.readout, r.k) == ("héllo".encode(), 40, 0.5, 7,
                                                                            Readout.SPEC, 16)
    assert c.stream and c.include_usage and c.stops == (b"\n\n",) and c.model == "m" and not c.chat
    d = parse_completion({"prompt": "x"})  # OpenAI's defaults; no seed: a fresh one each time
    assert (d.request.n_bytes, d.request.temperature, d.request.readout, d.request.k) == (16, 1.0, None, None)
    assert not d.seed_given and not d.max_given and c.seed_given and c.max_given
    seeds = {parse_completion({"prompt": "x"}).request.seed for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**53 for s in seeds)


@pytest.mark.parametrize("field,value", [
    ("logprobs", False), ("logprobs", None), ("top_logprobs", 0), ("logit_bias", {}), ("response_format", {"type": "text"}),
    ("parallel_tool_calls", False), ("parallel_tool_calls", True), ("tools", []), ("tool_choice", "none"),
    ("tool_choice", "auto"), ("modalities", ["text"]), ("top_p", 1.0), ("frequency_penalty", 0), ("suffix", ""),
    ("echo", False), ("best_of", 1), ("stream_options", {"include_obfuscation": False}), ("prompt_cache_key", "k"),
])
def test_openai_neutral_values_are_accepted(field, value):
    parse_chat({"messages": [{"role": "user", "content": "x"}], field: value})


@pytest.mark.parametrize("field,value", [
    ("logprobs", True), ("logprobs", 0), ("top_logprobs", 2), ("logit_bias", {"65": 1}), ("echo", 0),
    ("response_format", {"type": "json_object"}), ("tool_choice", "required"), ("modalities", ["audio"]),
    ("top_p", True), ("audio", {"voice": "x"}), ("reasoning_effort", "low"),
])
def test_values_a_byte_chain_cannot_serve_are_refused(field, value):
    with pytest.raises(InputError, match=field):
        parse_chat({"messages": [{"role": "user", "content": "x"}], field: value})


def test_a_missing_prompt_or_messages_is_refused_and_chat_ids_are_chatcmpl():
    for body in ({}, {"prompt": None}, {"max_tokens": 3}):
        with pytest.raises(InputError, match="prompt is required"):
            parse_completion(body)
    with pytest.raises(InputError, match="messages is required"):
        parse_chat({"max_tokens": 3})
    assert ReplyShape(model="m", chat=True).id.startswith("chatcmpl-")
    assert ReplyShape(model="m", chat=False).id.startswith("cmpl-")
    assert chat_budget(32, 19) == 13 and chat_budget(32, 32) == 1 and chat_budget(1 << 20, 3) == 4096


@pytest.mark.parametrize("body,match", [
    ([], "JSON object"), ({"prompt": 3}, "prompt must be a string"), ({"prompt": ["a", "b"]}, "prompt must be"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens must be in"), ({"prompt": "x", "max_tokens": True}, "integer"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"), ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "n": 3}, "n must be in"), ({"prompt": "x", "stop": ["a"] * 5}, "stop must be"),
    ({"prompt": "x", "stop": [""]}, "stop must be"), ({"prompt": "x", "stream": "yes"}, "stream must be"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"), ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "seed": -1}, "seed must be in"), ({"prompt": "x", "readout": "best"}, "readout must be one of"),
    ({"prompt": "x", "stream_options": {"x": 1}}, "stream_options"), ({"prompt": "x", "messages": []}, "unrecognized"),
])
def test_bad_completion_bodies_are_input_errors(body, match):
    with pytest.raises(InputError, match=match):
        parse_completion(body)


def test_the_chat_template_and_its_default_stop():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}, {"role": "user", "content": "?"}]
    assert render_chat(messages) == "Be brief.\n\nUser: Hi\nAssistant: Hello\nUser: ?\nAssistant:"
    c = parse_chat({"messages": messages, "max_completion_tokens": 9})
    assert c.chat and c.request.n_bytes == 9 and c.stops == (CHAT_STOP.encode(),)
    assert parse_chat({"messages": messages, "stop": "."}).stops == (b".",)
    for bad in ([], [{"role": "tool", "content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}],
                [{"role": "user"}], "hi"):
        with pytest.raises(InputError):
            parse_chat({"messages": bad})
    with pytest.raises(InputError, match="unrecognized"):
        parse_chat({"messages": messages, "prompt": "x"})


def test_stop_sequences_are_cut_across_segments_and_utf8_stays_whole():
    cut = StopCutter((b"END",))
    out = [cut.feed(b"abcE"), cut.feed(b"Nxy"), cut.feed(b"zE"), cut.feed(b"ND tail")]
    assert out == ["abc", "ENxy", "z", ""]  # an "E" at the end waits for the next segment
    assert cut.stopped and cut.released == 8 and cut.finish() == ""
    cut = StopCutter(())
    snow = "☃".encode()  # three bytes, cut between segments
    assert [cut.feed(snow[:1]), cut.feed(snow[1:] + b"!\xe2")] == ["", "☃!"]
    assert cut.finish() == "\ufffd" and cut.released == 5 and not cut.stopped  # a character never finished: U+FFFD
    cut = StopCutter((b"zz", b"q"))
    assert cut.feed(b"az") == "a" and cut.finish() == "z"  # held back, then let go at the end


class _Stage:
    def __init__(self, name: str, exc: Exception):
        self.name, self.exc = name, exc

    def forward(self, state):
        raise self.exc


def test_a_failover_stage_says_timeout_only_when_every_candidate_timed_out():
    with pytest.raises(StageTimeout):
        FailoverStage([_Stage("a", StageTimeout("slow")), _Stage("b", StageTimeout("slow"))]).forward(None)
    with pytest.raises(PeerUnavailable) as info:
        FailoverStage([_Stage("a", StageTimeout("slow")), _Stage("b", PeerUnavailable("gone"))]).forward(None)
    assert not isinstance(info.value, StageTimeout)
