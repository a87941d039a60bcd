import hashlib
from pathlib import Path

import pytest
import torch

from btnode.data import corpus
from btnode.data.windows import WindowSampler, eval_windows
from btnode.errors import DataError

def whole(source) -> bytes:
    return source.read(0, len(source))


SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "wikitext-2-raw"


def test_bundled_corpus_roles_and_hashes():
    c = corpus.bundled()
    assert len(c.train) == 1_146_846 - 65_536 and len(c.tune) == 65_536 and len(c.test) == 1_290_590
    assert hashlib.sha256(whole(c.train) + whole(c.tune)).hexdigest() == corpus.KNOWN_SHA256["wiki.valid.raw"]
    assert c.test.read(0, 23) == b" \n = Robert Boulter = \n"


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared corpus folder is only present in the dev workspace")
def test_bundled_copy_equals_the_shared_files():
    c = corpus.bundled()
    assert whole(c.test) == (SHARED / "wiki.test.raw").read_bytes()


def test_single_file_is_the_training_corpus(tmp_path):
    f = tmp_path / "mine.txt"
    f.write_bytes(b"abc" * 100)
    c = corpus.load(f)
    assert whole(c.train) == b"abc" * 100 and whole(c.test) == whole(corpus.bundled().test)
    assert "mine.txt" in c.source and "tune and test bundled" in c.source


def test_known_file_names_are_checked_against_their_sha256(tmp_path):
    for name in ("wiki.train.raw", "wiki.valid.raw", "wiki.test.raw"):
        (tmp_path / name).write_bytes(b"not wikitext\n" * 10)
    with pytest.raises(DataError, match="published sha256 of wiki.train.raw"):
        corpus.load(tmp_path)


def test_folder_without_the_three_files_is_refused(tmp_path):
    (tmp_path / "wiki.train.raw").write_bytes(b"x")
    with pytest.raises(DataError, match="lacks wiki.valid.raw, wiki.test.raw .* or a prepared dataset's manifest"):
        corpus.load(tmp_path)


def test_missing_empty_and_unreadable_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        corpus.load(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        corpus.load(tmp_path / "empty.txt")
    with pytest.raises(DataError, match="cannot be read"):
        corpus.load(Path("/proc/self/mem"))  # exists, but reading it fails with EIO


def test_training_windows_are_a_function_of_seed_worker_and_step():
    data = bytes(range(256)) * 40
    s = WindowSampler(data, 16)
    a = s.batch(seed=1, worker=2, step=3, size=8)
    assert a.shape == (8, 17) and a.dtype == torch.int64
    assert torch.equal(a, WindowSampler(data, 16).batch(1, 2, 3, 8))
    assert not torch.equal(a, s.batch(1, 3, 3, 8)) and not torch.equal(a, s.batch(1, 2, 4, 8))
    assert torch.equal(a[:, 1:], (a[:, :-1] + 1) % 256)  # contiguous slices of the corpus


def test_too_short_corpus_is_refused():
    with pytest.raises(DataError, match="need at least 17"):
        WindowSampler(b"short", 16)


def test_eval_windows_tile_and_thin_evenly():
    data = bytes(1000)
    w = eval_windows(data, 16, None)
    assert w.shape == (len(range(0, 1000 - 16, 8)), 17)
    thin = eval_windows(bytes(range(250)) * 4, 16, 5)
    assert thin.shape == (5, 17) and int(thin[-1, 0]) != int(thin[0, 0])


def test_unigram_entropy():
    assert corpus.unigram_entropy(b"abab") == pytest.approx(0.6931, abs=1e-4)
