"""`btnode api` in front of real chains of real stage processes: the official `openai` client (plain
and streaming, completions and chat) gets the bytes `btnode generate` gets for the same seed; raw
HTTP for what a client may get wrong; a client that drops mid-stream cancels the request down the
chain; the error codes (401, 429, 503, 504); and the page at / in a real headless Chromium."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from btnode.node.serving import weights_sha256
from btnode.serve.completions import CHAT_STOP, render_chat
from btnode.store.models import load_ar, load_blocks
from browser import CHROMIUM, Browser
from procs import CLI, free_port, scrape, start, start_stage, wait_port

openai = pytest.importorskip("openai", reason="the official openai client is in the test extra: pip install -e '.[test]'")

SHAPE = ["--d-model", "32", "--heads", "2", "--layers", "1", "--blocks", "3", "--context", "32", "--segments", "1,8"]
KEY = "sk-test"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """Trained tiny checkpoints, a block chain (3 stages) and an AR chain (2 stages), each behind
    `btnode api`; every process is reaped at the end."""
    root = tmp_path_factory.mktemp("api")
    for cmd, out, extra in (("train-local", "blocks", []), ("train-ar", "ar", ["--ar-layers", "2"])):
        subprocess.run([*CLI, cmd, "--out", str(root / out), "--steps", "4", "--batch", "4", "--warmup", "1",
                        *SHAPE, *extra], check=True, capture_output=True)
    procs: list[subprocess.Popen] = []
    lab = {"root": root, "procs": procs}
    try:
        nxt: list[str] = []
        for b in (2, 1, 0):
            extra = ["--metrics-listen", f"127.0.0.1:{(port := free_port())}"] if b == 0 else []
            proc, addr = start_stage(root, f"b{b}", "--block", str(b), "--checkpoint", str(root / "blocks"),
                                     *(["--next", nxt[0]] if nxt else []), *extra)
            procs.append(proc)
            lab[f"b{b}"] = proc
            lab["block_entry_next"] = nxt[0] if nxt else ""  # after the loop: block 1's address
            nxt = [addr]
        lab["block_entry"], lab["entry_metrics"] = nxt[0], port
        p1, a1 = start_stage(root, "ar1", "--model", "ar", "--checkpoint", str(root / "ar"), "--layers-range", "1:2")
        p0, a0 = start_stage(root, "ar0", "--model", "ar", "--checkpoint", str(root / "ar"), "--layers-range", "0:1",
                             "--next", a1)
        procs += [p1, p0]
        lab["ar_entry"] = a0
        lab["block"] = api(root, procs, "api-block", lab["block_entry"], "--api-key", KEY, "--max-body-bytes", "65536")
        lab["ar"] = api(root, procs, "api-ar", a0)
        yield lab
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()


def api(root: Path, procs: list, name: str, entry: str, *flags: str) -> int:
    """A `btnode api` process; its port."""
    port_file = root / f"{name}.port"
    proc = start(["api", "--entry", entry, "--listen", "127.0.0.1:0", "--port-file", str(port_file), *flags],
                 root / f"{name}.log")
    procs.append(proc)
    return wait_port(port_file, proc)


def client(port: int, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)


def btnode_generate(entry: str, prompt: str, n: int, seed: int, temperature: float, *flags: str) -> str:
    """What `btnode generate --entry` prints (its final newline dropped), decoded as the API decodes."""
    p = subprocess.run([*CLI, "generate", "--entry", entry, "--bytes", str(n), "--seed", str(seed),
                        "--temperature", str(temperature), *flags, prompt], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout.endswith(b"\n") and len(p.stdout) == n + 1
    return p.stdout[:-1].decode(errors="replace")


def post(port: int, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                        "Authorization": f"Bearer {KEY}", **(headers or {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def weights_id(folder: Path, kind: str) -> tuple[str, str]:
    """The id `btnode serve --checkpoint FOLDER` serves it under (NAME-vSTEP-HASH8), and the reply's
    system_fingerprint: a proxy in front of separate stages must give the same."""
    units = load_blocks(folder)[1] if kind == "block" else [load_ar(folder).model]
    sha = weights_sha256(units)  # type: ignore[arg-type]
    return f"{folder.name}-v4-{sha[:8]}", f"v4-{sha[:12]}"


def test_the_openai_client_gets_what_btnode_generate_gets_from_the_block_chain(lab):
    c = client(lab["block"])
    model = c.models.list().data[0]
    model_id, fingerprint = weights_id(lab["root"] / "blocks", "block")  # the stages report their weights
    assert model.id == model_id and model.model_extra["version"] == 4
    assert model.model_extra["k"] == 4  # the serving default: N/8 here
    assert model.model_extra["readout"] == "spec" and model.model_extra["context"] == 32
    assert model.model_extra["settings"]["prompt_bytes"] == {"1": 32, "4": 29, "8": 25}
    ref = btnode_generate(lab["block_entry"], "Hello there", 20, 4, 0.9, "--segment", "8", "--readout", "commit")
    kw = dict(model=model.id, prompt="Hello there", max_tokens=20, temperature=0.9, seed=4,
              extra_body={"k": 8, "readout": "commit"})
    plain = c.completions.create(**kw)
    assert plain.choices[0].text == ref and plain.choices[0].finish_reason == "length"
    assert plain.system_fingerprint == fingerprint and plain.model_extra["btnode"]["version"] == 4
    assert f'btnode_api_model_info{{model="{model_id}",version="4"' in scrape(lab["block"])  # and the log:
    assert f"model {model_id} (version 4, weights sha256 " in (lab["root"] / "api-block.log").read_text()
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (11, 20)  # bytes
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(texts) == ref
    assert len(texts) == 3 + 1  # one chunk per segment (⌈20/8⌉), then the finish chunk
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 20
    assert [ch.model_extra["btnode"]["traversals"] for ch in chunks[:3]] == [1, 2, 3]

    messages = [{"role": "system", "content": "Be."}, {"role": "user", "content": "Hi"}]
    prompt = render_chat(messages)
    assert prompt == "Be.\n\nUser: Hi\nAssistant:"  # 25 bytes: all a K = 8 segment of this tiny model may see
    full = btnode_generate(lab["block_entry"], prompt, 16, 1, 0.0, "--segment", "8")
    want = full.split(CHAT_STOP)[0]
    chat = c.chat.completions.create(model=model.id, messages=messages, max_tokens=16, temperature=0, seed=1,
                                     extra_body={"k": 8})
    assert chat.choices[0].message.content == want and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == ("stop" if CHAT_STOP in full else "length")
    deltas = list(c.chat.completions.create(model=model.id, messages=messages, max_tokens=16, temperature=0, seed=1,
                                            extra_body={"k": 8}, stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == want


def test_the_openai_client_gets_what_btnode_generate_gets_from_the_ar_chain(lab):
    c = client(lab["ar"], key="unused")  # this server was started without --api-key
    model = c.models.list().data[0]
    model_id, fingerprint = weights_id(lab["root"] / "ar", "ar")  # two stages, one model: its hash once
    assert model.id == model_id and model.model_extra["k"] == 1
    ref = btnode_generate(lab["ar_entry"], "The history", 12, 3, 1.0)
    plain = c.completions.create(model=model.id, prompt="The history", max_tokens=12, temperature=1.0, seed=3)
    assert plain.choices[0].text == ref and plain.usage.completion_tokens == 12
    assert plain.system_fingerprint == fingerprint
    chunks = list(c.completions.create(model=model.id, prompt="The history", max_tokens=12, temperature=1.0, seed=3,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == ref
    assert len(chunks) == 12 + 1  # one traversal per byte


def test_stop_sequences_cut_the_text_and_end_the_request(lab):
    c = client(lab["block"])
    ref = btnode_generate(lab["block_entry"], "Hello there", 24, 4, 0.0, "--segment", "1")
    stop = next(ref[i:i + 2] for i in range(1, len(ref) - 1) if ref.index(ref[i:i + 2]) == i)  # first seen at i ≥ 1
    r = c.completions.create(model=None, prompt="Hello there", max_tokens=24, temperature=0, seed=4, stop=[stop],
                             extra_body={"k": 1})
    assert r.choices[0].text == ref[:ref.index(stop)] and r.choices[0].finish_reason == "stop"
    s = list(c.completions.create(model=None, prompt="Hello there", max_tokens=24, temperature=0, seed=4, stop=stop,
                                  extra_body={"k": 1}, stream=True))
    assert "".join(ch.choices[0].text for ch in s) == ref[:ref.index(stop)]
    assert s[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,status,match", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"prompt": "x", "max_tokens": -3}).encode(), 400, "max_tokens must be in"),
    (json.dumps({"prompt": "x", "max_tokens": 10**12}).encode(), 400, "max_tokens must be in"),
    (json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens must be an integer"),
    (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), 404, "does not exist"),
    (json.dumps({"prompt": "x" * 100, "max_tokens": 4}).encode(), 400, "may be at most 29 bytes"),  # default K=4 (N/8)
    (json.dumps({"prompt": "x", "n": 2}).encode(), 400, "n must be in"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "x", "k": 5, "readout": "pool"}).encode(), 400, "K=5 was not trained"),
    (json.dumps({"prompt": "x", "k": 17}).encode(), 400, "readout 'spec' drafts 1 … 16"),
    (json.dumps({"prompt": "x", "readout": "best"}).encode(), 400, "readout must be one of"),
    (json.dumps({"prompt": "x", "top_p": 0.5}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "x", "frobnicate": 1}).encode(), 400, "unrecognized request argument"),
    (json.dumps({"prompt": "x" * 100_000}).encode(), 413, "at most 65536"),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(lab, body, status, match):
    code, reply = post(lab["block"], "/v1/completions", body)
    assert code == status, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"} and match in reply["error"]["message"]
    code, reply = post(lab["block"], "/v1/completions", json.dumps({"prompt": "ok", "max_tokens": 2}).encode())
    assert code == 200 and reply["usage"]["completion_tokens"] == 2


def test_a_wrong_api_key_is_refused(lab):
    code, reply = post(lab["block"], "/v1/completions", b'{"prompt": "x"}', {"Authorization": "Bearer nope"})
    assert code == 401 and reply["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(lab["block"], key="nope").models.list()
    conn = http.client.HTTPConnection("127.0.0.1", lab["block"], timeout=30)
    conn.request("GET", "/health")  # probes need no key
    assert conn.getresponse().status == 200


def _counter(text: str, name: str, **labels: str) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the exposition sorts label names
    m = re.search(rf"^{name}\{{{sel}\}} (\S+)$" if sel else rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_client_that_drops_mid_stream_cancels_the_request_down_the_chain(lab):
    port, entry_metrics = lab["block"], lab["entry_metrics"]
    before = _counter(scrape(entry_metrics), "btnode_serve_requests_total", chain="block", outcome="cancelled")
    body = json.dumps({"prompt": "Hello", "max_tokens": 4096, "k": 1, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    got = b""
    while b"data: " not in got:  # the first segment has come
        got += sock.recv(4096)
    assert got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got
    sock.close()  # 4096 traversals would take minutes: the chain must stop long before
    deadline = time.monotonic() + 60
    while _counter(scrape(entry_metrics), "btnode_serve_requests_total", chain="block", outcome="cancelled") <= before:
        assert time.monotonic() < deadline, "the entry never saw the request cancelled"
        time.sleep(0.2)
    text = scrape(port)
    while _counter(text, "btnode_api_in_flight") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        text = scrape(port)
    assert _counter(text, "btnode_api_in_flight") == 0 and _counter(text, "btnode_api_cancelled_total") >= 1
    assert _counter(text, "btnode_api_requests_total", route="/v1/completions", code="200") >= 1
    assert _counter(text, "btnode_api_ttfb_seconds_count") >= 1


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (Debian package `prometheus`; `make tools` installs it)")
def test_promtool_accepts_the_api_metrics(lab):
    post(lab["block"], "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')
    text = scrape(lab["block"])
    assert _counter(text, "btnode_api_requests_total", route="/v1/completions", code="200") >= 1
    done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_route_is_503_a_stalled_stage_504_and_the_concurrency_limit_429(lab):
    root, procs = lab["root"], lab["procs"]
    dead = api(root, procs, "api-dead", f"127.0.0.1:{free_port()}")
    code, reply = post(dead, "/v1/completions", b'{"prompt": "x"}')
    assert code == 503 and reply["error"]["code"] == "no_route"
    conn = http.client.HTTPConnection("127.0.0.1", dead, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 503

    # a spare entry: the dead one first, the live chain second
    one = api(root, procs, "api-one", f"127.0.0.1:{free_port()},{lab['block_entry']}", "--max-concurrent", "1",
              "--segment-timeout", "2")
    long = json.dumps({"prompt": "Hello", "max_tokens": 4096, "k": 1, "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", one, timeout=30)
    conn.request("POST", "/v1/completions", body=long, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")  # streaming through the spare entry
    code, reply = post(one, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')
    assert code == 429 and reply["error"]["code"] == "rate_limit_exceeded"
    conn.close()  # frees the slot once the server sees the client go
    deadline = time.monotonic() + 30
    while (code := post(one, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')[0]) == 429:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert code == 200

    # a stall after the stream began: the error comes as one event, and the stream ends without [DONE]
    conn = http.client.HTTPConnection("127.0.0.1", one, timeout=60)
    conn.request("POST", "/v1/completions", body=long, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    lab["b2"].send_signal(signal.SIGSTOP)
    try:
        events = [line for line in r.read().split(b"\n") if line.startswith(b"data: ")]
    finally:
        lab["b2"].send_signal(signal.SIGCONT)
        conn.close()
    assert b"[DONE]" not in events[-1] and json.loads(events[-1][6:])["error"]["code"] == "stage_timeout"

    # a second entry for the same blocks 1 and 2, which waits 1 s for block 1 (--stage-timeout)
    proc, impatient = start_stage(root, "b0-impatient", "--block", "0", "--checkpoint", str(root / "blocks"),
                                  "--next", lab["block_entry_next"], "--stage-timeout", "1")
    procs.append(proc)
    relayed = api(root, procs, "api-relayed", impatient)
    assert post(relayed, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')[0] == 200
    lab["b2"].send_signal(signal.SIGSTOP)  # the last stage stalls
    try:
        code, reply = post(one, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')  # no segment in 2 s
        relayed_code, relayed_reply = post(relayed, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')
    finally:
        lab["b2"].send_signal(signal.SIGCONT)
    assert code == 504 and reply["error"]["code"] == "stage_timeout", reply
    # the entry's own timeout, relayed up the chain as StageTimeout
    assert relayed_code == 504 and "no stage for the next block answered" in relayed_reply["error"]["message"]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make tools installs it)")
def test_the_page_works_with_a_key_typed_into_a_real_browser(lab, tmp_path):
    """As a person does it: the page opens without the key (401 in its header), the key is typed, the
    model card comes back by itself, the settings are typed and picked with the keyboard and the
    mouse, and what was picked is what the request carries and what the text is made with."""
    port = lab["block"]
    want = {"prompt": "Hello there", "max_tokens": 24, "temperature": 0, "seed": 5, "readout": "commit", "k": 1}
    code, ref = post(port, "/v1/completions", json.dumps(want).encode())
    assert code == 200
    browser = Browser()
    try:
        browser.open(f"http://127.0.0.1:{port}/")
        browser.wait_for("document.body && document.body.dataset.ready === '1'")
        assert "missing or wrong API key" in browser.eval("document.getElementById('model').textContent")
        # observe (not drive) what the page sends
        browser.eval("window.sent = []; const f = window.fetch; window.fetch = (u, o) => {"
                     " if (o && o.body) sent.push(JSON.parse(o.body)); return f(u, o); }; true")
        browser.type("#key", KEY)
        header = browser.wait_for("document.getElementById('model').textContent.startsWith('Model ') && "
                                  "document.getElementById('model').textContent")
        model_id = client(port).models.list().data[0].id
        assert model_id in header and "API key" not in header
        assert browser.eval("document.getElementById('k').value") == "4"  # the serving default (spec, K = N/8)
        assert "up to 29 bytes at K = 4" in browser.eval("document.getElementById('budget').textContent")
        browser.retype("#k", "1")
        assert "up to 32 bytes at K = 1" in browser.eval("document.getElementById('budget').textContent")
        browser.retype("#temperature", "0")
        browser.retype("#bytes", "24")
        browser.type("#seed", "5")
        browser.click("#k")
        browser.key("Tab", "Tab", vk=9, modifiers=8)  # Shift+Tab: back to the readout list
        browser.key("c", "KeyC", vk=67, text="c")  # picks "commit" as a keyboard user does
        assert browser.eval("document.getElementById('readout').value") == "commit"
        browser.eval("window.lengths = []; new MutationObserver(() => lengths.push("
                     "document.getElementById('out').textContent.length)).observe(document.getElementById('out'), "
                     "{childList: true, characterData: true, subtree: true}); true")
        browser.type("#prompt", "Hello there")
        browser.click("#go")
        assert browser.wait_for("['done', 'error'].includes(document.body.dataset.state) && "
                                "document.body.dataset.state", timeout=60) == "done", \
            browser.eval("document.getElementById('stats').textContent")
        sent = browser.eval("sent")
        assert sent == [{**want, "model": model_id, "stream": True}]
        out = browser.eval("document.getElementById('out').textContent")
        assert out == "Hello there" + ref["choices"][0]["text"]
        partial = [n for n in browser.eval("lengths") if len("Hello there") < n < len(out)]
        assert partial, "the text arrived all at once, not streamed"
        stats = browser.eval("document.getElementById('stats').textContent")
        assert "24 bytes" in stats and "24 traversals: 1.00 bytes per traversal" in stats and "seed 5" in stats
        browser.screenshot(tmp_path / "page.png")
        assert (tmp_path / "page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        browser.close()
