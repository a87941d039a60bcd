"""Continuous batching (serve/batching.py): requests of different context lengths share a traversal
and each gets what it gets alone; a refused one gets its error and the others go on; requests that
arrive while a traversal runs join the next one."""

import copy
import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from btnode.errors import InputError
from btnode.model.block import DiffusionBlock
from btnode.model.layout import generation_layout, row_layouts
from btnode.model.sampler import context_logits
from btnode.node.metrics import StageCollector
from btnode.protocol import Meter
from btnode.serve.batching import BatchingStage, encode_rows, forward_batch
from btnode.serve.driver import generate
from btnode.serve.request import GenerationRequest
from btnode.serve.stages import SegmentResult, SegmentState, initial_state, local_chain


def blocks_of(cfg, seed=5):
    torch.manual_seed(seed)
    out = []
    for _ in range(cfg.n_blocks):
        b = DiffusionBlock(cfg).eval()
        with torch.no_grad():  # AdaLN-zero starts every noisy layer at the identity: give them weights
            for p in b.parameters():
                p.add_(0.05 * torch.randn_like(p))
        out.append(b)
    return out


def test_ragged_rows_equal_each_row_alone(tiny_cfg):
    """extend_rows and a RowLayout give every row of a batch of different lengths what
    extend_context and generation_layout give it alone."""
    block = blocks_of(tiny_cfg)[0]
    windows = [b"ab", b"a longer context", b"mid size"]
    with torch.no_grad():
        cache, lens = encode_rows(block, windows, torch.device("cpu"))
        new = torch.tensor([[7, 8, 9]] * 3)
        grown = block.extend_rows(cache, new, lens)
        rows = context_logits(block, grown, row_layouts(lens + 3, 2))
        for i, w in enumerate(windows):
            alone = block.extend_context(block.encode_context(torch.tensor([list(w)])), new[i:i + 1])
            ref = context_logits(block, alone, generation_layout(len(w) + 3, 2))
            assert torch.allclose(rows[i], ref[0], atol=1e-5), (i, (rows[i] - ref[0]).abs().max())


def state(cfg, i, prompt, *, k=8, readout="spec", temperature=1.0, want_logits=True):
    return SegmentState(request_id=f"r{i}", context=prompt, segment=i % 3, k=k, n_steps=7, seed=i,
                        temperature=temperature, z=initial_state(cfg, i, i % 3, k, 7), readout=readout,
                        want_logits=want_logits, first_chunk=len(prompt), use_cache=False)


def test_a_batched_traversal_gives_each_request_its_own_bytes(tiny_cfg):
    """Spec segments of two draft lengths, greedy and sampled, at five context lengths, pool and last
    segments (their sweeps batched) and a commit one, in one traversal: each one's bytes and logits
    as the same chain gives it alone."""
    first = local_chain(blocks_of(tiny_cfg), torch.device("cpu"))
    prompts = [b"The history of", b"a", b"In 1990 the town", b"xyz", b"He was born in the"]
    states = [state(tiny_cfg, i, p, k=8 if i % 2 else 4, temperature=0.0 if i == 2 else 1.0)
              for i, p in enumerate(prompts)]
    states += [state(tiny_cfg, 9, b"pooled", k=8, readout="pool"), state(tiny_cfg, 10, b"the pool", k=8, readout="pool"),
               state(tiny_cfg, 11, b"a last one", k=8, readout="last"), state(tiny_cfg, 12, b"L", k=8, readout="last"),
               state(tiny_cfg, 13, b"x", k=8, readout="pool", temperature=0.0), state(tiny_cfg, 14, b"c", readout="commit")]
    alone = [first.forward(s) for s in states]
    batched = forward_batch(first, states)
    assert len({len(r.new_bytes) for r in alone}) > 1  # drafts were cut at different places
    for a, b in zip(alone, batched):
        assert isinstance(b, SegmentResult)
        assert b.new_bytes == a.new_bytes and b.accepted == a.accepted and b.route == a.route
        assert torch.allclose(b.logits, a.logits, atol=1e-5)


