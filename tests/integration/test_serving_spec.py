"""Speculative decoding over a chain of real AR stage processes: the entry's draft proposes, the
chain verifies in one traversal, and the bytes equal plain decoding's (remote and local) bit for
bit; the target as its own draft has every proposal accepted; bad drafts are refused; the CLI."""

from __future__ import annotations

import dataclasses
import os
import subprocess

import grpc
import pytest
import torch

from btnode.errors import InputError
from btnode.rpc.stages import generate_remote, serve_stage, tensor_to_pb
from btnode.serve.ar import LocalARStage, local_ar_chain
from btnode.serve.driver import generate_ar
from btnode.serve.request import GenerationRequest
from btnode.serve.window import keep_bytes, window_start
from btnode.store.models import load_ar
from btnode.v2 import serve_pb2 as pb
from btnode.v2 import serve_pb2_grpc as pb_grpc
from procs import CLI, start, start_stage, stop_all, wait_port

SHAPE = ["--d-model", "32", "--heads", "2", "--layers", "1", "--blocks", "3", "--context", "32", "--segments", "1,8"]
PROMPT = b"Hello there"
G = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    names = {"ar": "3", "draft": "1"}  # target and draft, trained side by side
    runs = [start(["train-ar", "--out", str(root / name), "--steps", "4", "--batch", "4", "--warmup", "1",
                   "--ar-layers", layers, *SHAPE], root / f"train-{name}.log") for name, layers in names.items()]
    codes = [p.wait(timeout=300) for p in runs]
    assert codes == [0, 0], [(root / f"train-{name}.log").read_text()[-2000:] for name in names]
    return root


@pytest.fixture(scope="module")
def chain(trained):
    """AR stages 2:3 and 1:2, and two entries (0:1) in front of them: one drafting with a 1-layer
    model, one with the target itself."""
    ck, work, procs = str(trained / "ar"), trained, []
    try:
        p2, a2 = start_stage(work, "ar2", "--model", "ar", "--checkpoint", ck, "--layers-range", "2:3")
        procs.append(p2)
        p1, a1 = start_stage(work, "ar1", "--model", "ar", "--checkpoint", ck, "--layers-range", "1:2", "--next", a2)
        procs.append(p1)
        entries = {}
        for name, draft in (("ar0", trained / "draft"), ("ar0-self", trained / "ar")):  # start both, then wait
            (work / f"{name}.port").unlink(missing_ok=True)
            procs.append(start(["join", "--role", "stage", "--listen", "127.0.0.1:0", "--port-file",
                                str(work / f"{name}.port"), "--worker-id", name, "--model", "ar", "--checkpoint", ck,
                                "--layers-range", "0:1", "--next", a1, "--draft", str(draft)], work / f"{name}.log"))
            entries[name] = procs[-1]
        addrs = {}
        for name, p in entries.items():
            try:
                addrs[name] = f"127.0.0.1:{wait_port(work / f'{name}.port', p)}"
            except AssertionError:
                raise AssertionError((work / f"{name}.log").read_text()[-2000:]) from None
        yield {"draft": addrs["ar0"], "self": addrs["ar0-self"], "mid": a1}
    finally:
        stop_all(procs)


def joined(replies):
    return b"".join(r.new_bytes for r in replies)


