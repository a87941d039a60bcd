import math

import pytest
import torch

from btnode.model import noise
from btnode.model.config import ModelConfig


def test_partition_boundaries_for_three_blocks():
    s = noise.partition(ModelConfig(n_blocks=3))
    assert s == pytest.approx([10.0, 2.0711, 1.3436, 1.0], abs=1e-3)


def test_partition_cells_have_equal_probability():
    cfg = ModelConfig(n_blocks=5)
    q = [noise._q(cfg, s) for s in noise.partition(cfg)]
    widths = [a - b for a, b in zip(q, q[1:])]
    assert widths == pytest.approx([widths[0]] * 5, rel=1e-9)
    assert noise.partition(cfg) == sorted(noise.partition(cfg), reverse=True)


def test_training_interval_is_widened_by_gamma_and_clamped():
    cfg = ModelConfig(n_blocks=3)
    s = noise.partition(cfg)
    lo, hi = noise.train_interval(cfg, 1)
    alpha = (s[1] / s[2]) ** 0.1
    assert lo == pytest.approx(s[2] / alpha) and hi == pytest.approx(s[1] * alpha)
    assert noise.train_interval(cfg, 0)[1] == 10.0  # clamped to σ_hi
    assert noise.train_interval(cfg, 2)[0] == 1.0  # clamped to σ_lo


def test_sigma_samples_stay_in_the_block_interval_and_follow_the_density():
    cfg = ModelConfig(n_blocks=3)
    g = torch.Generator().manual_seed(0)
    for b in range(3):
        lo, hi = noise.train_interval(cfg, b)
        s = noise.sample_sigma(cfg, b, 20_000, g)
        assert float(s.min()) >= lo * (1 - 1e-6) and float(s.max()) <= hi * (1 + 1e-6)
    # block 0 spans the density's tail: most samples sit near its low end, not uniformly in ln σ
    s0 = noise.sample_sigma(cfg, 0, 20_000, g)
    lo, hi = noise.train_interval(cfg, 0)
    assert float((s0 < math.sqrt(lo * hi)).float().mean()) > 0.75


def test_loss_weight_matches_edm_and_is_clamped():
    cfg = ModelConfig()
    lam = noise.loss_weight(cfg, torch.tensor([1.0, 10.0, 0.01]))
    assert lam[0].item() == pytest.approx(5.0)
    assert lam[1].item() == pytest.approx(100.25 / 25)
    assert lam[2].item() == noise.LAMBDA_MAX


def test_grid_is_descending_phi_spaced_and_hits_the_boundaries():
    cfg = ModelConfig(n_blocks=3)
    grid = noise.sigma_grid(cfg, 7)
    assert grid[0] == 10.0 and grid[-1] == 1.0 and grid == sorted(grid, reverse=True)
    q = [noise._q(cfg, s) for s in grid]
    steps = [a - b for a, b in zip(q, q[1:])]
    assert steps == pytest.approx([steps[0]] * 6, rel=1e-9)
    s = noise.partition(cfg)
    assert grid[2] == pytest.approx(s[1]) and grid[4] == pytest.approx(s[2])


@pytest.mark.parametrize("n_blocks,n_steps", [(3, 4), (3, 7), (3, 9), (4, 9), (2, 3), (5, 6), (3, 50)])
def test_route_by_index_calls_every_block_in_order(n_blocks, n_steps):
    r = noise.route(n_blocks, n_steps)
    assert r == sorted(r)  # noisiest block first, last block last
    assert set(r) == set(range(n_blocks))
    assert r[-1] == n_blocks - 1


def test_route_for_three_blocks_seven_points():
    assert noise.route(3, 7) == [0, 0, 1, 1, 2, 2, 2]


def test_tail_blocks_train_below_sigma_lo_with_equal_mass():
    cfg = ModelConfig(n_blocks=3, tail_blocks=2, sigma_gen=0.1)
    t = noise.tail_partition(cfg)
    assert t[0] == cfg.sigma_lo and t[-1] == cfg.sigma_gen and t == sorted(t, reverse=True)
    q = [noise._q(cfg, s) for s in t]
    assert q[0] - q[1] == pytest.approx(q[1] - q[2], rel=1e-9)
    lo3, hi3 = noise.train_interval(cfg, 3)
    lo4, hi4 = noise.train_interval(cfg, 4)
    assert hi3 == cfg.sigma_lo and lo4 == cfg.sigma_gen and lo3 < t[1] < hi4  # widened cells overlap
    g = torch.Generator().manual_seed(0)
    s = noise.sample_sigma(cfg, 4, 4096, g)
    assert float(s.min()) >= lo4 - 1e-6 and float(s.max()) <= hi4 + 1e-6
    with pytest.raises(ValueError):
        noise.train_interval(cfg, 5)
    assert noise.tail_partition(ModelConfig()) == []


def test_generation_grid_continues_below_sigma_lo_and_routes_to_the_tail():
    cfg = ModelConfig(n_blocks=3, tail_blocks=2, sigma_gen=0.1)
    grid = noise.generation_grid(cfg, 7, 4)
    assert grid[:7] == noise.sigma_grid(cfg, 7) and grid[-1] == cfg.sigma_gen and len(grid) == 11
    assert grid == sorted(grid, reverse=True) and len(set(grid)) == len(grid)
    assert noise.generation_route(cfg, 7, 4) == [0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    assert noise.generation_route(cfg, 7, 0) == noise.route(3, 7)
    with pytest.raises(ValueError):
        noise.generation_route(cfg, 7, 1)  # one tail step cannot visit two tail blocks
    with pytest.raises(ValueError):
        noise.tail_grid(ModelConfig(), 3)  # no tail blocks
