"""Shared fixtures: a tiny model configuration that runs in milliseconds on the CPU."""

from __future__ import annotations

import pytest
import torch

from btnode.model.config import ModelConfig
from procs import aggregator, processes  # noqa: F401  (fixtures for tests that run real processes)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(1)  # bit-exact comparisons across runs in one process
    yield


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return ModelConfig(d_model=32, n_heads=2, n_layers=2, n_blocks=3, context=32, segments=(1, 8, 16))
