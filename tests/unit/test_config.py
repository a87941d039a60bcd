import pytest

from btnode.errors import ConfigError, ConfigMismatchError
from btnode.model.config import ModelConfig


def test_fingerprint_changes_with_every_swarm_wide_field():
    base = ModelConfig()
    variants = [dict(d_model=64), dict(n_heads=2), dict(n_layers=3), dict(n_blocks=4), dict(context=64),
                dict(mlp_ratio=2), dict(sigma_lo=0.5), dict(sigma_hi=20.0), dict(p_mean=-1.0), dict(p_std=1.0),
                dict(gamma=0.2), dict(sigma_data=1.0), dict(target_seed=1), dict(segments=(1, 32))]
    prints = {ModelConfig(**v).fingerprint() for v in variants}
    assert base.fingerprint() not in prints and len(prints) == len(variants)


def test_mismatch_names_the_differing_fields():
    with pytest.raises(ConfigMismatchError) as err:
        ModelConfig().require_same(ModelConfig(d_model=64, n_heads=4, segments=(1, 32)), "peer")
    names = [f for f, _, _ in err.value.fields]
    assert names == ["d_model", "segments"]
    assert "d_model: expected 128, got 64" in str(err.value)


@pytest.mark.parametrize("bad", [dict(d_model=30, n_heads=4), dict(segments=(16,)), dict(segments=(1, 500)),
                                 dict(sigma_lo=10.0, sigma_hi=1.0), dict(vocab=512), dict(context=1)])
def test_invalid_configs_are_refused(bad):
    with pytest.raises(ConfigError):
        ModelConfig(**bad)


def test_roundtrip_through_dict():
    cfg = ModelConfig(segments=(16, 1, 4))
    assert cfg.segments == (1, 4, 16)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_k_mix_and_context_share_settings():
    from btnode.train.config import TrainConfig

    assert TrainConfig(k1_share=0.9).segment_weights((1, 16)) == [0.9, pytest.approx(0.1)]
    assert TrainConfig(k1_share=0.7).segment_weights((1, 4, 16)) == [0.7, pytest.approx(0.15), pytest.approx(0.15)]
    assert TrainConfig(k1_share=None).segment_weights((1, 16)) == [1.0, 1.0]
    assert TrainConfig(k1_share=0.5).segment_weights((1,)) == [1.0]
    for bad in (dict(k1_share=1.5), dict(k1_share=-0.1), dict(ctx_share=1.0), dict(ctx_share=-0.5)):
        with pytest.raises(ConfigError):
            TrainConfig(**bad)
