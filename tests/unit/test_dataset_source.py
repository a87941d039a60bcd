"""Byte sources: the bundled corpus draws exactly the windows it always drew, and a prepared dataset's
memory-mapped shards give the same windows as its concatenated bytes, without being read into memory."""
import hashlib
import math
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from btnode.data import corpus, identity
from btnode.data import source as source_module
from btnode.data.manifest import read_manifest, write_dataset
from btnode.data.source import MemoryBytes
from btnode.data.windows import WindowSampler, eval_windows
from btnode.errors import DataError
from btnode.evaluation import judge as jd


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


# --- a prepared dataset: shards read as needed ------------------------------------------------------

def documents(n: int, seed: int) -> list[bytes]:
    g = random.Random(seed)
    return [bytes(g.randrange(32, 127) for _ in range(g.randrange(1, 300))) for _ in range(n)]


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """Shards of 97 bytes, so that most windows cross a shard boundary; and each split's stream."""
    folder = tmp_path_factory.mktemp("ds")
    docs = {"train": documents(60, 1), "tune": documents(8, 2), "test": documents(20, 3)}
    write_dataset(folder, docs, shard_bytes=97)
    return folder, {name: b"\n\n".join(d) for name, d in docs.items()}


def test_windows_across_shards_equal_windows_of_the_concatenated_stream(small_dataset):
    folder, streams = small_dataset
    data = corpus.load(folder)
    assert len(data.train.split.shards) > 20
    for name, stream in streams.items():
        source, flat = getattr(data, name), MemoryBytes(stream)
        assert len(source) == len(stream)
        starts = torch.tensor([0, 1, 95, 96, 97, 190, len(stream) - 300, len(stream) - 250])
        assert torch.equal(source.windows(starts, 250), flat.windows(starts, 250))
        reads = [(0, 10), (90, 20), (96, 1), (97, 97), (5, 10**9), (len(stream) - 3, 100), (len(stream), 5)]
        for start, length in reads:
            assert source.read(start, length) == stream[start:start + length]
        assert torch.equal(eval_windows(source, 32, None), eval_windows(stream, 32, None))
        assert corpus.unigram_entropy(source) == corpus.unigram_entropy(stream)
    sampler, flat_sampler = WindowSampler(data.train, 64), WindowSampler(streams["train"], 64)
    for key in (0, 3, "host-9"):
        assert torch.equal(sampler.batch(5, key, 11, 16), flat_sampler.batch(5, key, 11, 16))


def test_training_windows_are_a_pure_function_of_seed_key_and_step(small_dataset):
    folder, _ = small_dataset
    first = WindowSampler(corpus.load(folder).train, 64)
    resumed = WindowSampler(corpus.load(folder).train, 64)  # a new process, e.g. after a restart
    for step in (0, 1, 1000):
        assert torch.equal(first.batch(1, "w", step, 8), resumed.batch(1, "w", step, 8))
    assert not torch.equal(first.batch(1, "w", 0, 8), first.batch(1, "w", 1, 8))
    assert not torch.equal(first.batch(1, "w", 0, 8), first.batch(1, "v", 0, 8))


