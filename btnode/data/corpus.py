"""Where the bytes come from, and which bytes play which role.

Default (bundled, zstd-compressed copies of WikiText-2 raw; see wikitext/SOURCE.md):
  training corpus = wiki.valid.raw without its last 65,536 bytes
  tuning slice    = the last 65,536 bytes of wiki.valid.raw (for choosing settings only)
  held-out test   = wiki.test.raw (headline numbers)
A user path may be a folder holding wiki.train.raw, wiki.valid.raw and wiki.test.raw (full
WikiText-2: train / tune / test), or a single file, which becomes the training corpus while the
tuning slice and held-out test stay the bundled ones. Files whose name has a published sha256
are checked against it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import zstandard

from btnode.errors import DataError

TUNE_BYTES = 65_536
KNOWN_SHA256 = {
    "wiki.train.raw": "6707892fa3788b5ab9ed78ab5ff37d9fe825f6011a2ad4fcd6a6d467f0e7da57",
    "wiki.valid.raw": "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7",
    "wiki.test.raw": "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
}
MAX_BUNDLED_BYTES = 4 << 20  # decompression bound for the bundled files


@dataclass(frozen=True)
class Corpus:
    train: bytes
    tune: bytes
    test: bytes
    source: str  # human-readable description of where each role came from


def _check(name: str, data: bytes, origin: str) -> bytes:
    if not data:
        raise DataError(f"{origin} is empty")
    want = KNOWN_SHA256.get(name)
    if want is not None:
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            raise DataError(f"{origin} does not match the published sha256 of {name} "
                            f"(expected {want[:16]}…, got {got[:16]}…): the file is truncated or altered")
    return data


def bundled_file(name: str) -> bytes:
    """Decompress and verify one bundled WikiText-2 file (wiki.valid.raw or wiki.test.raw)."""
    ref = resources.files("btnode.data") / "wikitext" / f"{name}.zst"
    try:
        blob = ref.read_bytes()
        data = zstandard.ZstdDecompressor().decompress(blob, max_output_size=MAX_BUNDLED_BYTES)
    except (OSError, zstandard.ZstdError) as exc:
        raise DataError(f"bundled corpus file {name} cannot be read: {exc}") from exc
    return _check(name, data, f"bundled {name}")


def read_file(path: Path) -> bytes:
    """Read a user-supplied corpus file, with clear errors for missing, unreadable or empty files."""
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise DataError(f"data file {path} does not exist") from exc
    except IsADirectoryError as exc:
        raise DataError(f"data path {path} is a directory without the WikiText files") from exc
    except OSError as exc:
        raise DataError(f"data file {path} cannot be read: {exc.strerror or exc}") from exc
    return _check(path.name, data, f"data file {path}")


def bundled() -> Corpus:
    valid = bundled_file("wiki.valid.raw")
    return Corpus(train=valid[:-TUNE_BYTES], tune=valid[-TUNE_BYTES:], test=bundled_file("wiki.test.raw"),
                  source="bundled WikiText-2: train=valid[:-64KiB], tune=valid[-64KiB:], test=test")


def load(path: str | Path | None) -> Corpus:
    """The corpus for `path` (None: bundled), following the roles in the module docstring."""
    if path is None:
        return bundled()
    p = Path(path)
    if p.is_dir():
        names = ["wiki.train.raw", "wiki.valid.raw", "wiki.test.raw"]
        missing = [n for n in names if not (p / n).is_file()]
        if missing:
            raise DataError(f"data folder {p} lacks {', '.join(missing)} (expected {', '.join(names)})")
        train, tune, test = (read_file(p / n) for n in names)
        return Corpus(train=train, tune=tune, test=test, source=f"{p}: train/valid/test files")
    base = bundled()
    return Corpus(train=read_file(p), tune=base.tune, test=base.test,
                  source=f"train={p}; tune and test bundled")


def unigram_entropy(data: bytes) -> float:
    """Entropy of the byte distribution of `data`, nats/byte: the best any unigram model can do on it."""
    import math
    from collections import Counter

    counts = Counter(data)
    n = len(data)
    return -sum(c / n * math.log(c / n) for c in counts.values())
