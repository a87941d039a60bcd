"""A short real training run on the bundled corpus must beat the unigram entropy by a wide margin
on held-out bytes, measured with the honest sampler metric (SCE-8), not the denoising loss."""

import pytest
import torch

from btnode.data import corpus
from btnode.data.windows import eval_windows
from btnode.evaluation.metrics import sampler_ce
from btnode.model.config import ModelConfig
from btnode.model.readout import Readout
from btnode.store.models import load_blocks
from btnode.train.config import TrainConfig
from btnode.train.loops import train_blocks


@pytest.mark.slow
def test_short_run_beats_the_unigram_entropy(tmp_path):
    torch.set_num_threads(2)
    cfg = ModelConfig(d_model=64, n_heads=2, n_layers=1, n_blocks=3, context=64, segments=(1, 16))
    tc = TrainConfig(steps=200, warmup=20, batch=16, lr=3e-3)
    data = corpus.bundled()
    train_blocks(cfg, tc, data.train, tmp_path, device=torch.device("cpu"), checkpoint_every=1000)
    _, blocks = load_blocks(tmp_path)
    w = eval_windows(data.test, cfg.context, 64)
    untrained = sampler_ce([type(b)(cfg) for b in blocks], w, k=1, seeds=range(8), n_steps=7, device=torch.device("cpu"),
                           readout=Readout.LAST)
    r = sampler_ce(blocks, w, k=1, seeds=range(8), n_steps=7, device=torch.device("cpu"), readout=Readout.LAST)
    unigram = corpus.unigram_entropy(data.test)
    print(f"SCE-1 {r.sce1:.3f}, SCE-8 {r.sce:.3f}, untrained SCE-8 {untrained.sce:.3f}, unigram {unigram:.3f}")
    assert untrained.sce > unigram  # the margin below is earned by training
    assert r.sce < unigram - 0.4
