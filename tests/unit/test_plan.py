"""The accounting of `btnode plan` (train/plan.py): its parts from real modules' parameters, and
activations extrapolated from small probes equal to a direct measurement."""

from __future__ import annotations

import dataclasses

from btnode.model.config import ModelConfig
from btnode.store.models import init_ar, init_block
from btnode.train import plan

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=2, n_blocks=3, context=32, segments=(1, 8))


def count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_state_bytes_are_16_per_parameter_of_the_real_modules():
    w = plan.block_memory(CFG, 4, runtime=1000)
    n = count(init_block(CFG, 0, 0))
    assert (w.parameters, w.param_bytes, w.grad_bytes, w.adam_bytes, w.state_bytes) == (n, 4 * n, 4 * n, 8 * n, 16 * n)
    kept = max(4 * n, w.activation_bytes) // 2  # every tensor of so small a block lives in the heap
    assert w.step_bytes == 4 * n and w.retained_bytes == kept
    assert w.checkpoint_bytes == 20 * n  # optimizer group twice (buffer + bytes) and the model group's bytes
    assert w.train_peak_bytes == 1000 + 16 * n + max(w.activation_bytes, 4 * n) + kept
    assert w.peak_bytes == max(w.train_peak_bytes, 1000 + 36 * n + kept)
    e = plan.ar_memory(CFG, 4, runtime=1000)
    n_ar = count(init_ar(CFG, CFG.n_blocks * CFG.n_layers, 0))
    assert e.parameters == n_ar and e.state_bytes == 16 * n_ar
    assert plan.ar_memory(CFG, 4, n_layers=2, runtime=0).parameters == count(init_ar(CFG, 2, 0))


def test_only_tensors_under_the_glibc_mmap_ceiling_are_kept_in_the_heap():
    big = plan.GLIBC_MMAP_MAX // 4  # elements of a tensor exactly at the ceiling: mmapped, returned when freed
    m = plan.memory_of([10, big - 1, big], runtime=0, activations=0)
    assert m.parameters == 2 * big + 9 and m.retained_bytes == 4 * (big - 1 + 10) // 2
    assert plan.memory_of([10], runtime=0, activations=1000).retained_bytes == 500  # activations, the larger transient


def test_extrapolated_activations_equal_a_direct_measurement():
    deep = dataclasses.replace(CFG, n_layers=3)
    for cfg, kind, layers in ((deep, "block", 3), (CFG, "ar", 5)):
        direct = plan.saved_bytes(plan._probe(cfg, kind, layers), cfg.context, 3)
        assert abs(plan.activations(cfg, kind, layers, 3) - direct) <= 1e-3 * direct, kind  # a few small tensors round
    one, two = plan.activations(CFG, "ar", 6, 1), plan.activations(CFG, "ar", 6, 2)
    assert 0 < one < two  # measured, and growing with the batch


def test_unit_bytes_count_what_the_swarm_stores_block_or_ar():
    """The doctor's disk check sizes an aggregator by these: B (+ tail) blocks, or one AR model."""
    from btnode.codec.codecs import Codec

    blocks = plan.unit_bytes(CFG)
    assert blocks["fp32"] == 4 * CFG.n_blocks * count(init_block(CFG, 0, 0))
    assert set(blocks) == {c.name.lower() for c in Codec}
    ar = dataclasses.replace(CFG, kind="ar", ar_layers=5)
    assert plan.unit_bytes(ar)["fp32"] == 4 * count(init_ar(CFG, 5, 0))
    tail = dataclasses.replace(CFG, tail_blocks=1)
    assert plan.unit_bytes(tail)["fp32"] == 4 * sum(count(init_block(tail, b, 0)) for b in range(4))