def test_byte_counts_read_in_bounded_chunks_give_the_former_value(monkeypatch, small_dataset):
    """Chunks of 7 bytes: the first occurrence of a byte value may fall in any chunk."""
    folder, streams = small_dataset
    whole = corpus.unigram_entropy(corpus.load(folder).test)
    monkeypatch.setattr(source_module, "READ_CHUNK", 7)
    test = corpus.load(folder).test
    assert len(list(test.chunks())) == -(-len(streams["test"]) // 7)
    assert corpus.unigram_entropy(test) == whole == corpus.unigram_entropy(streams["test"])
    assert corpus.unigram_entropy(b"abab") == pytest.approx(math.log(2))


def test_prompts_are_found_through_bounded_reads(monkeypatch):
    test = corpus.bundled().test
    want = jd.fixed_prompts(test, 8)
    monkeypatch.setattr(jd, "SCAN_BYTES", 5)  # every search crosses many reads
    assert jd.fixed_prompts(test, 8) == want


def test_the_source_says_which_data_each_role_is(small_dataset):
    folder, _ = small_dataset
    data = corpus.load(folder)
    assert data.source.startswith(f"dataset {folder} (manifest sha256:") and " train " in data.source
    assert data.ident == identity.manifest_id(read_manifest(folder))  # what a worker states at Join
    assert data.test.description == f"the test split of dataset {folder}"


def broken_copy(small_dataset, tmp_path) -> Path:
    folder = tmp_path / "ds"
    shutil.copytree(small_dataset[0], folder)
    return folder


def test_a_truncated_or_missing_shard_is_named(small_dataset, tmp_path):
    folder = broken_copy(small_dataset, tmp_path)
    shard = folder / "train" / "000003.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(DataError, match=r"shard train/000003.bin of the train split of dataset .* has 96 bytes but "
                                        r"the manifest lists 97: it is truncated"):
        corpus.load(folder)
    shard.unlink()
    with pytest.raises(DataError, match="shard train/000003.bin of the train split .* is missing"):
        corpus.load(folder)


def test_a_shard_that_changes_after_loading_is_caught_when_it_is_opened(small_dataset, tmp_path):
    folder = broken_copy(small_dataset, tmp_path)
    data = corpus.load(folder)
    (folder / "test" / "000001.bin").write_bytes(b"short")
    with pytest.raises(DataError, match="shard test/000001.bin of the test split .* has 5 bytes"):
        data.test.windows(torch.tensor([100]), 10)


def test_an_empty_or_short_split_is_refused_by_what_needs_its_windows(tmp_path):
    write_dataset(tmp_path, {"train": [b"x" * 40], "tune": [], "test": [b"y" * 1000]})
    data = corpus.load(tmp_path)
    with pytest.raises(DataError, match="the train split of dataset .* has 40 bytes; windows need at least 65"):
        WindowSampler(data.train, 64)
    with pytest.raises(DataError, match="the tune split of dataset .* has 0 bytes"):
        eval_windows(data.tune, 64, None)
    assert eval_windows(data.test, 64, 4).shape == (4, 65)


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc (Linux)")
def test_training_on_a_dataset_does_not_hold_it(tmp_path):
    """64 MB of training shards: loading them and drawing windows keeps the resident set within a
    few MB (reading the split into memory, as the loader once did, adds at least its 64 MB; mapping
    the shards added up to 2 MB per window on a kernel with large page-cache folios)."""
    block = bytes(range(256)) * 4096  # 1 MiB
    write_dataset(tmp_path, {"train": [block] * 64, "test": [block]}, separator=b"", shard_bytes=16 << 20)
    del block
    WindowSampler(b"warm-up " * 64, 128).batch(0, 0, 0, 32)  # torch's own first-use allocations
    before = resident_bytes()
    data = corpus.load(tmp_path)
    sampler = WindowSampler(data.train, 128)
    batches = [sampler.batch(0, 0, step, 32) for step in range(20)]
    grown = resident_bytes() - before
    assert len(data.train) == 64 << 20 and all(b.shape == (32, 129) for b in batches)
    assert grown < 8 << 20, f"the resident set grew by {grown / 2**20:.1f} MiB"


def test_doctor_checks_the_data_a_worker_would_train_on(small_dataset, tmp_path):
    from btnode.model.config import ModelConfig
    from btnode.node.doctor import check_data
    from btnode.node.settings import HostConfig

    ok = check_data(ModelConfig(context=64), HostConfig(data=str(small_dataset[0])))
    assert ok.level == "OK" and ok.detail.startswith(f"dataset {small_dataset[0]} (manifest sha256:")
    folder = broken_copy(small_dataset, tmp_path)
    (folder / "train" / "000000.bin").unlink()
    bad = check_data(ModelConfig(context=64), HostConfig(data=str(folder)))
    assert bad.level == "FAIL" and "shard train/000000.bin of the train split" in bad.detail and bad.fix
    short = check_data(ModelConfig(context=1 << 20), HostConfig(data=str(small_dataset[0])))
    assert short.level == "FAIL" and "a window needs 1048577" in short.detail
