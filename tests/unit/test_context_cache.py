"""Stage-side context caches: the chunked encoding, exactness with and without the cache across
window restarts, rebuilding after a miss or a stale entry, bounds under hostile request ids, and
the request checks that come with them."""

import dataclasses
import threading

import pytest
import torch

from btnode.errors import ConfigError, InputError
from btnode.model.block import DiffusionBlock
from btnode.serve.context_cache import ContextCacheConfig, cache_bytes, encode_window
from btnode.model.readout import Readout
from btnode.serve.driver import generate
from btnode.serve.request import GenerationRequest
from btnode.serve.stages import MAX_STEPS, LocalBlockStage, SegmentState, check_request, local_chain, max_prompt
from btnode.serve.window import keep_bytes

CPU = torch.device("cpu")
OFF = ContextCacheConfig(max_bytes=0)


@pytest.fixture
def blocks(tiny_cfg):
    torch.manual_seed(5)
    return [DiffusionBlock(tiny_cfg).eval() for _ in range(tiny_cfg.n_blocks)]


class Recorder:
    """The first stage seen through a wrapper: records every state and can run a hook before it."""

    def __init__(self, inner, hook=None):
        self.inner, self.hook, self.name = inner, hook, "recorder"
        self.states: list[SegmentState] = []

    def forward(self, state):
        if self.hook is not None:
            self.hook(len(self.states), state)
        self.states.append(state)
        return self.inner.forward(state)


def run(first, cfg, prompt=b"Hello", **kw):
    kw = {"n_bytes": 60, "k": 8, "n_steps": 7, "seed": 1, "temperature": 1.0, "want_logits": True, **kw}
    return list(generate(first, cfg, cfg.n_blocks, GenerationRequest(prompt, **{"readout": None if kw.get("n_tail") else "pool", **kw})))  # a sweep


def same(a, b) -> bool:
    return (b"".join(r.new_bytes for r in a) == b"".join(r.new_bytes for r in b)
            and all(torch.equal(x.logits, y.logits) for x, y in zip(a, b, strict=True)))


@torch.no_grad()
def test_a_chunked_encoding_equals_the_one_shot_encoding_up_to_rounding(tiny_cfg, blocks):
    block = blocks[0]
    window = bytes(range(60, 60 + 29))
    one_shot = block.encode_context(torch.tensor(list(window))[None])
    first = block.encode_context(torch.tensor(list(window[:5]))[None])
    before = [(k.clone(), v.clone()) for k, v in first.kv]
    chunked = encode_window(block, window, 5, 8, CPU, prefix=first)
    assert chunked.n_clean == 29 and torch.allclose(chunked.out, one_shot.out, atol=1e-5)
    for (k, v), (k1, v1), (k0, v0) in zip(chunked.kv, one_shot.kv, before):
        assert torch.allclose(k, k1, atol=1e-5) and torch.allclose(v, v1, atol=1e-5)
        assert torch.equal(k[:, :, :5], k0) and torch.equal(v[:, :, :5], v0)  # the prefix is kept as it was
    assert all(torch.equal(k, k0) for (k, _), (k0, _) in zip(first.kv, before))  # and not written to
    assert torch.equal(encode_window(block, window, 5, 8, CPU).out, chunked.out)  # replay: the same bits


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_cache_changes_no_bit_across_window_restarts(tiny_cfg, blocks, k, temperature):
    cached = local_chain(blocks, CPU)
    seen = Recorder(cached)
    kw = dict(k=k, temperature=temperature, n_bytes=40 if k == 1 else 60)
    on = run(seen, tiny_cfg, **kw)
    limit, keep = max_prompt(tiny_cfg.context, k), keep_bytes(max_prompt(tiny_cfg.context, k), tiny_cfg.context)
    assert any(s.first_chunk == keep and s.segment > 0 for s in seen.states)  # the window restarted
    assert all(len(s.context) <= limit and (len(s.context) - s.first_chunk) % k == 0 for s in seen.states)
    stage, hits = cached, []
    while stage is not None:  # every stage extended its cache, and dropped it after the last segment
        hits.append(stage.contexts.hits)
        assert len(stage.contexts) == 0 and stage.contexts.nbytes == 0
        stage = stage.next
    assert min(hits) >= len(seen.states) // 2, hits
    assert same(on, run(local_chain(blocks, CPU, OFF), tiny_cfg, **kw))
    assert same(on, run(local_chain(blocks, CPU), tiny_cfg, **kw, use_cache=False))


