"""A run stopped and resumed from its checkpoints replays the uninterrupted run exactly."""

import json

import torch

from btnode.store.models import load_block
from btnode.train.config import TrainConfig
from btnode.train.loops import LOG_NAME, train_ar, train_blocks

CORPUS = bytes((i * 7 + i // 13) % 256 for i in range(20_000))


def _losses(folder):
    rows = [json.loads(line) for line in (folder / LOG_NAME).read_text().splitlines()]
    return [(r["model"], r["step"], r["loss"]) for r in rows]


def test_resumed_block_run_reproduces_the_uninterrupted_losses(tmp_path, tiny_cfg):
    tc = TrainConfig(steps=6, warmup=2, batch=4, seed=5)
    dev = torch.device("cpu")
    train_blocks(tiny_cfg, tc, CORPUS, tmp_path / "full", device=dev, checkpoint_every=100)
    train_blocks(tiny_cfg, tc, CORPUS, tmp_path / "split", device=dev, checkpoint_every=100, stop_after=3)
    assert len(_losses(tmp_path / "split")) == 3 * tiny_cfg.n_blocks
    train_blocks(tiny_cfg, tc, CORPUS, tmp_path / "split", device=dev, checkpoint_every=100, resume=True)
    full, split = _losses(tmp_path / "full"), _losses(tmp_path / "split")
    assert sorted(full) == sorted(split)  # exact float equality, every block, every step
    assert len({loss for _, _, loss in full}) > 1
    for b in range(tiny_cfg.n_blocks):
        a = load_block(tmp_path / "full", b).model.state_dict()
        c = load_block(tmp_path / "split", b).model.state_dict()
        assert all(torch.equal(a[k], c[k]) for k in a)


def test_resumed_ar_run_reproduces_the_uninterrupted_losses(tmp_path, tiny_cfg):
    tc = TrainConfig(steps=5, warmup=1, batch=4)
    dev = torch.device("cpu")
    train_ar(tiny_cfg, tc, CORPUS, tmp_path / "full", n_layers=2, device=dev)
    train_ar(tiny_cfg, tc, CORPUS, tmp_path / "split", n_layers=2, device=dev, stop_after=2)
    train_ar(tiny_cfg, tc, CORPUS, tmp_path / "split", n_layers=2, device=dev, resume=True)
    assert _losses(tmp_path / "full") == _losses(tmp_path / "split")


def test_blocks_train_independently(tmp_path, tiny_cfg):
    """Training block 1 alone gives bit-identical results to training it beside the others."""
    tc = TrainConfig(steps=3, warmup=1, batch=4)
    dev = torch.device("cpu")
    train_blocks(tiny_cfg, tc, CORPUS, tmp_path / "all", device=dev)
    train_blocks(tiny_cfg, tc, CORPUS, tmp_path / "one", device=dev, blocks=[1])
    a = load_block(tmp_path / "all", 1).model.state_dict()
    b = load_block(tmp_path / "one", 1).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


class _Seen(Exception):
    pass


def _draws(tiny_cfg, tc, monkeypatch, n=400, block=0):
    """(K, rows trained as the null state) of each of n steps' batches, without training."""
    from btnode.model.targets import target_table
    from btnode.store.models import init_block
    from btnode.train import trainers

    seen = []
    from btnode.model.layout import window_layout as real

    def layout(n_, k, phase):
        seen.append([k])
        return real(n_, k, phase)

    monkeypatch.setattr(trainers, "window_layout", layout)

    def model(ctx, z, sigma, layout):
        seen[-1].append(int((z.abs().sum((1, 2)) == 0).sum()))
        raise _Seen

    tr = trainers.BlockTrainer(init_block(tiny_cfg, block, 0), tc, block=block, table=target_table(tiny_cfg),
                               device=torch.device("cpu"))
    tr.model.train_logits = model  # records the batch, then stops the step before any update
    x = torch.randint(0, 256, (8, tiny_cfg.context + 1))
    for step in range(n):
        tr.step = step
        try:
            tr.train_step(x, 0)
        except _Seen:
            pass
    return seen


def test_the_k_mix_and_the_null_state_share_are_what_the_config_asks(tiny_cfg, monkeypatch):
    seen = _draws(tiny_cfg, TrainConfig(batch=8, k1_share=0.8, ctx_share=0.25), monkeypatch)
    ks = [k for k, _ in seen]
    assert 0.72 < ks.count(1) / len(ks) < 0.88 and ks.count(8) and ks.count(16)  # 0.8 / 0.1 / 0.1
    assert 0.2 < sum(z for _, z in seen) / (8 * len(seen)) < 0.3
    assert seen == _draws(tiny_cfg, TrainConfig(batch=8, k1_share=0.8, ctx_share=0.25), monkeypatch)  # seeded
    plain = _draws(tiny_cfg, TrainConfig(batch=8, k1_share=None, ctx_share=0.0), monkeypatch)
    assert all(z == 0 for _, z in plain) and 0.25 < [k for k, _ in plain].count(1) / len(plain) < 0.42


def test_a_tail_block_trains_multi_byte_segments_only_and_never_the_null_state(tiny_cfg, monkeypatch):
    import dataclasses

    cfg = dataclasses.replace(tiny_cfg, tail_blocks=1)
    seen = _draws(cfg, TrainConfig(batch=8, k1_share=0.9, ctx_share=0.25), monkeypatch, n=200, block=3)
    ks = [k for k, _ in seen]
    assert 1 not in ks and 0.35 < ks.count(8) / len(ks) < 0.65  # K = 8 and 16 equally often
    assert all(z == 0 for _, z in seen)
