"""A prepared dataset on disk: its manifest, and the shard writer that `btnode data prepare` uses.

A dataset folder holds `manifest.json` and, per split, uint8 shards that can be memory-mapped:

    DIR/manifest.json
    DIR/train/000000.bin  DIR/train/000001.bin  …
    DIR/tune/000000.bin
    DIR/test/000000.bin

A split's bytes are its documents joined by the separator; its shards, concatenated in order, are
exactly that stream (a shard boundary may fall inside a document; a split boundary never does).
Every shard is listed with its size and sha256, so a reader can check what it was given, locally
or over HTTP. Paths in the manifest are relative to its folder and may not leave it.

The manifest is written with sorted keys and no timestamps: the same inputs give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from btnode.durable import atomic_write
from btnode.errors import DataError

FORMAT = "btnode-dataset"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "tune", "test")
DEFAULT_SHARD_BYTES = 256 << 20
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is a few KB per thousand shards; more is hostile


@dataclass(frozen=True)
class Shard:
    path: str  # relative to the manifest's folder, POSIX separators
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Split:
    name: str
    bytes: int  # the split's stream: sum of its shards' sizes
    documents: int
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class Manifest:
    separator: bytes  # placed between documents
    splits: dict[str, Split]
    documents: int
    sources: tuple[dict[str, Any], ...] = ()  # what was read: path, format, bytes, documents
    skipped: dict[str, int] = field(default_factory=dict)  # bad input, counted by kind
    split_rule: dict[str, Any] = field(default_factory=dict)  # how documents were assigned to splits
    extra: dict[str, Any] = field(default_factory=dict)  # text_field, shard_bytes, … (informative)

    def split(self, name: str) -> Split:
        if name not in self.splits:
            raise DataError(f"the dataset has no {name!r} split (it has {', '.join(self.splits) or 'none'})")
        return self.splits[name]

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "separator": self.separator.hex(),
            "documents": self.documents,
            "splits": {n: {"bytes": s.bytes, "documents": s.documents, "shards": [asdict(h) for h in s.shards]}
                       for n, s in self.splits.items()},
            "sources": list(self.sources),
            "skipped": dict(self.skipped),
            "split_rule": dict(self.split_rule),
            **({"extra": dict(self.extra)} if self.extra else {}),
        }
        return json.dumps(doc, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, origin: str = "manifest") -> Manifest:
        """Parse and check a manifest: every field typed, sizes add up, paths stay in the folder."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise DataError(f"{origin}: {len(text)} bytes is more than a manifest may hold ({MAX_MANIFEST_BYTES})")
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise DataError(f"{origin} is not JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise DataError(f"{origin} is not a btnode dataset manifest (format {FORMAT!r} expected)")
        if doc.get("version") != FORMAT_VERSION:
            raise DataError(f"{origin}: manifest version {doc.get('version')!r} is not {FORMAT_VERSION}")
        try:
            separator = bytes.fromhex(doc["separator"])
            splits = {}
            for name, s in doc["splits"].items():
                if name not in SPLITS:
                    raise DataError(f"{origin}: unknown split {name!r} (splits are {', '.join(SPLITS)})")
                shards = tuple(Shard(path=_safe_path(h["path"], origin), bytes=_count(h["bytes"], origin),
                                     sha256=_digest(h["sha256"], origin)) for h in s["shards"])
                total = _count(s["bytes"], origin)
                if total != sum(h.bytes for h in shards):
                    raise DataError(f"{origin}: split {name} says {total} bytes but its shards hold "
                                    f"{sum(h.bytes for h in shards)}")
                splits[name] = Split(name=name, bytes=total, documents=_count(s["documents"], origin), shards=shards)
            return cls(separator=separator, splits=splits, documents=_count(doc["documents"], origin),
                       sources=tuple(doc.get("sources", ())), skipped=dict(doc.get("skipped", {})),
                       split_rule=dict(doc.get("split_rule", {})), extra=dict(doc.get("extra", {})))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise DataError(f"{origin} is malformed: {type(exc).__name__}: {exc}") from exc

    def write(self, folder: Path) -> Path:
        path = Path(folder) / MANIFEST
        atomic_write(path, self.to_json().encode())
        return path


def read_manifest(folder: Path) -> Manifest:
    path = Path(folder) / MANIFEST
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise DataError(f"dataset manifest {path} cannot be read: {exc.strerror or exc}") from exc
    return Manifest.from_json(text, origin=str(path))


def is_dataset(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def _safe_path(value: object, origin: str) -> str:
    """A shard path relative to the manifest's folder: no absolute paths, no '..', no backslashes."""
    if not isinstance(value, str) or not value or "\\" in value or "\0" in value:
        raise DataError(f"{origin}: shard path {value!r} is not a relative POSIX path")
    p = PurePosixPath(value)
    if p.is_absolute() or ".." in p.parts or p.parts[0] in ("", "."):
        raise DataError(f"{origin}: shard path {value!r} escapes the dataset folder")
    return value


def _count(value: object, origin: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DataError(f"{origin}: {value!r} is not a non-negative integer")
    return value


def _digest(value: object, origin: str) -> str:
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise DataError(f"{origin}: {value!r} is not a sha256 hex digest")
    return value


class ShardWriter:
    """Writes one split's stream as consecutive shards of `shard_bytes` (the last may be shorter),
    hashing as it goes; `close()` returns the split's entry. Documents are added whole; the writer
    puts the separator between them."""

    def __init__(self, folder: Path, name: str, separator: bytes, shard_bytes: int = DEFAULT_SHARD_BYTES):
        if shard_bytes < 1:
            raise DataError(f"shard size must be at least 1 byte, not {shard_bytes}")
        self.folder, self.name, self.separator, self.shard_bytes = Path(folder), name, separator, shard_bytes
        (self.folder / name).mkdir(parents=True, exist_ok=True)
        self.shards: list[Shard] = []
        self.documents = 0
        self._file = None
        self._hash = hashlib.sha256()
        self._in_shard = 0

    def add(self, document: bytes) -> None:
        if self.documents:
            self._write(self.separator)
        self._write(document)
        self.documents += 1

    def add_many(self, documents: list[bytes]) -> None:
        """Documents in order, written as one block (per-document writes cost more than the hashing)."""
        if documents:
            if self.documents:
                self._write(self.separator)
            self._write(self.separator.join(documents))
            self.documents += len(documents)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._file is None:
                rel = f"{self.name}/{len(self.shards):06d}.bin"
                self._rel, self._file = rel, open(self.folder / rel, "wb")
            take = min(len(view), self.shard_bytes - self._in_shard)
            self._file.write(view[:take])
            self._hash.update(view[:take])
            self._in_shard += take
            view = view[take:]
            if self._in_shard == self.shard_bytes:
                self._seal()

    def _seal(self) -> None:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards.append(Shard(path=self._rel, bytes=self._in_shard, sha256=self._hash.hexdigest()))
        self._file, self._hash, self._in_shard = None, hashlib.sha256(), 0

    def close(self) -> Split:
        if self._file is not None:
            self._seal()
        return Split(name=self.name, bytes=sum(s.bytes for s in self.shards), documents=self.documents,
                     shards=tuple(self.shards))


def write_dataset(folder: Path, documents: dict[str, list[bytes]], *, separator: bytes = b"\n\n",
                  shard_bytes: int = DEFAULT_SHARD_BYTES, sources: tuple[dict[str, Any], ...] = ()) -> Manifest:
    """A dataset from documents already assigned to splits (tests and small tools; `btnode data
    prepare` is the streaming way, with the hash split)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    splits = {}
    for name in SPLITS:
        w = ShardWriter(folder, name, separator, shard_bytes)
        for d in documents.get(name, []):
            w.add(d)
        splits[name] = w.close()
    m = Manifest(separator=separator, splits=splits, documents=sum(s.documents for s in splits.values()),
                 sources=sources)
    m.write(folder)
    return m
