"""The one-sweep sampler: Euler on expected embeddings, routed by index, every block called."""

import dataclasses

import pytest
import torch

from btnode.errors import InputError, MalformedInput
from btnode.model.block import DiffusionBlock
from btnode.model.layout import generation_layout
from btnode.model.noise import sigma_grid
from btnode.model.readout import Readout
from btnode.model.sampler import block_denoiser, context_logits, pool, run_span, spans, sweep
from btnode.model.targets import target_table
from btnode.serve.driver import generate
from btnode.serve.readouts import Carry
from btnode.serve.request import GenerationRequest
from btnode.serve.stages import SegmentState, initial_state, local_chain


def test_oracle_denoiser_lands_each_euler_step_on_the_noised_target(tiny_cfg):
    """With D = E[y], step i must give z = E[y] + σ_{i+1}·ε (the EDM sign; a reversed schedule fails)."""
    e = target_table(tiny_cfg)
    grid = sigma_grid(tiny_cfg, 9)
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 256, (2, 5), generator=g)
    eps = torch.randn(2, 5, tiny_cfg.d_model, generator=g)
    oracle_logits = torch.full((2, 5, 256), -1e4).scatter(-1, y[..., None], 1e4)

    def oracle(z, sigma):
        return oracle_logits

    z = e[y] + grid[0] * eps
    for i in range(len(grid) - 1):
        z, logits = run_span(oracle, z, grid, [i], e)
        assert logits is None
        assert torch.allclose(z, e[y] + grid[i + 1] * eps, atol=1e-5), f"step {i}"
    _, logits = run_span(oracle, z, grid, [len(grid) - 1], e)
    assert torch.equal(logits.argmax(-1), y)


class RecordingBlock(DiffusionBlock):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.sigmas = []

    def denoise(self, z, sigma, cache, layout):
        self.sigmas.append(float(sigma[0]))
        return super().denoise(z, sigma, cache, layout)


@pytest.mark.parametrize("n_steps", [4, 7, 10])
def test_sweep_calls_every_block_on_its_own_grid_points(tiny_cfg, n_steps):
    blocks = [RecordingBlock(tiny_cfg).eval() for _ in range(tiny_cfg.n_blocks)]
    grid = sigma_grid(tiny_cfg, n_steps)
    ctx = torch.randint(0, 256, (1, 5))
    caches = [b.encode_context(ctx) for b in blocks]
    z = grid[0] * torch.randn(1, 8, tiny_cfg.d_model)
    sweep(blocks, caches, z, grid, generation_layout(5, 8), target_table(tiny_cfg), readout=Readout.LAST)
    for b, span in zip(blocks, spans(len(blocks), n_steps)):
        assert span and b.sigmas == [pytest.approx(grid[i]) for i in span]
    assert sum(len(b.sigmas) for b in blocks) == n_steps


def drive(first, cfg, n_blocks, prompt, **kw):
    return generate(first, cfg, n_blocks, GenerationRequest(prompt, **{"readout": None if kw.get("n_tail") else "pool", **kw}))  # a sweep


def generate_bytes(blocks, prompt, **kw):
    first = local_chain(blocks, torch.device("cpu"))
    return [r.new_bytes for r in drive(first, blocks[0].cfg, len(blocks), prompt, **kw)]


def test_generate_is_seeded_and_checks_its_request(tiny_cfg):
    torch.manual_seed(0)
    blocks = [DiffusionBlock(tiny_cfg) for _ in range(tiny_cfg.n_blocks)]
    kw = dict(n_bytes=20, k=8, n_steps=7, temperature=0.0)
    a = b"".join(generate_bytes(blocks, b"hello", seed=3, **kw))
    assert len(a) == 20 and a == b"".join(generate_bytes(blocks, b"hello", seed=3, **kw))
    pieces = generate_bytes(blocks, b"hello", seed=3, **{**kw, "temperature": 1.0})
    assert [len(p) for p in pieces] == [8, 8, 4]  # one sweep per segment, the last one cut
    with pytest.raises(InputError, match="at most 25 bytes"):
        generate_bytes(blocks, b"x" * 26, seed=0, **kw)
    with pytest.raises(InputError, match="K=4 was not trained"):
        generate_bytes(blocks, b"hi", seed=0, **{**kw, "k": 4})
    with pytest.raises(InputError, match="2 sampler steps cannot visit all 3 blocks; use at least 3"):
        generate_bytes(blocks, b"hi", seed=0, **{**kw, "n_steps": 2})


