"""A short identity of a worker's training data, stated when it joins a swarm, so that the
aggregator can refuse a replica that would train one block on other bytes than its peers. It
names the data, not where it lies: two hosts holding the same dataset in different folders agree."""

from __future__ import annotations

import hashlib
from pathlib import Path

from btnode.data.manifest import Manifest, is_dataset, read_manifest

BUNDLED = "bundled:wikitext-2"


def manifest_id(manifest: Manifest) -> str:
    """A prepared dataset's id: the sha256 of its manifest bytes (which list every shard's sha256).
    Taken over the canonical form, which is what `btnode data prepare` writes, so a copy fetched
    over HTTP and a local one agree."""
    return "sha256:" + hashlib.sha256(manifest.to_json().encode()).hexdigest()


def data_id(path: Path | None) -> str:
    """The id of `--data PATH` (None: the bundled corpus): a prepared dataset by its manifest, a
    folder of WikiText files or a single file by name and size (reading them whole to hash them
    would cost a large corpus's full read at every start)."""
    if path is None:
        return BUNDLED
    path = Path(path)
    if is_dataset(path):
        return manifest_id(read_manifest(path))
    files = sorted(path.glob("wiki.*.raw")) if path.is_dir() else [path]
    return "files:" + ",".join(f"{f.name}={f.stat().st_size}" for f in files if f.is_file())
