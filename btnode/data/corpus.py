"""Where the bytes come from, and which bytes play which role.

Default (bundled, zstd-compressed copies of WikiText-2 raw; see wikitext/SOURCE.md):
  training corpus = wiki.valid.raw without its last 65,536 bytes
  tuning slice    = the last 65,536 bytes of wiki.valid.raw (for choosing settings only)
  held-out test   = wiki.test.raw (headline numbers)
A user's `--data` may be a prepared dataset (a folder with manifest.json, or an http(s):// URL of
one: its train / tune / test splits), a folder holding wiki.train.raw, wiki.valid.raw and
wiki.test.raw (full WikiText-2: train / tune / test), or a single file, which becomes the training
corpus while the tuning slice and held-out test stay the bundled ones. Everything but the bundled
corpus is read from disk as windows need it, never whole into memory. Files whose name has a published sha256
are checked against it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import zstandard

from btnode.data import DEFAULT_CACHE_GB
from btnode.data.identity import BUNDLED, data_id, manifest_id
from btnode.data.manifest import SPLITS, Manifest, Shard, Split, is_dataset, read_manifest
from btnode.data.source import ByteSource, MemoryBytes, ShardedBytes, unigram_entropy, verify_shard
from btnode.errors import DataError

__all__ = ["Corpus", "bundled", "load", "unigram_entropy"]

TUNE_BYTES = 65_536
KNOWN_SHA256 = {
    "wiki.train.raw": "6707892fa3788b5ab9ed78ab5ff37d9fe825f6011a2ad4fcd6a6d467f0e7da57",
    "wiki.valid.raw": "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7",
    "wiki.test.raw": "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
}
WIKITEXT_FILES = ("wiki.train.raw", "wiki.valid.raw", "wiki.test.raw")
MAX_BUNDLED_BYTES = 4 << 20  # decompression bound for the bundled files


@dataclass(frozen=True)
class Corpus:
    train: ByteSource
    tune: ByteSource
    test: ByteSource
    source: str  # human-readable: where each role came from (printed beside every number)
    ident: str = BUNDLED  # what the training data is, stated when a worker joins (btnode.data.identity)


def size_text(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _check_known(name: str, chunks: Iterable[bytes], origin: str) -> None:
    want = KNOWN_SHA256.get(name)
    if want is None:
        return
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    if h.hexdigest() != want:
        raise DataError(f"{origin} does not match the published sha256 of {name} "
                        f"(expected {want[:16]}…, got {h.hexdigest()[:16]}…): the file is truncated or altered")


def bundled_file(name: str) -> bytes:
    """Decompress and verify one bundled WikiText-2 file (wiki.valid.raw or wiki.test.raw)."""
    ref = resources.files("btnode.data") / "wikitext" / f"{name}.zst"
    try:
        blob = ref.read_bytes()
        data = zstandard.ZstdDecompressor().decompress(blob, max_output_size=MAX_BUNDLED_BYTES)
    except (OSError, zstandard.ZstdError) as exc:
        raise DataError(f"bundled corpus file {name} cannot be read: {exc}") from exc
    _check_known(name, [data], f"bundled {name}")
    return data


def bundled() -> Corpus:
    valid = bundled_file("wiki.valid.raw")
    return Corpus(train=MemoryBytes(valid[:-TUNE_BYTES],
                                    "bundled WikiText-2 train (wiki.valid.raw less its last 64 KiB)"),
                  tune=MemoryBytes(valid[-TUNE_BYTES:], "bundled WikiText-2 tune (the last 64 KiB of wiki.valid.raw)"),
                  test=MemoryBytes(bundled_file("wiki.test.raw"), "bundled WikiText-2 test (wiki.test.raw)"),
                  source="bundled WikiText-2: train=valid[:-64KiB], tune=valid[-64KiB:], test=test")


def file_source(path: Path, role: str) -> ShardedBytes:
    """A user's file, read as needed, with clear errors for missing, unreadable or empty files."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.read(1)  # a file that opens but cannot be read (/proc/self/mem) says so here
    except FileNotFoundError as exc:
        raise DataError(f"data file {path} does not exist") from exc
    except OSError as exc:
        raise DataError(f"data file {path} cannot be read: {exc.strerror or exc}") from exc
    if size == 0:
        raise DataError(f"data file {path} is empty")
    source = ShardedBytes.file(path, size, f"data file {path} ({role})")
    _check_known(path.name, (chunk for _, chunk in source.chunks()), f"data file {path}")
    return source


def _wikitext(folder: Path) -> Corpus:
    missing = [n for n in WIKITEXT_FILES if not (folder / n).is_file()]
    if missing:
        raise DataError(f"data folder {folder} lacks {', '.join(missing)} (expected {', '.join(WIKITEXT_FILES)}, "
                        "or a prepared dataset's manifest.json)")
    train, tune, test = (file_source(folder / n, role) for n, role in zip(WIKITEXT_FILES, SPLITS))
    return Corpus(train=train, tune=tune, test=test, source=f"{folder}: train/valid/test files",
                  ident=data_id(folder))


def dataset(manifest: Manifest, locate: Callable[[Shard], Path], origin: str) -> Corpus:
    """A prepared dataset's splits as streams over its shard files; a split it lacks is empty (and refused
    by whatever needs windows from it)."""
    parts = {name: ShardedBytes(manifest.splits.get(name) or Split(name, 0, 0, ()), locate,
                                f"the {name} split of {origin}") for name in SPLITS}
    sizes = " / ".join(f"{name} {size_text(len(s))}" for name, s in parts.items())
    ident = manifest_id(manifest)
    return Corpus(**parts, source=f"{origin} (manifest {ident[:19]}…): {sizes}", ident=ident)


def local_dataset(folder: Path) -> Corpus:
    """A dataset folder: every shard it lists is checked for presence and size before anything runs."""
    manifest = read_manifest(folder)
    origin = f"dataset {folder}"
    for split in manifest.splits.values():
        for shard in split.shards:
            verify_shard(folder / shard.path, shard, f"the {split.name} split of {origin}")
    return dataset(manifest, lambda shard: folder / shard.path, origin)


def load(path: str | Path | None, *, cache_dir: Path | None = None, cache_gb: float = DEFAULT_CACHE_GB) -> Corpus:
    """The corpus for `path` (None: bundled), following the roles in the module docstring. A URL's
    shards are fetched into `cache_dir` as windows need them, using at most `cache_gb` of disk."""
    if path is None:
        return bundled()
    if str(path).startswith(("http://", "https://")):
        from btnode.data.remote import open_remote  # its own module: HTTP, the shard cache

        manifest, locate = open_remote(str(path), cache_dir=cache_dir, cache_gb=cache_gb)
        return dataset(manifest, locate, f"dataset {path}")
    p = Path(path)
    if is_dataset(p):
        return local_dataset(p)
    if p.is_dir():
        return _wikitext(p)
    base = bundled()
    train = file_source(p, "train")
    return Corpus(train=train, tune=base.tune, test=base.test,
                  source=f"train={p} ({size_text(len(train))}, read from disk); tune and test bundled WikiText-2",
                  ident=data_id(p))