def test_a_stage_that_lost_its_cache_or_holds_a_stale_one_rebuilds_it(tiny_cfg, blocks):
    """A spare after a re-route (empty cache) and an entry that no longer matches the window
    (another request under the same id, a different first chunk) give the same bytes."""
    ref = run(local_chain(blocks, CPU, OFF), tiny_cfg, k=1, n_bytes=40)
    first = local_chain(blocks, CPU)
    second = first.next

    def meddle(i, state):
        rid = state.request_id
        if i == 5:
            second.contexts.drop(rid)
        elif i == 12:  # stale bytes under this id
            junk = bytes(len(state.context))
            second.contexts.store(rid, junk, state.first_chunk, 1, encode_window(blocks[1], junk, state.first_chunk, 1, CPU))
        elif i == 20:  # the same bytes encoded with another first chunk: not this window's canonical form
            second.contexts.store(rid, state.context, 1, 1, encode_window(blocks[1], state.context, 1, 1, CPU))

    assert same(run(Recorder(first, meddle), tiny_cfg, k=1, n_bytes=40), ref)
    assert second.contexts.misses >= 4  # the first segment, and the three above


def test_concurrent_requests_are_exact_even_when_they_share_an_id(tiny_cfg, blocks):
    prompts = [b"Hello", b"The history of", b"x", b"Hello"]
    refs = [run(local_chain(blocks, CPU, OFF), tiny_cfg, p, k=1, n_bytes=16) for p in prompts]
    first = local_chain(blocks, CPU)
    out: dict[int, list] = {}
    ids = ["a", "b", "shared", "shared"]  # two requests under one id evict each other's entries

    def worker(i):
        out[i] = run(first, tiny_cfg, prompts[i], k=1, n_bytes=16, request_id=ids[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(same(out[i], refs[i]) for i in range(len(prompts)))


@pytest.mark.parametrize("bounds", [dict(max_bytes=100_000, max_entries=1000), dict(max_bytes=1 << 30, max_entries=8)])
def test_a_flood_of_request_ids_keeps_the_cache_within_its_bounds(tiny_cfg, blocks, bounds):
    last = LocalBlockStage(blocks[2], 2, 3, context_cache=ContextCacheConfig(**bounds))
    entry = None
    for i in range(200):
        state = SegmentState(request_id=f"hostile-{i:06d}-" + "x" * 100, context=bytes([i % 256]) * 25, segment=0,
                             k=8, n_steps=7, seed=i, temperature=1.0, z=torch.zeros(8, tiny_cfg.d_model), first_chunk=9,
                             readout=Readout.LAST)
        assert len(last.forward(state).new_bytes) == 8
        entry = entry or last.contexts.nbytes
        assert len(last.contexts) <= bounds["max_entries"] and last.contexts.nbytes <= bounds["max_bytes"]
    assert last.contexts.evictions >= 200 - min(bounds["max_entries"], bounds["max_bytes"] // entry)
    assert entry >= cache_bytes(encode_window(blocks[2], bytes(25), 9, 8, CPU))  # counts what the tensors hold
    with pytest.raises(InputError, match="request id of 129 characters"):
        last.forward(dataclasses.replace(state, request_id="y" * 129))
    tiny = LocalBlockStage(blocks[2], 2, 3, context_cache=ContextCacheConfig(max_bytes=1000))  # over budget: never kept
    tiny.forward(state)
    assert len(tiny.contexts) == 0 and tiny.contexts.nbytes == 0
    with pytest.raises(ConfigError):
        ContextCacheConfig(max_bytes=-1)


def test_steps_and_chunks_are_bounded(tiny_cfg, blocks):
    check_request(tiny_cfg, 3, b"hi", 8, MAX_STEPS)
    with pytest.raises(InputError, match=f"at most {MAX_STEPS}"):
        check_request(tiny_cfg, 3, b"hi", 8, MAX_STEPS + 1)
    with pytest.raises(InputError, match="at most 256"):
        run(local_chain(blocks, CPU), tiny_cfg, n_steps=10**9)
    with pytest.raises(InputError, match="request id of 200 characters"):
        run(local_chain(blocks, CPU), tiny_cfg, request_id="r" * 200)
    first = local_chain(blocks, CPU)
    base = SegmentState(request_id="r", context=b"0123456789", segment=0, k=8, n_steps=7, seed=0, temperature=0.0,
                        z=torch.zeros(8, tiny_cfg.d_model), readout=Readout.LAST)
    for chunk, match in ((11, "first chunk must be 1…10 bytes"), (3, "not whole segments of K=8")):
        with pytest.raises(InputError, match=match):
            first.forward(dataclasses.replace(base, first_chunk=chunk))
    with pytest.raises(InputError, match=f"at most {MAX_STEPS}"):
        first.forward(dataclasses.replace(base, n_steps=MAX_STEPS + 1))
    assert len(first.forward(dataclasses.replace(base, first_chunk=2)).new_bytes) == 8
    assert len(first.forward(base).new_bytes) == 8  # no first chunk: the whole context is one
