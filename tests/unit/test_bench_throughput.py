"""bench/throughput.py's own arithmetic: the FLOP count of a step (attention included on the CPU),
bytes per second, MFU, the peak over measurements, and the flat breakdown of a step's timers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.throughput import LAYERS, bytes_per_s, count_flops, make_trainer, mfu, peak_of, phases, timers, windows
from btnode.model.config import ModelConfig
from btnode.train.config import Precision

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=LAYERS, context=32)
CPU = torch.device("cpu")


def test_a_step_counts_every_matmul_and_the_attention():
    # AR step by hand: forward 2·B·T·(12d² per layer + 256·d head) for the linears, backward twice that;
    # attention forward 2 matmuls of 2·B·T²·d, backward 5 (the scores recomputed): 14·B·T²·d per layer
    b, t, d = 2, CFG.context, CFG.d_model
    tr = make_trainer("ar", CFG, Precision.FP32, b, CPU)
    assert count_flops(tr, windows(CFG, b)) == 3 * 2 * b * t * (LAYERS * 12 * d * d + 256 * d) + LAYERS * 14 * b * t * t * d
    assert tr.step == 1  # the counted step is a real one


def test_the_block_step_counts_both_streams():
    # by hand: both streams' linears and the head (3× forward, as above); clean attention 14·B·T²·d per
    # layer, noisy attention over 2T keys 28·B·T²·d; in_proj and the σ-embedding's first map read inputs
    # that need no gradient (2× forward); the AdaLN maps (6d per layer, 2d final) and fc2 run on B rows.
    # The step without issue #42's levers (no clean head, every noisy row): the formula's shape.
    b, t, d = 2, CFG.context, CFG.d_model
    tr = make_trainer("block", dataclasses.replace(CFG, ctx_head=0), Precision.FP32, b, CPU, noisy_rows=1.0)
    assert count_flops(tr, windows(CFG, b)) == (
        6 * b * t * (2 * LAYERS * 12 * d * d + 256 * d) + LAYERS * (14 + 28) * b * t * t * d + 4 * b * t * d * d
        + 6 * b * (LAYERS * 6 * d * d + 2 * d * d) + 4 * b * 128 * d + 6 * b * d * d)


def test_row_arithmetic():
    assert bytes_per_s(8, 128, 0.5) == 2048
    assert mfu(200 * 10**9, 2.0, 250.0) == pytest.approx(0.4)
    before = {"fp32": {"256": 90.0, "1024": 240.0}, "bf16": {"256": 40.0, "1024": 50.0}}
    after = {"fp32": {"256": 95.0, "1024": 230.0}, "bf16": {"256": 60.0, "1024": 10.0}}
    assert peak_of([before, after]) == {"fp32": 240.0, "bf16": 60.0}


def test_the_breakdown_adds_up_to_the_step():
    spent = {"forward": 0.5, "clean": 0.2, "noisy": 0.2, "mask": 0.01, "apply": 0.9, "clip": 0.02, "optimizer": 0.08}
    parts = {p["part"]: p["s"] for p in phases(spent, 1.5)}
    assert parts["embeddings, σ-embedding, head (forward)"] == pytest.approx(0.09)
    assert parts["backward"] == pytest.approx(0.8)
    assert parts["inputs and loss (rest of the step: σ, noise ε, z, layout, CE)"] == pytest.approx(0.1)
    assert sum(parts.values()) == pytest.approx(1.5)
    ar = {p["part"] for p in phases({"forward": 0.5, "apply": 0.9, "clip": 0.0, "optimizer": 0.1}, 1.5)}
    assert "forward" in ar and "mask" not in ar


@pytest.mark.parametrize("model", ["block", "ar"])
def test_the_timers_wrap_the_trainers_own_calls_and_unwrap_after(model):
    tr = make_trainer(model, CFG, Precision.FP32, 2, CPU)
    with timers(tr) as spent:
        tr.train_step(windows(CFG, 2))
    expected = {"forward", "apply", "clip", "optimizer"} | ({"clean", "noisy", "mask"} if model == "block" else set())
    assert set(spent) == expected and all(v > 0 for v in spent.values())
    assert spent["forward"] > spent.get("clean", 0) + spent.get("noisy", 0) and spent["apply"] > spent["optimizer"]
    assert "_fp32" not in vars(tr) and "step" not in vars(tr.opt)
    assert torch.nn.utils.clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad"
