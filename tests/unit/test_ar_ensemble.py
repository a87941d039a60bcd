"""The AR baselines' teacher-forced CE of an ensemble (bench/quality.py's ensemble_ar_block): the
mean of the members' probabilities, on the same rows as one model's CE."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from btnode.evaluation.metrics import ar_ce
from btnode.model.ar import ByteTransformer
from btnode.model.config import ModelConfig
from btnode.model.layout import eval_layout

CPU = torch.device("cpu")
CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=16, segments=(1,))


def member(seed: int) -> ByteTransformer:
    torch.manual_seed(seed)
    m = ByteTransformer(CFG, 1)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)  # two members that disagree
    return m


def windows() -> torch.Tensor:
    return torch.randint(0, 256, (10, CFG.context + 1), generator=torch.Generator().manual_seed(3))


def test_an_ensemble_of_one_model_twice_scores_as_the_model():
    m, w = member(0), windows()
    assert math.isclose(ar_ce([m, m], w, device=CPU), ar_ce(m, w, device=CPU), rel_tol=1e-9)


def test_an_ensemble_averages_probabilities_on_the_scored_rows():
    a, b, w = member(0), member(1), windows()
    rows = eval_layout(CFG.context, 1).positions
    with torch.no_grad():
        p = (F.softmax(a(w[:, :-1]).double(), -1) + F.softmax(b(w[:, :-1]).double(), -1)) / 2
    tgt = w[:, 1:]
    want = -torch.log(p[:, rows].gather(-1, tgt[:, rows].unsqueeze(-1))).mean().item()
    got = ar_ce([a, b], w, device=CPU, batch=4)  # batches of 4 windows: the sum runs over batches
    assert math.isclose(got, want, rel_tol=1e-9)
    # the mean of the probabilities beats the mean of the members' CEs (Jensen), and is not either member's
    singles = [ar_ce(m, w, device=CPU) for m in (a, b)]
    assert got < sum(singles) / 2 and all(abs(got - s) > 1e-3 for s in singles)