@pytest.mark.parametrize("readout", ["last", "pool"])
def test_the_stage_chain_equals_the_plain_sweep(tiny_cfg, readout):
    """Stages running their spans one after another give exactly the sweep's logits and bytes,
    pooled readout included (each stage adds its block's term to what the previous one sent)."""
    torch.manual_seed(1)
    blocks = [DiffusionBlock(tiny_cfg).eval() for _ in range(tiny_cfg.n_blocks)]
    prompt, k, n_steps, seed = b"a prompt", 8, 7, 11
    first = local_chain(blocks, torch.device("cpu"))
    res = next(iter(drive(first, tiny_cfg, 3, prompt, n_bytes=8, k=k, n_steps=n_steps, seed=seed, temperature=0.0,
                          want_logits=True, readout=readout)))
    grid = sigma_grid(tiny_cfg, n_steps)
    x = torch.tensor(list(prompt))[None]
    z = initial_state(tiny_cfg, seed, 0, k, n_steps)[None]
    logits = sweep(blocks, [b.encode_context(x) for b in blocks], z, grid, generation_layout(len(prompt), k),
                   target_table(tiny_cfg), readout=readout)[0]
    assert torch.equal(res.logits, logits) and res.new_bytes == bytes(logits.argmax(-1).tolist())
    assert res.route == ["block-0", "block-1", "block-2"]


def test_the_commit_readout_samples_each_byte_after_the_bytes_before_it(tiny_cfg):
    """Readout "commit": row j is the last block's reading of the sweep's final state at σ_lo with the
    j committed bytes as clean context, pooled with its context readout there; recomputed here from
    scratch (no cache extension, no stage). One traversal per segment."""
    torch.manual_seed(3)
    blocks = [DiffusionBlock(tiny_cfg).eval() for _ in range(tiny_cfg.n_blocks)]
    prompt, k, n_steps, seed = b"a prompt", 8, 7, 5
    first = local_chain(blocks, torch.device("cpu"))
    kw = dict(n_steps=n_steps, seed=seed, want_logits=True)
    res = next(iter(drive(first, tiny_cfg, 3, prompt, n_bytes=k, k=k, temperature=1.0, readout="commit", **kw)))
    assert res.route == ["block-0", "block-1", "block-2"] and len(res.new_bytes) == k
    grid, table = sigma_grid(tiny_cfg, n_steps), target_table(tiny_cfg)
    z = initial_state(tiny_cfg, seed, 0, k, n_steps)[None]
    x = torch.tensor(list(prompt))[None]
    for blk, span in zip(blocks, spans(3, n_steps)):
        steps = span[:-1] if blk is blocks[-1] else span  # the last block: up to its last grid point
        z, _ = run_span(block_denoiser(blk, blk.encode_context(x), generation_layout(len(prompt), k)), z, grid,
                        steps, table)
    last = blocks[-1]
    for j in range(k):
        cache = last.encode_context(torch.tensor(list(prompt + res.new_bytes[:j]))[None])
        row = last.denoise(z[:, j:], torch.full((1,), grid[-1]), cache, generation_layout(len(prompt) + j, k - j))
        own = context_logits(last, cache, generation_layout(len(prompt) + j, 1))
        assert torch.allclose(res.logits[j], pool([own[0], row[0, :1]])[0], atol=1e-4), j
    # another earlier byte changes what the rows after it read: the bytes before a row entered
    plain = next(iter(drive(first, tiny_cfg, 3, prompt, n_bytes=k, k=k, temperature=1.0, readout="last", **kw)))
    assert not torch.allclose(plain.logits[1:], res.logits[1:])
    again = next(iter(drive(first, tiny_cfg, 3, prompt, n_bytes=k, k=k, temperature=1.0, readout="commit", **kw)))
    assert again.new_bytes == res.new_bytes and torch.equal(again.logits, res.logits)  # seeded
    with pytest.raises(InputError, match="readout must be one of"):
        next(iter(drive(first, tiny_cfg, 3, prompt, n_bytes=k, k=k, temperature=1.0, readout="commits", **kw)))


