"""Byte sources: the bundled corpus draws exactly the windows it always drew, and a prepared dataset's
memory-mapped shards give the same windows as its concatenated bytes, without being read into memory."""
import hashlib

import pytest
import torch

from btnode.data import corpus
from btnode.data.windows import WindowSampler, eval_windows


def digest(t) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:32]


# Golden values computed from the pre-change code at commit 4c67c5d (windows over `bytes`, copied
# into a tensor): they pin the published numbers of the bundled runs to the same windows.
GOLDEN_BATCHES = {
    (0, 0, 0): "348705de56f7d529367d062b0b0b95fe",
    (0, 3, 7): "fbb06107ba27d05c96abe8bb9043efcc",
    (1234, 1, 100000): "f60fb1487ba7ee14bc2d72d751f056ad",
    (7, "host-123", 5): "b7f1d02b0b2b291dc426ff3cc795da4e",
}
GOLDEN_EVAL = {
    ("test", None): ((20164, 129), "0e9fe10e0edc95bd2a67c054faa3c7bd"),
    ("test", 64): ((64, 129), "3b9d6fdda74e7abdc70e3725b0ea7090"),
    ("tune", None): ((1022, 129), "15cea262d242e0b8077f8d1ba519e1fa"),
    ("tune", 64): ((64, 129), "bab4ab468ec7fac3c899eb03465bda26"),
}


def test_bundled_training_windows_are_unchanged():
    sampler = WindowSampler(corpus.bundled().train, 128)
    for (seed, key, step), want in GOLDEN_BATCHES.items():
        b = sampler.batch(seed, key, step, 32)
        assert b.shape == (32, 129) and b.dtype == torch.int64
        assert digest(b) == want, (seed, key, step)


@pytest.mark.parametrize("split,max_windows", list(GOLDEN_EVAL))
def test_bundled_eval_windows_are_unchanged(split, max_windows):
    shape, want = GOLDEN_EVAL[(split, max_windows)]
    w = eval_windows(getattr(corpus.bundled(), split), 128, max_windows)
    assert tuple(w.shape) == shape and digest(w) == want
