"""The data id a worker states at Join: the same data in two places gives one id, other data another."""

from __future__ import annotations

import hashlib
import shutil

from btnode.data.identity import BUNDLED, data_id
from btnode.data.manifest import MANIFEST, write_dataset

DOCS = {"train": [b"alpha " * 50, b"beta " * 40], "tune": [b"gamma"], "test": [b"delta"]}


def test_a_prepared_dataset_is_named_by_its_manifest_wherever_it_lies(tmp_path):
    write_dataset(tmp_path / "here", DOCS, shard_bytes=64)
    shutil.copytree(tmp_path / "here", tmp_path / "there")
    ident = data_id(tmp_path / "here")
    assert ident == "sha256:" + hashlib.sha256((tmp_path / "here" / MANIFEST).read_bytes()).hexdigest()
    assert data_id(tmp_path / "there") == ident
    write_dataset(tmp_path / "other", {**DOCS, "train": [b"alpha " * 50, b"beta " * 41]}, shard_bytes=64)
    assert data_id(tmp_path / "other") != ident


def test_the_bundled_corpus_a_file_and_a_wikitext_folder(tmp_path):
    assert data_id(None) == BUNDLED == "bundled:wikitext-2"
    (tmp_path / "corpus.txt").write_bytes(b"x" * 123)
    assert data_id(tmp_path / "corpus.txt") == "files:corpus.txt=123"
    for name, size in (("wiki.train.raw", 5), ("wiki.valid.raw", 3), ("wiki.test.raw", 2)):
        (tmp_path / "wt" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "wt" / name).write_bytes(b"y" * size)
    assert data_id(tmp_path / "wt") == "files:wiki.test.raw=2,wiki.train.raw=5,wiki.valid.raw=3"
