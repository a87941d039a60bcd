"""`btnode data prepare`: documents from text, JSONL and Parquet sources, each assigned to train / tune
/ test by a hash of its content, streamed into the shards of a dataset folder (btnode/data/manifest.py).

The split is a pure function of a document's bytes: the first 8 bytes of its sha256, read as a
fraction of 2^64, below `test` go to test, below `test + tune` to tune, the rest to train. The same
document lands in the same split whatever the input order, and a repeated document never straddles
two splits. The manifest is written last, so a crashed run leaves no dataset behind.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from btnode.data import readers
from btnode.data.manifest import (DEFAULT_SHARD_BYTES, MANIFEST, SPLITS, Manifest, ShardWriter, read_manifest)
from btnode.data.readers import Skip, SourceReport
from btnode.durable import fsync_dir
from btnode.errors import ConfigError, DataError
from btnode.settings import flag

log = logging.getLogger(__name__)

TUNE = 0.01
TEST = 0.01
SEPARATOR = b"\n\n"
HASH_RULE = "sha256(document)[:8] as a big-endian fraction of 2^64: < test → test, < test + tune → tune, else train"


def unescape(text: str) -> bytes:
    """A separator as typed: backslash escapes (\\n, \\r, \\t, \\\\, \\xNN) become their bytes."""
    try:
        return codecs.escape_decode(text.encode())[0]
    except ValueError as exc:
        raise ValueError(f"--separator {text!r}: {exc}") from None


def escape(data: bytes) -> str:
    return codecs.escape_encode(data)[0].decode()


@dataclass(frozen=True)
class PrepareConfig:
    text_field: str = flag("--text-field", "The JSONL key or Parquet column that holds a document's text.",
                           default="text")
    tune: float = flag("--tune", "Share of documents (by content hash) in the tune split.", default=TUNE)
    test: float = flag("--test", "Share of documents (by content hash) in the test split.", default=TEST)
    separator: bytes = flag("--separator", "Written between documents in a split's stream; backslash escapes "
                            "(\\n, \\t, \\xNN) are read as bytes.", default=SEPARATOR, value=str,
                            parse=unescape, format=escape)
    shard_bytes: int = flag("--shard-mb", "Shard size in MiB (a split's last shard may be shorter).",
                            default=DEFAULT_SHARD_BYTES, value=float, parse=lambda mb: round(mb * 2**20),
                            format=lambda n: n / 2**20)
    strict: bool = flag("--strict", "Stop with an error at the first bad input instead of counting and skipping it.",
                        default=False)
    force: bool = flag("--force", "Write into a folder that is not empty, replacing the dataset in it.", default=False)
    max_document: int = readers.MAX_DOCUMENT_BYTES  # a longer paragraph is cut, a longer JSONL line skipped

    def check(self) -> None:
        if not (0 <= self.tune <= 1 and 0 <= self.test <= 1 and self.tune + self.test < 1):
            raise ConfigError(f"--tune {self.tune} and --test {self.test} must be fractions adding up to less than 1")
        if not self.separator:
            raise ConfigError("the document separator must be at least one byte")
        if self.shard_bytes < 1:
            raise ConfigError(f"the shard size must be at least 1 byte, not {self.shard_bytes}")


@dataclass
class PrepareProgress:
    """Where a prepare stands; handed to the progress callback after every batch of documents."""

    bytes_total: int  # of all sources, on disk
    bytes_read: int = 0
    documents: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


class HashSplit:
    """Which split a document belongs to, from its content alone."""

    def __init__(self, tune: float, test: float):
        self.test_below = int(test * 2**64)
        self.tune_below = int((test + tune) * 2**64)

    def assign(self, documents: list[bytes]) -> dict[str, list[bytes]]:
        """The documents of each split, in their order (one loop, no call per document)."""
        out: dict[str, list[bytes]] = {name: [] for name in SPLITS}
        train, tune, test = out["train"].append, out["tune"].append, out["test"].append
        sha256, test_below, tune_below = hashlib.sha256, self.test_below, self.tune_below
        for doc in documents:
            u = int.from_bytes(sha256(doc).digest()[:8], "big")
            (test if u < test_below else tune if u < tune_below else train)(doc)
        return out


def prepare(paths: list[Path], out: Path, config: PrepareConfig = PrepareConfig(),
            progress: Callable[[PrepareProgress], None] | None = None) -> Manifest:
    """Read every source once, in order, and write the dataset folder `out`; returns its manifest."""
    config.check()
    found = readers.sources(paths)
    _clear(Path(out), config.force)
    split = HashSplit(config.tune, config.test)
    writers = {name: ShardWriter(out, name, config.separator, config.shard_bytes) for name in SPLITS}
    state = PrepareProgress(bytes_total=sum(s.size for s in found))
    reports = [SourceReport(source) for source in found]
    try:
        for report in reports:
            done_before = state.bytes_read
            for batch in readers.documents(report, text_field=config.text_field, max_document=config.max_document):
                for name, docs in split.assign(batch).items():
                    writers[name].add_many(docs)
                state.bytes_read, state.documents = done_before + report.bytes, state.documents + len(batch)
                if progress is not None:
                    progress(state)
                _strict(config, report)
            _strict(config, report)
            if report.skipped:
                log.warning("%s: skipped %s", report.source.path, _kinds(report.skipped))
        splits = {n: w.close() for n, w in writers.items()}
    except OSError as exc:  # reading errors are counted in `documents`; this is the output side
        raise DataError(f"cannot write the dataset in {out}: {exc.strerror or exc}") from exc
    return _finish(Path(out), config, splits, reports)


def _strict(config: PrepareConfig, report: SourceReport) -> None:
    if config.strict and report.skipped:
        why = f": {report.why}" if report.why else ""
        raise DataError(f"{report.source.path}: bad input ({_kinds(report.skipped)}){why}; --strict stops at it "
                        f"(without --strict bad input is counted and skipped)")


def _kinds(skipped: Counter) -> str:
    return ", ".join(f"{n} {kind.value}" for kind, n in sorted(skipped.items()) if n)


def _finish(out: Path, config: PrepareConfig, splits: dict, reports: list[SourceReport]) -> Manifest:
    skipped: Counter = Counter({kind: 0 for kind in Skip})
    for r in reports:
        skipped.update(r.skipped)
    manifest = Manifest(
        separator=config.separator, splits=splits, documents=sum(s.documents for s in splits.values()),
        sources=tuple(r.to_dict() for r in reports), skipped={k.value: n for k, n in skipped.items()},
        split_rule={"hash": HASH_RULE, "tune": config.tune, "test": config.test},
        extra={"text_field": config.text_field, "shard_bytes": config.shard_bytes,
               "max_document_bytes": config.max_document, "cut": sum(r.cut for r in reports),
               "document_rule": "text: a paragraph (lines up to a blank line), cut every max_document_bytes; "
                                "jsonl: the text_field of each line's object; parquet: the text_field column of each row"})
    if manifest.documents == 0:
        raise DataError(f"no documents in {', '.join(r['path'] for r in manifest.sources)}")
    manifest.write(out)
    fsync_dir(out)
    return manifest


def _clear(out: Path, force: bool) -> None:
    """Make `out` ready: created if missing; if not empty, refused unless `force`, which removes the
    old manifest first (so a crash cannot leave it naming new shards) and then the old shards."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    if not any(out.iterdir()):
        return
    if not force:
        raise DataError(f"--out {out} is not empty (--force replaces the dataset in it)")
    (out / MANIFEST).unlink(missing_ok=True)
    fsync_dir(out)
    for name in SPLITS:
        for old in sorted((out / name).glob("*.bin")) if (out / name).is_dir() else ():
            old.unlink()


def verify(folder: Path, progress: Callable[[int, int], None] | None = None) -> Manifest:
    """Re-hash every shard against the manifest; the first missing, resized or altered one is a
    DataError naming it. `progress(bytes_done, bytes_total)` after each shard."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    total = sum(s.bytes for s in manifest.splits.values())
    done = 0
    for split in manifest.splits.values():
        for shard in split.shards:
            path = folder / shard.path
            try:
                size = path.stat().st_size
                if size != shard.bytes:
                    raise DataError(f"shard {path} holds {size} bytes, the manifest says {shard.bytes}")
                with open(path, "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
            except OSError as exc:
                raise DataError(f"shard {path} cannot be read: {exc.strerror or exc}") from exc
            if digest != shard.sha256:
                raise DataError(f"shard {path} does not match its sha256 in the manifest "
                                f"(expected {shard.sha256[:16]}…, got {digest[:16]}…)")
            done += shard.bytes
            if progress is not None:
                progress(done, total)
    return manifest
