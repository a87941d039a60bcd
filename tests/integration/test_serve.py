"""`btnode serve --checkpoint DIR`: one process serves the chain, its gRPC entry and the OpenAI API.
The official client gets what `btnode generate --checkpoint` gets for a seed; the model id names the
weights; chat runs to the context's end; a request without a seed gets a fresh one, reported; every
OpenAI conformance case of bench/api.py passes; and `btnode api` in front of the entry stays light
and serves the same id."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from bench.api_conformance import conformance, proxy_rss_mb
from btnode.node.serving import weights_sha256
from btnode.store.models import load_blocks
from procs import BTNODE, CLI, TINY_TRAIN, scrape, start, wait_port

openai = pytest.importorskip("openai", reason="the official openai client is in the test extra: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    subprocess.run([*CLI, "train-local", "--out", str(root / "tiny"), "--steps", "3", *TINY_TRAIN], check=True,
                   capture_output=True)
    procs: list[subprocess.Popen] = []
    try:
        port_file = root / "serve.port"
        proc = start(["serve", "--checkpoint", str(root / "tiny"), "--listen", "127.0.0.1:0", "--port-file",
                      str(port_file)], root / "serve.log")
        procs.append(proc)
        port = wait_port(port_file, proc, timeout=120)
        deadline = time.monotonic() + 30
        while "curl -s" not in (text := (root / "serve.log").read_text()):
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
        entry = re.search(r"gRPC entry (\S+?)\)", text).group(1)  # type: ignore[union-attr]
        yield {"root": root, "port": port, "entry": entry, "log": text, "procs": procs}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)


def generate(*args: str) -> str:
    p = subprocess.run([BTNODE, "generate", *args], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout[:-1].decode(errors="replace")


def test_one_process_serves_the_checkpoint_under_an_id_that_names_its_weights(served):
    _, blocks = load_blocks(served["root"] / "tiny")
    model_id = f"tiny-v3-{weights_sha256(list(blocks))[:8]}"  # the folder's name, its step, the weights' hash
    assert f"serving {model_id} at http://127.0.0.1:{served['port']}/v1" in served["log"]
    assert f"curl -s http://127.0.0.1:{served['port']}/v1/completions" in served["log"]
    c = client(served["port"])
    card = c.models.retrieve(model_id)
    assert card.id == model_id and card.model_extra["version"] == 3
    assert card.model_extra["prompt_bytes"] == {"1": 32, "4": 29, "8": 25}  # N − K + 1, the default K (4) too
    ref = generate("--checkpoint", str(served["root"] / "tiny"), "--bytes", "20", "--seed", "4", "--temperature", "0.9",
                   "--segment", "8", "--readout", "commit", "Hello there")
    r = c.completions.create(model=model_id, prompt="Hello there", max_tokens=20, temperature=0.9, seed=4,
                             extra_body={"k": 8, "readout": "commit"})
    assert r.choices[0].text == ref and r.system_fingerprint.startswith("v3-")
    # the same process's gRPC entry serves `btnode generate --entry` the same bytes
    assert generate("--entry", served["entry"], "--bytes", "20", "--seed", "4", "--temperature", "0.9",
                    "--segment", "8", "--readout", "commit", "Hello there") == ref
    assert f'btnode_api_model_info{{model="{model_id}",version="3"' in scrape(served["port"])


def test_chat_runs_to_the_context_end_and_a_missing_seed_is_drawn_and_reported(served):
    c = client(served["port"])
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}],
                                  stop=["\x00\x01"], extra_body={"k": 1})
    assert r.id.startswith("chatcmpl-") and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 32  # "User: Hi\nAssistant:" then to N = 32
    a = c.completions.create(model=None, prompt="The", max_tokens=16, temperature=1, extra_body={"k": 1})
    b = c.completions.create(model=None, prompt="The", max_tokens=16, temperature=1, extra_body={"k": 1})
    seed_a, seed_b = a.model_extra["btnode"]["seed"], b.model_extra["btnode"]["seed"]
    assert seed_a != seed_b and a.model_extra["btnode"]["seed_drawn"]
    again = c.completions.create(model=None, prompt="The", max_tokens=16, temperature=1, seed=seed_a,
                                 extra_body={"k": 1})
    assert again.choices[0].text == a.choices[0].text and not again.model_extra["btnode"]["seed_drawn"]


def test_every_openai_conformance_case_behaves_as_documented(served):
    res = conformance("127.0.0.1", served["port"])
    assert len(res["cases"]) >= 40
    assert res["failed"] == 0, [(c["name"], c["expected"], c["got"], c.get("detail")) for c in res["cases"] if not c["ok"]]


def test_the_proxy_in_front_of_a_remote_chain_stays_light(served, tmp_path):
    port_file = tmp_path / "api.port"
    proc = start(["api", "--entry", served["entry"], "--listen", "127.0.0.1:0", "--port-file", str(port_file)],
                 tmp_path / "api.log")
    served["procs"].append(proc)
    port = wait_port(port_file, proc)
    r = client(port).completions.create(model=None, prompt="The", max_tokens=16, seed=1, stream=False)
    _, blocks = load_blocks(served["root"] / "tiny")
    sha = weights_sha256(list(blocks))  # the entry's Info names the weights: the proxy serves btnode serve's id
    assert r.usage.completion_tokens == 16 and r.model == f"tiny-v3-{sha[:8]}" and r.system_fingerprint == f"v3-{sha[:12]}"
    rss, torch = proxy_rss_mb(proc.pid)
    assert not torch and rss <= 120, (rss, torch)
    assert 'torch="none"' in scrape(port)