def test_pooled_readout_is_the_mean_log_probability_of_the_context_readouts_and_the_last(tiny_cfg):
    torch.manual_seed(2)
    blocks = [DiffusionBlock(tiny_cfg).eval() for _ in range(tiny_cfg.n_blocks)]
    x = torch.randint(0, 256, (2, 6))
    caches = [b.encode_context(x) for b in blocks]
    layout = generation_layout(6, 8)
    grid = sigma_grid(tiny_cfg, 7)
    z = grid[0] * torch.randn(2, 8, tiny_cfg.d_model)
    table = target_table(tiny_cfg)
    last = sweep(blocks, caches, z, grid, layout, table, readout="last")
    ctx = [context_logits(b, c, layout) for b, c in zip(blocks, caches)]
    pooled = sweep(blocks, caches, z, grid, layout, table, readout="pool")
    want = torch.stack([torch.log_softmax(t, -1) for t in (*ctx, last)]).mean(0)
    assert torch.allclose(pooled, want, atol=1e-5) and torch.equal(pooled, pool([*ctx, last]))
    # the context readout never sees the noise: another z, the same readout
    assert torch.equal(ctx[0], context_logits(blocks[0], caches[0], layout))
    with pytest.raises(ValueError, match="readout must be one of"):
        sweep(blocks, caches, z, grid, layout, table, readout="mean")


def test_a_stage_refuses_a_pooled_state_it_cannot_trust(tiny_cfg):
    blocks = [DiffusionBlock(tiny_cfg).eval() for _ in range(tiny_cfg.n_blocks)]
    second = local_chain(blocks, torch.device("cpu")).next
    base = SegmentState(request_id="r", context=b"hi", segment=0, k=8, n_steps=7, seed=0, temperature=0.0,
                        z=torch.zeros(8, tiny_cfg.d_model), readout="pool")
    for pooled, match in ((None, "missing"), (torch.zeros(8, 3), "expected float32"),
                          (torch.full((8, 256), float("nan")), "finite"), (torch.full((8, 256), 2.0), "finite")):
        with pytest.raises(MalformedInput, match=match):
            second.forward(dataclasses.replace(base, carry=Carry(pool=pooled)))
    with pytest.raises(MalformedInput, match="unexpected"):
        second.forward(dataclasses.replace(base, readout=Readout.LAST, carry=Carry(pool=torch.zeros(8, 256))))
    with pytest.raises(InputError, match="readout must be one of"):
        second.forward(dataclasses.replace(base, readout="avg"))
    assert len(second.forward(dataclasses.replace(base, carry=Carry(pool=torch.full((8, 256), -5.5)))).new_bytes) == 8


@torch.no_grad()
def test_blocks_alone_reads_each_block_on_the_chains_rows(tiny_cfg):
    """Block b alone: the noise reading averages probabilities over seeds of one evaluation at σ_hi,
    the context reading is the CE of its z = 0 readout; both independent of batching and of the
    other blocks."""
    from btnode.evaluation.metrics import _noise, blocks_alone
    from btnode.model.layout import eval_layout

    torch.manual_seed(3)
    blocks = [DiffusionBlock(tiny_cfg).eval() for _ in range(tiny_cfg.n_blocks)]
    w = torch.randint(0, 256, (5, tiny_cfg.context + 1))
    reads = blocks_alone(blocks, w, seeds=[0, 1], device=torch.device("cpu"), batch=2)
    assert [r.block for r in reads] == [0, 1, 2]
    # the same numbers up to float rounding: a batch of 64 rows and batches of 2 may take different
    # GEMM kernels, and the last bit of a sum of nats then differs on some CPUs (seen on this host)
    big = blocks_alone(blocks, w, seeds=[0, 1], device=torch.device("cpu"), batch=64)
    assert [r.block for r in big] == [0, 1, 2]
    for r, b in zip(reads, big):
        assert r.noise == pytest.approx(b.noise, rel=1e-12) and r.context == pytest.approx(b.context, rel=1e-12)
    assert blocks_alone(blocks[1:2], w, seeds=[0, 1], device=torch.device("cpu"))[0].noise == pytest.approx(reads[1].noise)
    layout = eval_layout(tiny_cfg.context, 1)
    b = blocks[2]
    cache = b.encode_context(w[:, :-1])
    tgt = w[:, 1:][:, layout.positions]
    sigma = torch.full((5,), tiny_cfg.sigma_hi)
    q = sum(torch.softmax(b.denoise(tiny_cfg.sigma_hi * _noise(s, torch.arange(5), len(layout.positions),
                                                                tiny_cfg.d_model), sigma, cache, layout).double(), -1)
            for s in (0, 1)) / 2
    want = -torch.log(q.gather(-1, tgt[..., None])).mean()
    assert reads[2].noise == pytest.approx(float(want), rel=1e-9)
    ctx = torch.log_softmax(context_logits(b, cache, layout).double(), -1).gather(-1, tgt[..., None])
    assert reads[2].context == pytest.approx(-float(ctx.mean()), rel=1e-9)
    assert reads[2].best == min(reads[2].noise, reads[2].context)


