import pytest

from btnode.errors import ConfigError, ConfigMismatchError
from btnode.model.config import ModelConfig


def test_fingerprint_changes_with_every_swarm_wide_field():
    base = ModelConfig()
    variants = [dict(d_model=64), dict(n_heads=2), dict(n_layers=3), dict(n_blocks=4), dict(context=64),
                dict(mlp_ratio=2), dict(sigma_lo=0.5), dict(sigma_hi=20.0), dict(p_mean=-1.0), dict(p_std=1.0),
                dict(gamma=0.2), dict(sigma_data=1.0), dict(target_seed=1), dict(segments=(1, 32)), dict(ada_rank=16)]
    prints = {ModelConfig(**v).fingerprint() for v in variants}
    assert base.fingerprint() not in prints and len(prints) == len(variants)


def test_mismatch_names_the_differing_fields():
    with pytest.raises(ConfigMismatchError) as err:
        ModelConfig().require_same(ModelConfig(d_model=64, n_heads=4, segments=(1, 32)), "peer")
    names = [f for f, _, _ in err.value.fields]
    assert names == ["d_model", "segments"]
    assert "d_model: expected 128, got 64" in str(err.value)


@pytest.mark.parametrize("bad", [dict(d_model=30, n_heads=4), dict(segments=(16,)), dict(segments=(1, 500)),
                                 dict(sigma_lo=10.0, sigma_hi=1.0), dict(vocab=512), dict(context=1),
                                 dict(ada_rank=-1)])
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


def test_a_model_without_tail_keeps_its_fingerprint_and_a_tail_changes_it():
    # the fingerprint of a tail-less model is the one it had before tail blocks existed
    assert ModelConfig().fingerprint() == ModelConfig(tail_blocks=0, sigma_gen=0.2).fingerprint()
    assert "tail_blocks" not in ModelConfig().to_dict()
    tailed = ModelConfig(tail_blocks=1)
    assert tailed.fingerprint() != ModelConfig().fingerprint()
    assert tailed.fingerprint() != ModelConfig(tail_blocks=1, sigma_gen=0.2).fingerprint()
    assert ModelConfig.from_dict(tailed.to_dict()) == tailed
    assert [f for f, _, _ in ModelConfig().diff(tailed)] == ["tail_blocks"]
    assert tailed.total_blocks == 4 and tailed.is_tail(3) and not tailed.is_tail(2)


@pytest.mark.parametrize("bad", [dict(tail_blocks=-1), dict(tail_blocks=1, sigma_gen=1.0),
                                 dict(tail_blocks=1, sigma_gen=0.0)])
def test_invalid_tails_are_refused(bad):
    with pytest.raises(ConfigError):
        ModelConfig(**bad)


def test_full_rank_adaln_keeps_its_fingerprint_and_a_low_rank_changes_it():
    # checkpoints and swarms made before --ada-rank existed are full rank and keep their fingerprint
    assert "ada_rank" not in ModelConfig().to_dict()
    low = ModelConfig(ada_rank=16)
    assert low.to_dict()["ada_rank"] == 16 and ModelConfig.from_dict(low.to_dict()) == low
    assert low.fingerprint() != ModelConfig().fingerprint()
    assert [f for f, _, _ in ModelConfig().diff(low)] == ["ada_rank"]


def test_to_flags_round_trips_through_the_cli_builder():
    from btnode_cli.options import model_config

    for cfg in (ModelConfig(), ModelConfig(d_model=64, n_heads=2, n_layers=1, n_blocks=4, context=64, segments=(1, 8),
                                           target_seed=3, tail_blocks=1, sigma_gen=0.2, ada_rank=8),
                ModelConfig(kind="ar", ar_layers=6)):
        flags = cfg.to_flags()
        pairs = dict(zip(flags[::2], flags[1::2]))
        again = model_config(d_model=int(pairs["--d-model"]), heads=int(pairs["--heads"]), layers=int(pairs["--layers"]),
                             blocks=int(pairs["--blocks"]), context=int(pairs["--context"]), segments=pairs["--segments"],
                             target_seed=int(pairs["--target-seed"]), tail_blocks=int(pairs["--tail-blocks"]),
                             sigma_gen=float(pairs["--sigma-gen"]), ada_rank=int(pairs["--ada-rank"]),
                             model=pairs["--model"],
                             ar_layers=int(pairs["--ar-layers"]) if "--ar-layers" in pairs else None)
        assert again == cfg


def test_to_flags_refuses_a_field_no_flag_sets():
    with pytest.raises(ConfigError, match="sigma_hi"):
        ModelConfig(sigma_hi=12.0).to_flags()
