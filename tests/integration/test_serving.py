"""Serving over a chain of real stage processes: exact match with the local sampler, the
autoregressive chain, failures with and without a spare, and bad input."""

from __future__ import annotations

import signal
import subprocess
import time

import grpc
import pytest
import torch

from btnode.errors import InputError, PeerUnavailable
from btnode.rpc.stages import generate_remote, tensor_to_pb
from btnode.serve.driver import generate, generate_ar
from btnode.serve.ar import local_ar_chain
from btnode.serve.request import GenerationRequest
from btnode.serve.stages import local_chain
from btnode.store.models import load_ar, load_blocks
from btnode.v2 import serve_pb2 as pb
from btnode.v2 import serve_pb2_grpc as pb_grpc
from procs import CLI, start_stage

SHAPE = ["--d-model", "32", "--heads", "2", "--layers", "1", "--blocks", "3", "--context", "32", "--segments", "1,8"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    subprocess.run(CLI + ["train-local", "--out", str(root / "blocks"), "--steps", "4", "--batch", "4", "--warmup", "1",
                          *SHAPE], check=True, capture_output=True)
    subprocess.run(CLI + ["train-ar", "--out", str(root / "ar"), "--steps", "4", "--batch", "4", "--warmup", "1",
                          "--ar-layers", "3", *SHAPE], check=True, capture_output=True)
    return root


def chain(trained, tmp_path, processes, spare_for: int | None = None,
          stage_args: dict[int, list[str]] | None = None) -> dict[str, object]:
    """Stages for blocks 2, 1, 0 (plus a spare for one block, and extra flags per block); returns
    their processes and addresses."""
    ck = str(trained / "blocks")
    out: dict[str, object] = {}
    nxt: list[str] = []
    for b in (2, 1, 0):
        addrs = []
        for copy in (["main", "spare"] if b == spare_for else ["main"]):
            args = ["--block", str(b), "--checkpoint", ck] + (["--next", ",".join(nxt)] if nxt else [])
            args += (stage_args or {}).get(b, [])
            proc, addr = start_stage(tmp_path, f"b{b}-{copy}", *args)
            processes.append(proc)
            out[f"b{b}-{copy}"] = proc
            addrs.append(addr)
        nxt = addrs
    out["entry"] = nxt[0]
    return out


def local(trained, prompt, **kw):
    torch.set_num_threads(1)  # the stages run with one thread too: same kernels, same bits
    cfg, blocks = load_blocks(trained / "blocks")
    return list(generate(local_chain(blocks, torch.device("cpu")), cfg, 3, GenerationRequest(prompt, **{"readout": None if kw.get("n_tail") else "pool", **kw})))


@pytest.mark.parametrize("k,temperature,readout", [(8, 0.0, "pool"), (1, 0.9, "pool"), (8, 0.9, "last"), (8, 0.9, "commit"),
                                                   (8, 0.9, "spec"), (8, 0.9, "spec-fill")])
def test_remote_chain_matches_the_local_sampler(trained, tmp_path, processes, k, temperature, readout):
    c = chain(trained, tmp_path, processes)
    kw = dict(n_bytes=20, k=k, n_steps=7, seed=4, temperature=temperature, want_logits=True, readout=readout)
    remote = list(generate_remote(c["entry"], GenerationRequest(b"Hello there", **{"readout": "pool", **kw})))
    ref = local(trained, b"Hello there", **kw)
    assert b"".join(r.new_bytes for r in remote) == b"".join(r.new_bytes for r in ref)  # bit-identical bytes
    if readout != "spec":  # "spec" commits 1 … K bytes per traversal
        assert len(remote) == -(-20 // k)
    assert remote[-1].traversals == len(remote)  # one traversal per segment
    for r, q in zip(remote, ref):
        logits = torch.frombuffer(bytearray(r.logits.data), dtype=torch.float32).view(*r.logits.shape)
        assert (logits - q.logits).abs().max().item() <= 1e-5  # stated tolerance; equal in practice
    assert list(remote[0].route) == ["b0-main", "b1-main", "b2-main"]
    if readout.startswith("spec"):  # the draft bytes verified and kept, counted as the AR chain counts them
        assert remote[-1].drafted == 8 * len(remote) and remote[-1].accepted == sum(r.accepted for r in ref)


def test_context_caches_change_no_bit_across_window_restarts(trained, tmp_path, processes):
    """Stages cache their clean stream per request (block 1 here with the cache off): the same bytes
    and logits as every stage rebuilding it, and as the local sampler, over several window restarts."""
    c = chain(trained, tmp_path, processes, stage_args={1: ["--context-cache-mb", "0"]})
    for k, readout in ((1, "pool"), (8, "pool"), (8, "commit"), (8, "spec"), (8, "spec-fill")):
        kw = dict(n_bytes=48, k=k, n_steps=7, seed=3, temperature=1.0, want_logits=True, readout=readout)
        cached = list(generate_remote(c["entry"], GenerationRequest(b"Hello there", **{"readout": "pool", **kw})))
        rebuilt = list(generate_remote(c["entry"], GenerationRequest(b"Hello there", use_cache=False, **{"readout": "pool", **kw})))
        ref = local(trained, b"Hello there", **kw)
        assert len(b"Hello there") + 48 - k > 32 - k + 1  # the window restarts at least once
        for r in (rebuilt, cached):
            assert b"".join(x.new_bytes for x in r) == b"".join(x.new_bytes for x in ref)
        for a, b, q in zip(cached, rebuilt, ref, strict=True):
            assert a.logits == b.logits  # bit for bit
            logits = torch.frombuffer(bytearray(a.logits.data), dtype=torch.float32).view(*a.logits.shape)
            assert (logits - q.logits).abs().max().item() <= 1e-5


def test_the_autoregressive_chain_is_served_by_the_same_daemon(trained, tmp_path, processes):
    ck = str(trained / "ar")
    p2, a2 = start_stage(tmp_path, "ar2", "--model", "ar", "--checkpoint", ck, "--layers-range", "2:3")
    p1, a1 = start_stage(tmp_path, "ar1", "--model", "ar", "--checkpoint", ck, "--layers-range", "1:2", "--next", a2)
    p0, a0 = start_stage(tmp_path, "ar0", "--model", "ar", "--checkpoint", ck, "--layers-range", "0:1", "--next", a1)
    processes.extend([p0, p1, p2])
    remote = list(generate_remote(a0, GenerationRequest(b"Hello there", n_bytes=30, seed=1, temperature=0.0, readout="pool")))
    torch.set_num_threads(1)
    model = load_ar(trained / "ar").model
    ref = list(generate_ar(local_ar_chain(model, 3, torch.device("cpu")), model.cfg,
                           GenerationRequest(b"Hello there", n_bytes=30, seed=1, temperature=0.0, readout="pool")))
    assert b"".join(r.new_bytes for r in remote) == b"".join(r.new_bytes for r in ref)
    assert len(remote) == 30 and remote[-1].traversals == 30  # one traversal per byte
    assert list(remote[0].route) == ["ar0", "ar1", "ar2"]


def test_a_dead_stage_ends_the_request_with_unavailable_not_a_hang(trained, tmp_path, processes):
    c = chain(trained, tmp_path, processes)
    stream = generate_remote(c["entry"], GenerationRequest(b"Hello", n_bytes=300, k=1, seed=0, readout="pool"))
    next(stream)
    c["b1-main"].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(PeerUnavailable, match="no stage for the next block answered"):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 20


def test_a_spare_takes_over_from_the_failed_block_and_the_request_completes(trained, tmp_path, processes):
    """The spare starts with no context cache and rebuilds it from the window; 5 + 40 bytes at K = 1
    also restart the window once."""
    c = chain(trained, tmp_path, processes, spare_for=1)
    replies = []
    for i, r in enumerate(generate_remote(c["entry"], GenerationRequest(b"Hello", n_bytes=40, k=1, seed=2,
                                                                          temperature=0.7, readout="pool"))):
        replies.append(r)
        if i == 5:
            c["b1-main"].send_signal(signal.SIGKILL)
    assert b"".join(r.new_bytes for r in replies) == b"".join(r.new_bytes for r in local(
        trained, b"Hello", n_bytes=40, k=1, n_steps=7, seed=2, temperature=0.7))
    assert list(replies[0].route)[1] == "b1-main" and list(replies[-1].route)[1] == "b1-spare"


def test_bad_requests_and_malformed_states(trained, tmp_path, processes):
    c = chain(trained, tmp_path, processes)
    with pytest.raises(InputError, match="at most 25 bytes"):
        list(generate_remote(c["entry"], GenerationRequest(b"x" * 26, n_bytes=8, k=8)))
    with pytest.raises(InputError, match="K=4 was not trained"):
        list(generate_remote(c["entry"], GenerationRequest(b"hi", n_bytes=8, k=4, readout="pool")))
    with pytest.raises(InputError, match="2 sampler steps cannot visit all 3 blocks"):
        list(generate_remote(c["entry"], GenerationRequest(b"hi", n_bytes=8, k=8, n_steps=2)))
    with pytest.raises(InputError, match="readout must be one of"):
        list(generate_remote(c["entry"], GenerationRequest(b"hi", n_bytes=8, k=8, readout="mean")))
    with pytest.raises(InputError, match="at most 256"):
        list(generate_remote(c["entry"], GenerationRequest(b"hi", n_bytes=8, k=8, n_steps=10**9)))
    # a malformed state tensor sent straight to the middle stage
    channel = grpc.insecure_channel(_address(tmp_path, "b1-main"))
    stub = pb_grpc.ServingStub(channel)
    good = dict(request_id="r", context=b"hi", segment=0, k=8, n_steps=7, seed=0, temperature=0.0,
                readout=pb.READOUT_LAST)
    for z in (tensor_to_pb(torch.zeros(8, 5)), pb.StateTensor(shape=[8, 32], data=b"\0" * 12),
              tensor_to_pb(torch.full((8, 32), float("nan")))):
        with pytest.raises(grpc.RpcError) as err:
            stub.Forward(pb.SegmentRequest(z=z, **good), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    zero = tensor_to_pb(torch.zeros(8, 32))
    lp = tensor_to_pb(torch.full((8, 256), -5.5))
    # the pooled readout's accumulator: missing, misshapen, or above certainty (log-prob > 0)
    # (UNSPECIFIED: the library's default, pool, which needs its accumulator; 99: no readout this build knows)
    for extra in (dict(readout=pb.READOUT_UNSPECIFIED), dict(readout=pb.READOUT_POOL), dict(readout=pb.READOUT_POOL, pool=tensor_to_pb(torch.zeros(8, 7))),
                  dict(readout=pb.READOUT_POOL, pool=tensor_to_pb(torch.full((8, 256), 3.0))),
                  dict(readout=pb.READOUT_LAST, pool=tensor_to_pb(torch.zeros(8, 256))), dict(readout=99),
                  # the window's first chunk: longer than the window, or not whole segments after it
                  dict(first_chunk=3), dict(first_chunk=1), dict(n_steps=257), dict(request_id="r" * 129),
                  # readout spec past block 0: the draft, its log-probs and the pool, each missing or hostile
                  dict(readout=pb.READOUT_SPEC, pool=lp, draft_logp=lp), dict(readout=pb.READOUT_SPEC, draft=bytes(8), pool=lp),
                  dict(readout=pb.READOUT_SPEC, draft=bytes(7), draft_logp=lp, pool=lp),
                  dict(readout=pb.READOUT_SPEC, draft=bytes(8), draft_logp=tensor_to_pb(torch.full((8, 256), 1.0)), pool=lp),
                  dict(readout=pb.READOUT_SPEC, draft=bytes(8), draft_logp=tensor_to_pb(torch.zeros(9, 256)), pool=lp),
                  dict(readout=pb.READOUT_SPEC, draft=bytes(8), draft_logp=pb.StateTensor(shape=[8, 256], data=b"\0"), pool=lp),
                  dict(readout=pb.READOUT_POOL, draft=bytes(8), pool=lp), dict(readout=pb.READOUT_SPEC, k=17, draft=bytes(17))):
        with pytest.raises(grpc.RpcError) as err:
            stub.Forward(pb.SegmentRequest(z=zero, **{**good, **extra}), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, extra
    assert stub.Forward(pb.SegmentRequest(z=zero, **good), timeout=10).new_bytes
    for readout in (pb.READOUT_POOL, pb.READOUT_UNSPECIFIED):  # the default pools too
        assert stub.Forward(pb.SegmentRequest(z=zero, pool=tensor_to_pb(torch.full((8, 256), -5.5)),
                                              **{**good, "readout": readout}), timeout=10).new_bytes
    kept = stub.Forward(pb.SegmentRequest(z=zero, draft=bytes(8), draft_logp=lp, pool=lp,
                                          **{**good, "readout": pb.READOUT_SPEC}), timeout=10)
    assert 1 <= len(kept.new_bytes) <= 8 and 0 <= kept.accepted <= 8
    # a draft's segment may leave out z and (the first hop) a pool equal to the draft's log-probs: the same answer
    lean = stub.Forward(pb.SegmentRequest(draft=bytes(8), draft_logp=lp, **{**good, "readout": pb.READOUT_SPEC}),
                        timeout=10)
    assert (lean.new_bytes, lean.accepted) == (kept.new_bytes, kept.accepted)
    channel.close()
    with pytest.raises(InputError, match="not the first stage"):
        list(generate_remote(_address(tmp_path, "b1-main"), GenerationRequest(b"hi", n_bytes=8, k=8)))


def _address(tmp_path, name):
    return f"127.0.0.1:{(tmp_path / f'{name}.port').read_text().strip()}"
