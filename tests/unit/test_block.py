"""The block's attention pattern, tested by perturbation (design §2.4), and its cache path."""

import dataclasses

import pytest
import torch

from btnode.model.block import DiffusionBlock
from btnode.model.config import ModelConfig
from btnode.model.layout import eval_layout, generation_layout, window_layout
from btnode.model.targets import target_table


def randomized(cfg, seed=0) -> DiffusionBlock:
    """A block whose every parameter is random, so that AdaLN-zero gates do not hide any path."""
    torch.manual_seed(seed)
    blk = DiffusionBlock(cfg)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0, 0.3)
    return blk.eval()


def test_target_table_is_fixed_unit_norm_and_seeded(tiny_cfg):
    e = target_table(tiny_cfg)
    assert e.shape == (256, tiny_cfg.d_model) and e.dtype == torch.float32
    assert torch.allclose(e.norm(dim=1), torch.ones(256), atol=1e-6)
    assert torch.equal(e, target_table(tiny_cfg))
    assert not torch.equal(e, target_table(type(tiny_cfg)(**{**tiny_cfg.to_dict(), "target_seed": 1,
                                                                  "segments": tiny_cfg.segments})))


def test_block_shares_nothing_with_the_target_table(tiny_cfg):
    blk = DiffusionBlock(tiny_cfg)
    e = target_table(tiny_cfg)
    assert all(p.shape != e.shape or not torch.equal(p, e) for p in blk.parameters())