def local_plain(trained, n, seed, temperature, prompt=PROMPT):
    model = load_ar(trained / "ar").model
    return joined(generate_ar(local_ar_chain(model, 3, torch.device("cpu")), model.cfg,
                              GenerationRequest(prompt, n_bytes=n, seed=seed, temperature=temperature)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_remote_drafted_chain_gives_the_bytes_of_plain_decoding(trained, chain, temperature):
    n = 60  # 11 + 60 > N = 32: across window restarts
    for seed in (1, 2):
        ask = GenerationRequest(PROMPT, n_bytes=n, seed=seed, temperature=temperature)
        spec = list(generate_remote(chain["draft"], dataclasses.replace(ask, draft_len=G)))
        plain = list(generate_remote(chain["draft"], ask))
        assert joined(spec) == joined(plain) == local_plain(trained, n, seed, temperature)
        assert len(plain) == n and plain[-1].traversals == n and plain[-1].drafted == 0
        last = spec[-1]
        assert last.traversals == len(spec) < n and all(1 <= len(r.new_bytes) <= G + 1 for r in spec)
        assert last.accepted == n - last.traversals and last.drafted >= last.accepted > 0
        assert list(spec[0].route) == ["ar0", "ar1", "ar2"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_target_as_its_own_remote_draft_has_every_proposal_accepted(trained, chain, temperature):
    n = 60
    spec = list(generate_remote(chain["self"], GenerationRequest(PROMPT, n_bytes=n, seed=5, temperature=temperature,
                                                                 draft_len=G)))
    assert joined(spec) == local_plain(trained, n, 5, temperature)
    expected, length, start_at = [], len(PROMPT), 0
    while length < len(PROMPT) + n:  # G + 1 bytes a traversal, unless cut by a window restart or the end
        start_at = window_start(start_at, length, 32, keep_bytes(32, 32))
        expected.append(min(G, 32 - (length - start_at), len(PROMPT) + n - length - 1) + 1)
        length += expected[-1]
    assert [len(r.new_bytes) for r in spec] == expected
    assert spec[-1].accepted == spec[-1].drafted == n - len(expected)


def test_bad_drafts_are_refused_with_invalid_argument(trained, chain):
    with pytest.raises(InputError, match="draft length G=16 is out of range"):
        list(generate_remote(chain["draft"], GenerationRequest(PROMPT, n_bytes=8, draft_len=16)))
    model = load_ar(trained / "ar").model
    server, port, _ = serve_stage(LocalARStage(model, 0, 3, name="plain-entry"), "127.0.0.1:0")
    try:
        with pytest.raises(InputError, match="plain-entry has no draft model"):
            list(generate_remote(f"127.0.0.1:{port}", GenerationRequest(PROMPT, n_bytes=8, draft_len=G)))
        assert len(joined(generate_remote(f"127.0.0.1:{port}", GenerationRequest(PROMPT, n_bytes=8)))) == 8
    finally:
        server.stop(0)
    channel = grpc.insecure_channel(chain["mid"])
    stub = pb_grpc.ServingStub(channel)
    base = dict(request_id="hostile", tokens=b"abc", step=0, seed=0, temperature=0.0)
    for kw in (dict(draft=b"xy", hidden=tensor_to_pb(torch.zeros(3, 32))),  # rows ≠ context + draft
               dict(draft=b"xy", start=3, hidden=tensor_to_pb(torch.zeros(2, 32))),  # no known row
               dict(draft=b"x" * 16, hidden=tensor_to_pb(torch.zeros(19, 32))),  # G ≥ N/2
               dict(draft=b"xy", hidden=tensor_to_pb(torch.full((5, 32), float("nan"))))):
        with pytest.raises(grpc.RpcError) as err:
            stub.ForwardAR(pb.ARRequest(**base, **kw), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kw
    channel.close()


def test_the_cli_decodes_speculatively_here_and_through_an_entry(trained, chain):
    args = ["generate", "--bytes", "40", "--seed", "3", "--temperature", "1", "Hello"]
    ck = ["--checkpoint", str(trained / "ar")]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the stages' thread count: the same kernels

    def cli(*extra):
        return subprocess.run(CLI + args + list(extra), check=True, capture_output=True, env=env)

    here = cli(*ck, "--draft", str(trained / "ar"), "--draft-len", "5")
    remote = cli("--entry", chain["draft"], "--draft-len", "5")
    assert here.stdout == remote.stdout == local_plain(trained, 40, 3, 1.0, b"Hello") + b"\n"
    # the target as its own draft: 6 bytes a traversal, 4 before the restart at 33 bytes of text
    assert b"40 bytes in 7 traversals: 5.71 bytes per traversal; 33 of 33 draft bytes accepted" in here.stderr
    assert b"bytes per traversal" in remote.stderr