def test_a_refused_request_gets_its_error_and_the_others_go_on(tiny_cfg):
    first = local_chain(blocks_of(tiny_cfg), torch.device("cpu"))
    good = [state(tiny_cfg, i, b"hello", k=8) for i in range(3)]
    bad = dataclasses.replace(good[1], context=b"x" * 30)  # 30 > N − K + 1 = 25 bytes
    out = forward_batch(first, [good[0], bad, good[2]])
    assert isinstance(out[1], InputError) and "at most 25 bytes" in str(out[1])
    assert [r.new_bytes for r in (out[0], out[2])] == [first.forward(s).new_bytes for s in (good[0], good[2])]


class Gate:
    """A first stage that holds its first traversal until `n` more segments wait behind it."""

    def __init__(self, first, n):
        self.first, self.name, self.n = first, first.name, n
        self.batcher: BatchingStage | None = None
        self.sizes: list[int] = []
        self.entered = threading.Event()

    def forward(self, s):
        return self.first.forward(s)

    def forward_batch(self, states):
        if not self.sizes:
            self.entered.set()
            deadline = time.monotonic() + 30
            while len(self.batcher.pending) < self.n and time.monotonic() < deadline:
                time.sleep(0.005)
        self.sizes.append(len(states))
        return forward_batch(self.first, states)


class Timed:
    """A first stage whose every traversal takes `seconds` (no model): it records the batches it got."""

    name = "timed"

    def __init__(self, seconds):
        self.seconds, self.batches = seconds, []

    def forward_batch(self, states):
        self.batches.append(sorted(s.request_id for s in states))
        time.sleep(self.seconds)
        return [SegmentResult(new_bytes=b"x") for _ in states]


def test_a_request_that_missed_one_traversal_rejoins_the_next_and_the_batches_stay_whole():
    """Four requests whose drivers send their next segments 0–30 ms apart; one is held up once, past
    the gather bound but within a traversal.
    The next traversal waits for each request of the last one that goes on (not for as many
    segments as it had: the one already waiting would count for one of them and leave another
    behind, and the batches would stay split), so from then on all four share every traversal."""
    first = Timed(0.12)
    batcher = BatchingStage(first, gather_s=0.04)
    steps, late = 8, 2

    def run(i):
        for j in range(steps):
            time.sleep(0.01 * i)  # each driver takes its own time to send its next segment (all within the bound)
            if i == 0 and j == late:
                time.sleep(0.08)  # past the 0.04 s bound, before the 0.12 s traversal ends
            batcher.forward(SimpleNamespace(request_id=f"r{i}", final=j == steps - 1))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    everyone = ["r0", "r1", "r2", "r3"]
    start = first.batches.index(everyone)  # the first traversal takes whoever came first (none is expected)
    # from there: whole, but for the one traversal r0 missed (and the last, r0 one step behind the rest)
    assert [b for b in first.batches[start:-1] if b != everyone] == [["r1", "r2", "r3"]], first.batches


def test_requests_arriving_during_a_traversal_join_the_next_and_keep_their_settings(tiny_cfg):
    """Four requests with their own K, seed, temperature and length, each from its own thread
    while the first one's traversal runs: they share the next traversals and each gets the bytes
    it gets alone."""
    first = local_chain(blocks_of(tiny_cfg), torch.device("cpu"))
    gate = Gate(first, 4)
    meter = Meter()
    batcher = gate.batcher = BatchingStage(gate, gather_s=0.05, meter=meter)
    asks = [GenerationRequest(b"The history", 6, seed=1), GenerationRequest(b"Once", 12, seed=2, k=4),
            GenerationRequest(b"A", 10, seed=3, temperature=0.0, k=2), GenerationRequest(b"In the", 8, seed=4, k=4),
            GenerationRequest(b"Then", 16, seed=5, readout="pool")]
    alone = [b"".join(r.new_bytes for r in generate(first, tiny_cfg, 3, a)) for a in asks]
    got: dict[int, bytes] = {}

    def run(i):
        got[i] = b"".join(r.new_bytes for r in generate(batcher, tiny_cfg, 3, asks[i]))

    threads = [threading.Thread(target=run, args=(0,))]
    threads[0].start()
    assert gate.entered.wait(30)  # the first traversal runs
    threads += [threading.Thread(target=run, args=(i,)) for i in range(1, 5)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(5)] == alone
    assert gate.sizes[0] == 1 and gate.sizes[1] == 5, gate.sizes  # the four waited, and went with the first's next
    stats = batcher.stats()
    assert stats["largest"] == 5 and stats["segments"] == sum(gate.sizes)
    families = {f.name: f.samples[0].value for f in StageCollector("block", meter).collect() if f.samples}
    assert families["btnode_serve_traversals"] == len(gate.sizes) == stats["traversals"]
    assert families["btnode_serve_batched_segments"] == sum(gate.sizes)


