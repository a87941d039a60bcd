import pytest
import torch

from btnode.aggregate.sums.averaging import OuterConfig, OuterOptimizer, combine, median, trimmed_mean, weighted_mean
from btnode.errors import ConfigError


def deltas(*values):
    return [{"w": torch.tensor(v, dtype=torch.float32)} for v in values]


def test_weighted_mean_uses_the_weights():
    out = weighted_mean(deltas([0.0, 2.0], [4.0, 6.0]), [1.0, 3.0])
    assert torch.allclose(out["w"], torch.tensor([3.0, 5.0]))


def test_trimmed_mean_and_median_ignore_an_outlier():
    ds = deltas([1.0], [1.2], [0.8], [1000.0], [1.1])
    assert trimmed_mean(ds, 0.2)["w"].item() == pytest.approx(1.1)
    assert median(ds)["w"].item() == pytest.approx(1.1)
    assert median(deltas([1.0], [3.0], [100.0], [2.0]))["w"].item() == pytest.approx(2.5)


def test_robust_modes_need_three_updates():
    ds = deltas([0.0], [10.0])
    out, rule = combine(ds, [1.0, 1.0], OuterConfig(robust="median"))
    assert rule == "mean" and out["w"].item() == 5.0
    _, rule = combine(deltas([0.0], [1.0], [2.0]), [1, 1, 1], OuterConfig(robust="median"))
    assert rule == "median"


def test_outer_step_plain_and_nesterov():
    plain = OuterOptimizer(OuterConfig(lr=0.5))
    assert plain.step({"w": torch.tensor([2.0])})["w"].item() == 1.0
    nest = OuterOptimizer(OuterConfig(lr=0.7, momentum=0.9))
    s1 = nest.step({"w": torch.tensor([1.0])})["w"].item()
    s2 = nest.step({"w": torch.tensor([1.0])})["w"].item()
    assert s1 == pytest.approx(0.7 * (1 + 0.9 * 1)) and s2 == pytest.approx(0.7 * (1 + 0.9 * 1.9))
    state = nest.state_dict()
    again = OuterOptimizer(OuterConfig(lr=0.7, momentum=0.9))
    again.load_state_dict(state)
    assert again.step({"w": torch.tensor([1.0])})["w"].item() == nest.step({"w": torch.tensor([1.0])})["w"].item()


def test_invalid_outer_config():
    with pytest.raises(ConfigError):
        OuterConfig(robust="mode")
    with pytest.raises(ConfigError):
        OuterConfig(momentum=1.0)


def test_the_default_is_the_screened_weighted_mean():
    assert OuterConfig().robust == "screened"
    out, rule = combine(deltas([0.0], [1.0], [2.0]), [1.0, 1.0, 2.0], OuterConfig())
    assert rule == "screened" and out["w"].item() == pytest.approx(1.25)  # the weights count (the screen ran before)
    _, rule = combine(deltas([0.0], [1.0]), [1.0, 1.0], OuterConfig())
    assert rule == "mean"