@pytest.mark.parametrize("k", [1, 8])
def test_bytes_after_context_end_do_not_change_a_row(tiny_cfg, k):
    """Changing any clean byte x_j with j > c(t) leaves row t's logits bit-identical, while changing
    a byte at or before c(t) changes them (so the test can fail)."""
    n = tiny_cfg.context
    blk = randomized(tiny_cfg)
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, 256, (1, n), generator=g)
    z = torch.randn(1, n, tiny_cfg.d_model, generator=g)
    sigma = torch.tensor([2.0])
    layout = window_layout(n, k, phase=3 % k)
    with torch.no_grad():
        base = blk(ctx, z, sigma, layout)[0]
        for t in [0, 5, 13, n // 2, n - 2]:
            c = int(layout.context_end[t])
            later = ctx.clone()
            later[0, c + 1:] = (later[0, c + 1:] + 1 + torch.randint(0, 254, (n - c - 1,), generator=g)) % 256
            assert torch.equal(blk(later, z, sigma, layout)[0, t], base[t]), f"row {t} saw bytes after c={c}"
            earlier = ctx.clone()
            earlier[0, c] = (earlier[0, c] + 1) % 256
            assert not torch.equal(blk(earlier, z, sigma, layout)[0, t], base[t])


@pytest.mark.parametrize("k", [1, 8])
def test_rows_see_only_their_own_segment(tiny_cfg, k):
    n = tiny_cfg.context
    blk = randomized(tiny_cfg)
    g = torch.Generator().manual_seed(2)
    ctx = torch.randint(0, 256, (1, n), generator=g)
    z = torch.randn(1, n, tiny_cfg.d_model, generator=g)
    sigma = torch.tensor([3.0])
    layout = window_layout(n, k, phase=0)
    with torch.no_grad():
        base = blk(ctx, z, sigma, layout)[0]
        t = n // 2 + 1
        other = layout.segment != layout.segment[t]
        z2 = z.clone()
        z2[0, other] += torch.randn(int(other.sum()), tiny_cfg.d_model, generator=g)
        assert torch.equal(blk(ctx, z2, sigma, layout)[0, t], base[t])
        same = (layout.segment == layout.segment[t]).nonzero()[:, 0]
        if k > 1:  # a segment is denoised jointly: its other rows matter
            z3 = z.clone()
            z3[0, int(same[same != t][0])] += 1.0
            assert not torch.equal(blk(ctx, z3, sigma, layout)[0, t], base[t])


def test_clean_cache_and_subset_rows_match_the_full_window(tiny_cfg):
    """Scoring only rows [N/2, N) with a cached context gives the full window's logits there."""
    n = tiny_cfg.context
    blk = randomized(tiny_cfg)
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(0, 256, (2, n), generator=g)
    z = torch.randn(2, n, tiny_cfg.d_model, generator=g)
    sigma = torch.tensor([1.5, 4.0])
    k = 8
    sub = eval_layout(n, k)
    full = window_layout(n, k, phase=(n // 2) % k)
    with torch.no_grad():
        a = blk(ctx, z, sigma, full)[:, n // 2:]
        cache = blk.encode_context(ctx)
        b = blk.denoise(z[:, n // 2:], sigma, cache, sub)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_generation_layout_equals_the_window_rows_it_stands_for(tiny_cfg):
    n, k, p = tiny_cfg.context, 8, 11
    blk = randomized(tiny_cfg)
    g = torch.Generator().manual_seed(4)
    ctx = torch.randint(0, 256, (1, n), generator=g)
    z = torch.randn(1, n, tiny_cfg.d_model, generator=g)
    sigma = torch.tensor([2.5])
    full = window_layout(n, k, phase=(p - 1) % k)  # a segment starts at row p − 1
    with torch.no_grad():
        a = blk(ctx, z, sigma, full)[:, p - 1:p - 1 + k]
        b = blk.denoise(z[:, p - 1:p - 1 + k], sigma, blk.encode_context(ctx[:, :p]), generation_layout(p, k))
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rank", [0, 4])
def test_sigma_conditions_every_layer(tiny_cfg, rank):
    tiny_cfg = dataclasses.replace(tiny_cfg, ada_rank=rank)
    blk = randomized(tiny_cfg)
    width = rank or tiny_cfg.d_model
    for layer in blk.layers:  # each layer's modulation is a function of σ
        s1, s2 = torch.randn(1, width), torch.randn(1, width)
        assert not torch.equal(layer.ada(s1), layer.ada(s2))
    ctx = torch.randint(0, 256, (1, tiny_cfg.context))
    z = torch.randn(1, tiny_cfg.context, tiny_cfg.d_model)
    lay = window_layout(tiny_cfg.context, 1, 0)
    with torch.no_grad():
        assert not torch.equal(blk(ctx, z, torch.tensor([1.0]), lay), blk(ctx, z, torch.tensor([1.01]), lay))


def test_a_low_rank_sigma_path_costs_what_the_config_says(tiny_cfg):
    """--ada-rank r: the σ-embedding is r wide and each AdaLN map reads it, so the σ path shrinks from
    d·(6L + 3)·d to r·(6L + 2)·d (plus biases and the sinusoidal layer), and nothing else changes."""
    d, n_l, r, f = tiny_cfg.d_model, tiny_cfg.n_layers, 4, 128  # f: SIGMA_FEATURES

    def sigma_path(w: int) -> int:
        return (f * w + w) + (w * w + w) + n_l * (w * 6 * d + 6 * d) + (w * 2 * d + 2 * d)

    full = sum(p.numel() for p in DiffusionBlock(tiny_cfg).parameters())
    low = sum(p.numel() for p in DiffusionBlock(dataclasses.replace(tiny_cfg, ada_rank=r)).parameters())
    assert full - low == sigma_path(d) - sigma_path(r) > 0


# ModelConfig.ctx_head and TrainConfig.noisy_rows (issue #42)

def test_the_clean_head_reads_only_the_bytes_up_to_its_position(tiny_cfg):
    """The clean stream's head at position j predicts x_{j+1} from x_0..x_j: changing a later byte leaves its
    logits bit-identical, changing x_j changes them."""
    cfg = dataclasses.replace(tiny_cfg, ctx_head=1)
    blk = randomized(cfg)
    n = cfg.context
    g = torch.Generator().manual_seed(2)
    ctx = torch.randint(0, 256, (1, n), generator=g)
    with torch.no_grad():
        base = blk.clean_logits(blk.encode_context(ctx).out)[0]
        for j in [0, 7, n // 2, n - 2]:
            later = ctx.clone()
            later[0, j + 1:] = (later[0, j + 1:] + 1) % 256
            assert torch.equal(blk.clean_logits(blk.encode_context(later).out)[0, j], base[j])
            now = ctx.clone()
            now[0, j] = (now[0, j] + 1) % 256
            assert not torch.equal(blk.clean_logits(blk.encode_context(now).out)[0, j], base[j])


def test_the_context_readout_uses_the_clean_head_where_a_row_follows_its_context(tiny_cfg):
    from btnode.model.sampler import context_logits

    cfg = dataclasses.replace(tiny_cfg, ctx_head=1)
    blk = randomized(cfg)
    n = cfg.context
    ctx = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = blk.encode_context(ctx)
        clean = blk.clean_logits(cache.out)  # (2, n, V): row j predicts x_{j+1}
        k1 = eval_layout(n, 1)
        assert torch.equal(context_logits(blk, cache, k1), clean[:, k1.positions])
        k8 = eval_layout(n, 8)  # rows past their context's end still read the noisy stream at z = 0
        got = context_logits(blk, cache, k8)
        first = k8.offsets == 0
        assert torch.equal(got[:, first], clean[:, k8.positions[first]])
        sigma = torch.full((2,), cfg.sigma_hi)
        z0 = blk.denoise(torch.zeros(2, len(k8.positions), cfg.d_model), sigma, cache, k8)
        assert torch.equal(got[:, ~first], z0[:, ~first]) and not torch.equal(got[:, first], z0[:, first])


def test_a_block_without_the_clean_head_keeps_its_fingerprint(tiny_cfg):
    """The head is the default now; a model stored before the field existed (no "ctx_head" in its dict)
    reads back as the head-less model it is, with the fingerprint it had."""
    assert tiny_cfg.ctx_head == 1 and tiny_cfg.to_dict()["ctx_head"] == 1
    without = dataclasses.replace(tiny_cfg, ctx_head=0)
    old = without.to_dict()
    assert "ctx_head" not in old and without.fingerprint() != tiny_cfg.fingerprint()
    assert ModelConfig.from_dict(old) == without and ModelConfig.from_dict(old).fingerprint() == without.fingerprint()
    assert ModelConfig.from_dict(tiny_cfg.to_dict()) == tiny_cfg


def test_an_ar_run_has_no_clean_head(tiny_cfg):
    ar = ModelConfig.from_flags({"model": "ar", "d_model": 32, "heads": 2})
    assert ar.ctx_head == 0 and "ctx_head" not in ar.to_dict()
    assert dataclasses.replace(ar, ctx_head=1).ctx_head == 0


@pytest.mark.parametrize("k", [1, 8])
def test_a_noisy_row_subset_is_whole_segments(tiny_cfg, k):
    from btnode.train.trainers import segment_subset

    full = window_layout(tiny_cfg.context, k, phase=1 % k)
    part = segment_subset(full, 0.5, torch.Generator().manual_seed(0))
    segs = torch.unique(full.segment)
    kept = torch.unique(part.segment)
    assert len(kept) == round(0.5 * len(segs))
    for s in kept:  # every kept segment whole, with its own context end
        assert torch.equal(part.positions[part.segment == s], full.positions[full.segment == s])
        assert torch.equal(part.context_end[part.segment == s], full.context_end[full.segment == s])
    assert bool((part.positions[1:] > part.positions[:-1]).all())


def test_a_step_on_half_the_noisy_rows_trains_on_those_rows_alone(tiny_cfg):
    """With noisy_rows < 1 the loss covers only the rows drawn (and with the clean head, all N clean
    positions): a step runs, updates the model, and replays bit-exactly from the same seed."""
    from btnode.store.models import init_block
    from btnode.train.config import TrainConfig
    from btnode.train.trainers import BlockTrainer

    cfg = dataclasses.replace(tiny_cfg, ctx_head=1)
    x = torch.randint(0, 256, (4, cfg.context + 1), generator=torch.Generator().manual_seed(4))

    def run() -> tuple[list[float], torch.Tensor]:
        tr = BlockTrainer(init_block(cfg, 0, 0), TrainConfig(batch=4, noisy_rows=0.5), block=0,
                          table=target_table(cfg), device=torch.device("cpu"))
        losses = [tr.train_step(x, 0).loss for _ in range(3)]
        return losses, tr.model.ctx_head.weight.detach().clone()

    a, b = run(), run()
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    assert all(torch.isfinite(torch.tensor(a[0])))
    fresh = init_block(cfg, 0, 0).ctx_head.weight
    assert not torch.equal(a[1], fresh)  # the clean head is trained