def test_a_generation_sweep_with_a_tail_runs_the_tail_below_sigma_lo(tiny_cfg):
    from btnode.model.noise import generation_grid
    from btnode.model.sampler import generation_sweep

    cfg = dataclasses.replace(tiny_cfg, tail_blocks=2, sigma_gen=0.1)
    blocks = [RecordingBlock(cfg).eval() for _ in range(cfg.total_blocks)]
    ctx = torch.randint(0, 256, (1, 5))
    caches = [b.encode_context(ctx) for b in blocks]
    layout, table = generation_layout(5, 4), target_table(cfg)
    z = cfg.sigma_hi * torch.randn(1, 4, cfg.d_model, generator=torch.Generator().manual_seed(1))
    grid = generation_grid(cfg, 7, 4)
    logits = generation_sweep(blocks, caches, z, 7, 4, layout, table)
    assert [s for b in blocks for s in b.sigmas] == [pytest.approx(s) for s in grid]
    assert blocks[-1].sigmas[-1] == pytest.approx(cfg.sigma_gen) and len(blocks[-1].sigmas) == 2
    # without tail steps the same call is the plain sweep's "last" readout over the scoring blocks
    plain = sweep(blocks[:cfg.n_blocks], caches[:cfg.n_blocks], z, generation_grid(cfg, 7), layout, table,
                  readout=Readout.LAST)
    assert torch.equal(generation_sweep(blocks[:cfg.n_blocks], caches[:cfg.n_blocks], z, 7, 0, layout, table), plain)
    assert logits.shape == plain.shape
    with pytest.raises(ValueError):
        generation_sweep(blocks[:cfg.n_blocks], caches[:cfg.n_blocks], z, 7, 4, layout, table)  # tail blocks missing


def test_a_chain_with_a_tail_stage_equals_the_generation_sweep_and_checks_tail_requests(tiny_cfg):
    """The tail is one more stage: a request with tail steps goes through it (one traversal, the
    tail's last evaluation read out); one without ends at the last scoring block as before."""
    from btnode.model.sampler import generation_sweep

    cfg = dataclasses.replace(tiny_cfg, tail_blocks=1, sigma_gen=0.1)
    torch.manual_seed(2)
    blocks = [DiffusionBlock(cfg).eval() for _ in range(cfg.total_blocks)]
    first = local_chain(blocks, torch.device("cpu"))
    prompt, k, seed = b"a prompt", 8, 5
    res = next(iter(drive(first, cfg, cfg.n_blocks, prompt, n_bytes=8, k=k, n_steps=7, n_tail=4, seed=seed,
                          temperature=0.0, want_logits=True)))
    x = torch.tensor(list(prompt))[None]
    z = initial_state(cfg, seed, 0, k, 7)[None]
    logits = generation_sweep(blocks, [b.encode_context(x) for b in blocks], z, 7, 4, generation_layout(len(prompt), k),
                              target_table(cfg))[0]
    assert torch.equal(res.logits, logits) and res.route == ["block-0", "block-1", "block-2", "block-3"]
    plain = next(iter(drive(first, cfg, cfg.n_blocks, prompt, n_bytes=8, k=k, n_steps=7, seed=seed, temperature=0.0)))
    assert plain.route == ["block-0", "block-1", "block-2"]  # no tail steps: the tail stage is not visited
    kw = dict(n_bytes=8, k=k, n_steps=7, seed=0, temperature=0.0)
    with pytest.raises(InputError, match="through the tail reads its last evaluation"):
        next(iter(drive(first, cfg, cfg.n_blocks, prompt, n_tail=4, readout="pool", **kw)))
    with pytest.raises(InputError, match="at most|cannot visit"):
        next(iter(drive(first, cfg, cfg.n_blocks, prompt, n_tail=10_000, **kw)))
    with pytest.raises(InputError, match="no tail blocks"):
        next(iter(drive(local_chain(blocks[:3], torch.device("cpu")), tiny_cfg, 3, prompt, n_tail=4, **kw)))
    chain_without_tail = local_chain([DiffusionBlock(cfg).eval() for _ in range(cfg.n_blocks)], torch.device("cpu"))
    with pytest.raises(InputError, match="no tail stage"):
        next(iter(drive(chain_without_tail, cfg, cfg.n_blocks, prompt, n_tail=4, **kw)))
    tail_stage = first.next.next.next
    state = SegmentState(request_id="r", context=prompt, segment=0, k=k, n_steps=7, seed=0, temperature=0.0,
                         z=torch.zeros(k, cfg.d_model), readout=Readout.LAST)
    with pytest.raises(InputError, match="tail block 3 runs only requests with tail steps"):
        tail_stage.forward(state)