def test_a_failed_traversal_fails_only_its_requests(tiny_cfg):
    class Broken:
        name = "broken"

        def forward_batch(self, states):
            raise RuntimeError("boom")

    batcher = BatchingStage(Broken())
    with pytest.raises(RuntimeError, match="boom"):
        batcher.forward(state(tiny_cfg, 0, b"x"))
    ok = BatchingStage(local_chain(blocks_of(tiny_cfg), torch.device("cpu")))
    assert len(ok.forward(state(tiny_cfg, 0, b"x", k=4)).new_bytes) >= 1


def test_the_same_block_thrice_keeps_every_draft_byte_batched(tiny_cfg):
    """Three copies of one block pool to the draft's own distribution: batched, every draft byte
    is still kept (the batched scoring reads what the batched draft wrote)."""
    one = blocks_of(tiny_cfg)[0]
    first = local_chain([one, copy.deepcopy(one), copy.deepcopy(one)], torch.device("cpu"))
    out = forward_batch(first, [state(tiny_cfg, i, p) for i, p in enumerate([b"ab", b"a prompt", b"q"])])
    assert [r.accepted for r in out] == [8, 8, 8]


def test_a_batched_traversal_extends_the_windows_it_saw_last(tiny_cfg):
    """Spec windows grow by 1 … K bytes a traversal: the second batched traversal extends each row's
    stored stream by its own new bytes (one row already near the N − K + 1 limit, one with many new
    bytes, one never seen), and every row still gets what it gets alone."""
    first = local_chain(blocks_of(tiny_cfg), torch.device("cpu"))
    text = b"The quick brown fox jumps over the lazy dog again"

    def at(i, n, seg):
        s = state(tiny_cfg, i, text[:n], k=8)
        return dataclasses.replace(s, segment=seg, use_cache=True, z=initial_state(tiny_cfg, i, seg, 8, 7))

    one = [at(0, 3, 0), at(1, 20, 0), at(2, 10, 0)]
    assert all(isinstance(r, SegmentResult) for r in forward_batch(first, one))
    two = [at(0, 11, 1), at(1, 25, 1), at(2, 12, 1), at(3, 5, 1)]  # +8, +5 (at the limit), +2, unseen
    got = forward_batch(first, two)
    for s, r in zip(two, got):
        alone = first.forward(dataclasses.replace(s, use_cache=False))
        assert r.new_bytes == alone.new_bytes and torch.allclose(r.logits, alone.logits, atol=1e-5)
    # K = 1 lets a window fill all N = 32 bytes: such a row (7, unseen) has nothing to extend while others do
    full = [dataclasses.replace(at(i, n, 0), k=1, z=initial_state(tiny_cfg, i, 0, 1, 7)) for i, n in ((5, 12), (6, 30))]
    forward_batch(first, full)
    text = text[:40]
    full = [dataclasses.replace(at(i, n, 1), k=1, z=initial_state(tiny_cfg, i, 1, 1, 7)) for i, n in ((5, 20), (6, 32), (7, 32))]
    for s, r in zip(full, forward_batch(first, full)):
        assert isinstance(r, SegmentResult), r
        assert r.new_bytes == first.forward(dataclasses.replace(s, use_cache=False)).new_bytes
    final = [dataclasses.replace(s, final=True) for s in two + full]
    forward_batch(first, final)
    from btnode.serve.batching import spec_contexts
    assert len(spec_contexts(first).entries) == 0  # dropped after each request's last segment
