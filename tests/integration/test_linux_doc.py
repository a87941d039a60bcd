"""`btnode data fetch linux-doc` end to end on the real package: the pinned .deb (a cached copy, or
one apt-get downloads when its lists hold the pinned version) becomes the JSONL whose sha256 is
pinned and a dataset split by document. Skipped, with the reason, on a machine with neither."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from btnode.data import corpora
from procs import run_cli

pytestmark = pytest.mark.slow
CORPUS = corpora.LINUX_DOC


def cached_deb() -> Path | None:
    for path in (os.environ.get("BTNODE_LINUX_DOC_DEB"), corpora.default_cache_dir() / CORPUS.deb_name):
        if path and Path(path).is_file():
            return Path(path)
    return None


def apt_has_it() -> bool:
    if shutil.which("apt-cache") is None:
        return False
    spec = f"{CORPUS.package}={CORPUS.version}"
    return subprocess.run(["apt-cache", "show", spec], capture_output=True).returncode == 0


def test_fetch_linux_doc_gives_the_pinned_corpus_split_by_document(tmp_path):
    deb = cached_deb()
    if deb is None and not apt_has_it():
        pytest.skip(f"no cached {CORPUS.deb_name} (BTNODE_LINUX_DOC_DEB or {corpora.default_cache_dir()}) and apt's "
                    f"lists do not hold {CORPUS.package} {CORPUS.version}, so it cannot be downloaded here")
    args = ["data", "fetch", "linux-doc", "--out", str(tmp_path / "ds"), "--cache", str(tmp_path / "cache")]
    run_cli(*args, *(["--deb", str(deb)] if deb else []))
    jsonl = tmp_path / "cache" / CORPUS.jsonl_name
    assert corpora.file_sha256(jsonl) == CORPUS.jsonl_sha256
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["extra"]["source"]["version"] == CORPUS.version
    assert manifest["documents"] == 3171
    splits = manifest["splits"]
    assert sum(s["bytes"] for s in splits.values()) > 20_000_000
    assert splits["test"]["documents"] >= 50 and splits["test"]["bytes"] > 400_000  # enough to score
    assert run_cli("data", "verify", str(tmp_path / "ds")).returncode == 0
