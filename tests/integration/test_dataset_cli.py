"""`--data DIR` with a prepared dataset, through the real CLI: train-local trains on its train split,
eval scores its test split and says so, and a broken dataset ends in one line naming the shard and
exit code 3 (DataError)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from procs import TINY_TRAIN, run_cli

from btnode.data.manifest import write_dataset
from btnode.data.source import unigram_entropy


def documents(n: int, seed: int) -> list[bytes]:
    g = random.Random(seed)
    words = [b"the", b"river", b"stone", b"was", b"built", b"in", b"north", b"of", b"a", b"city"]
    return [b" ".join(g.choice(words) for _ in range(g.randrange(20, 200))) + b"." for _ in range(n)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data") / "ds"
    write_dataset(folder, {"train": documents(40, 1), "tune": documents(4, 2), "test": documents(8, 3)},
                  shard_bytes=4096)
    return folder


def test_train_and_eval_on_a_prepared_dataset(dataset, tmp_path):
    out, res = tmp_path / "blocks", tmp_path / "eval.json"
    run_cli("train-local", "--out", str(out), "--steps", "2", "--data", str(dataset), *TINY_TRAIN)
    p = run_cli("eval", "--checkpoint", str(out), "--windows", "4", "--seeds", "1", "--no-alone",
                "--data", str(dataset), "--json", str(res))
    result = json.loads(res.read_text())
    assert result["split"] == f"the test split of dataset {dataset}" and result["windows"] == 4
    assert result["data"].startswith(f"dataset {dataset} (manifest sha256:")
    assert f"scored on the test split of dataset {dataset}" in p.stdout
    test = b"".join(f.read_bytes() for f in sorted((dataset / "test").iterdir()))
    assert result["unigram"] == unigram_entropy(test)  # of the dataset's test split, not WikiText's


def broken(dataset: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    return copy


def fails_with_data_error(*args: str, match: str) -> None:
    p = run_cli(*args, ok=False)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 3 and last.startswith("error:") and match in last, p.stderr


def test_a_broken_dataset_ends_in_one_line_and_exit_code_3(dataset, tmp_path):
    copy = broken(dataset, tmp_path)
    shard = copy / "train" / "000002.bin"
    shard.write_bytes(shard.read_bytes()[:100])
    args = ("train-local", "--out", str(tmp_path / "o"), "--steps", "1", "--data", str(copy), *TINY_TRAIN)
    fails_with_data_error(*args, match="shard train/000002.bin of the train split of dataset")
    shard.unlink()
    fails_with_data_error(*args, match="shard train/000002.bin of the train split of dataset")
    write_dataset(copy, {"train": [], "test": documents(2, 4)})
    fails_with_data_error(*args, match="the train split of dataset")


@pytest.fixture
def served(dataset, tmp_path):
    """The dataset (a copy the test may break) on the standard library's static file server."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    copy = broken(dataset, tmp_path)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(copy)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield copy, f"http://127.0.0.1:{httpd.server_address[1]}/manifest.json"
    httpd.shutdown()
    httpd.server_close()


def test_train_and_eval_on_a_dataset_over_http(served, tmp_path):
    copy, url = served
    out, res, cache = tmp_path / "blocks", tmp_path / "eval.json", tmp_path / "cache"
    net = ("--data", url, "--data-cache", str(cache), "--data-cache-gb", "0.001")
    run_cli("train-local", "--out", str(out), "--steps", "2", *net, *TINY_TRAIN)
    run_cli("eval", "--checkpoint", str(out), "--windows", "4", "--seeds", "1", "--no-alone", *net, "--json", str(res))
    result = json.loads(res.read_text())
    assert result["split"] == f"the test split of dataset {url}"
    test = b"".join(f.read_bytes() for f in sorted((copy / "test").iterdir()))
    assert result["unigram"] == unigram_entropy(test)
    cached = [f for f in cache.rglob("*.bin")]
    assert cached and sum(f.stat().st_size for f in cached) <= 1e6 + 4096  # the bound, give or take a shard


def test_a_shard_with_wrong_bytes_over_http_is_never_trained_on(served, tmp_path):
    copy, url = served
    shard = copy / "train" / "000001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    fails_with_data_error("train-local", "--out", str(tmp_path / "o"), "--steps", "1", "--data", url,
                          "--data-cache", str(tmp_path / "cache"), *TINY_TRAIN, match="train/000001.bin")
    assert not list((tmp_path / "cache").rglob("000001.bin"))  # nothing of it kept as if verified
