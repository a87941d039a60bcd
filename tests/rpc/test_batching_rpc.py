"""Continuous batching over gRPC: the entry's traversals carry several requests' segments to the
next stages in one ForwardBatch call each; concurrent Generate streams share them and each gets
what the local chain gives it alone; a segment a stage refuses gets its own error."""

import threading

import pytest
import torch

from btnode.errors import InputError
from btnode.model.block import DiffusionBlock
from btnode.model.config import ModelConfig
from btnode.rpc.entry import EntryClient
from btnode.rpc.stages import RemoteBlockStage, generate_remote, serve_stage
from btnode.serve.batching import forward_batch
from btnode.serve.driver import generate
from btnode.serve.request import GenerationRequest
from btnode.serve.stages import FailoverStage, LocalBlockStage, SegmentResult, SegmentState, initial_state, local_chain

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=2, n_blocks=3, context=32, segments=(1, 8, 16))


@pytest.fixture
def chain():
    """Blocks 1 and 2 served over gRPC on loopback, block 0 (the entry) too; and the same blocks
    linked in this process, for the reference."""
    torch.manual_seed(3)
    blocks = []
    for _ in range(3):
        b = DiffusionBlock(CFG).eval()
        with torch.no_grad():
            for p in b.parameters():
                p.add_(0.05 * torch.randn_like(p))
        blocks.append(b)
    servers, remotes = [], []
    nxt = None
    for i in (2, 1, 0):
        stage = LocalBlockStage(blocks[i], i, 3, next=nxt, name=f"block-{i}")
        server, port, _ = serve_stage(stage, "127.0.0.1:0")
        servers.append(server)
        remote = RemoteBlockStage(f"127.0.0.1:{port}")
        remotes.append(remote)
        nxt = FailoverStage([remote])
        if i == 0:
            entry = stage
    yield {"local": local_chain(blocks, torch.device("cpu")), "entry": entry, "address": remotes[-1].address}
    for r in remotes:
        r.close()
    for s in servers:
        s.stop(None)


def state(i, prompt, k=8):
    return SegmentState(request_id=f"r{i}", context=prompt, segment=0, k=k, n_steps=7, seed=i, temperature=1.0,
                        z=initial_state(CFG, i, 0, k, 7), readout="spec", want_logits=True, first_chunk=len(prompt),
                        use_cache=False)


def test_a_batch_crosses_each_hop_in_one_call_and_keeps_every_segment_its_own(chain):
    states = [state(i, p) for i, p in enumerate([b"one", b"a longer prompt", b"x", b"y" * 30, b"mid"])]
    out = forward_batch(chain["entry"], states)
    assert isinstance(out[3], InputError) and "at most 25 bytes" in str(out[3])  # refused at block 0
    for i in (0, 1, 2, 4):
        alone = chain["local"].forward(states[i])
        assert isinstance(out[i], SegmentResult) and out[i].new_bytes == alone.new_bytes
        assert out[i].route == alone.route == ["block-0", "block-1", "block-2"]
        assert torch.allclose(out[i].logits, alone.logits, atol=1e-5)
    ok = chain["entry"].step(state(8, b"hi"))  # block 0's part: the draft, to send on by hand
    remote = chain["entry"].next.candidates[0]
    got = remote.forward_batch([state(9, b"hi"), ok])  # block 1 refuses a spec segment without block 0's draft
    assert isinstance(got[0], Exception) and "missing" in str(got[0])
    assert isinstance(got[1], SegmentResult) and got[1].new_bytes == chain["local"].forward(state(8, b"hi")).new_bytes


def test_concurrent_streams_share_traversals_and_get_what_they_get_alone(chain):
    asks = [GenerationRequest(p, 12, seed=i, k=4 if i % 2 else 8, temperature=1.0 if i % 3 else 0.0)
            for i, p in enumerate([b"The", b"In the", b"A", b"Once upon", b"He was", b"It"])]
    alone = [b"".join(r.new_bytes for r in generate(chain["local"], CFG, 3, a)) for a in asks]
    got: dict[int, bytes] = {}

    def run(i):
        got[i] = b"".join(r.new_bytes for r in generate_remote(chain["address"], asks[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(len(asks))] == alone


def test_the_entry_says_its_serving_defaults():
    import asyncio

    torch.manual_seed(0)
    stage = LocalBlockStage(DiffusionBlock(CFG).eval(), 2, 3, name="block-0-of-one")  # Info only
    server, port, _ = serve_stage(stage, "127.0.0.1:0")
    try:
        info = asyncio.run(EntryClient([f"127.0.0.1:{port}"]).info())
    finally:
        server.stop(None)
    assert info.defaults is not None and (info.defaults.readout.value, info.defaults.k) == ("spec", 4)  # at most N/8 (serve/defaults.py)


def test_the_ar_chain_batches_concurrent_streams_over_forward_ar_batch():
    """Three AR stages over gRPC: concurrent Generate streams share the entry's traversals (each hop
    one ForwardARBatch call) and each gets what the local chain gives it alone."""
    from btnode.model.ar import ByteTransformer
    from btnode.protocol import Meter
    from btnode.rpc.stages import RemoteARStage
    from btnode.serve.ar import LocalARStage, local_ar_chain
    from btnode.serve.driver import generate_ar

    cfg = ModelConfig(d_model=32, n_heads=2, n_layers=2, n_blocks=3, context=32, segments=(1, 8), kind="ar",
                      ar_layers=6)
    torch.manual_seed(0)
    m = ByteTransformer(cfg, 6).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    servers, nxt, meters = [], None, {}
    for lo in (4, 2, 0):
        meters[lo] = Meter()
        stage = LocalARStage(m, lo, lo + 2, next=FailoverStage([RemoteARStage(nxt)]) if nxt else None)
        server, port, _ = serve_stage(stage, "127.0.0.1:0", meter=meters[lo])
        servers.append(server)
        nxt = f"127.0.0.1:{port}"
    asks = [GenerationRequest(p, 20, seed=i, temperature=1.0 if i % 2 else 0.0)
            for i, p in enumerate([b"The", b"In the", b"A", b"Once upon a time", b"He was", b"It"])]
    alone = [b"".join(r.new_bytes for r in generate_ar(local_ar_chain(m, 3, torch.device("cpu")), cfg, a))
             for a in asks]
    got: dict[int, bytes] = {}

    def run(i):
        got[i] = b"".join(r.new_bytes for r in generate_remote(nxt, asks[i]))

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for s in servers:
            s.stop(None)
    assert [got.get(i) for i in range(len(asks))] == alone
    counts, _ = meters[0].snapshot()
    assert counts[("batched_segments", "ar")] == 6 * 20 and counts[("traversals", "ar")] < 6 * 20 / 2, counts
    _, durations = meters[2].snapshot()  # the next stage's calls (ForwardARBatch, or ForwardAR for one step)
    assert durations["forward"][0] == counts[("traversals", "ar")], durations
