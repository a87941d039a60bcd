"""Documents out of the files `btnode data prepare` is given: plain text, JSONL (plain, .gz, .zst) and
Parquet, each read as a stream in bounded blocks, so memory does not grow with the input. Bad input
is counted by kind in the source's `SourceReport`, never dropped silently.

What counts as a document:
  plain text  a paragraph: lines up to a blank line (one holding only spaces, tabs or \\r). Blank lines
              separate documents and are not documents themselves. A paragraph longer than
              `max_document` bytes is cut every `max_document` bytes (counted as `cut`).
  JSONL       one JSON object per line; its `text_field` string, UTF-8 encoded. Blank lines are skipped.
  Parquet     one row; its `text_field` column (string or binary), read batch by batch.
"""

from __future__ import annotations

import enum
import gzip
import json
import logging
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import zstandard

from btnode.errors import DataError

log = logging.getLogger(__name__)

BLOCK_BYTES = 4 << 20  # one read; a reader holds at most a block plus one document
MAX_DOCUMENT_BYTES = 16 << 20  # longer paragraphs are cut; longer JSONL lines are skipped (too_long)
PARQUET_BATCH_ROWS = 1024
# The end of a line, then one or more blank lines. Starting with a literal \n keeps `re` on its fast
# path (ten times faster than with \r? in front); a \r left before it is taken off the paragraph.
BLANK_LINES = re.compile(rb"\n(?:[ \t\r]*\n)+")
LEADING_BLANK = re.compile(rb"(?:[ \t\r]*\n)+")
TRAILING_BLANK = re.compile(rb"(?:\r?\n[ \t\r]*)+\Z")
TEXT_SUFFIXES = (".txt", ".raw", ".txt.gz", ".txt.zst")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)


class Format(str, enum.Enum):
    TEXT = "text"
    JSONL = "jsonl"
    PARQUET = "parquet"


class Skip(str, enum.Enum):
    """Kinds of bad input. Each is counted; `--strict` makes any of them an error."""

    NOT_JSON = "not_json"  # a JSONL line that does not parse (or is not UTF-8)
    NO_TEXT = "no_text"  # a record without the text field, or with a non-string value there
    EMPTY = "empty"  # a document of no bytes or only whitespace (a text file with nothing in it)
    TOO_LONG = "too_long"  # a JSONL line longer than the document cap
    UNREADABLE = "unreadable"  # a file that cannot be opened or read to its end (I/O error, bad gzip/zstd/Parquet)


@dataclass(frozen=True)
class Source:
    path: Path  # as given on the command line (a folder's files: the folder as given / their relative path)
    format: Format
    size: int  # bytes on disk


@dataclass
class SourceReport:
    """What one source gave: bytes read from disk, documents, cuts and skips by kind."""

    source: Source
    bytes: int = 0
    documents: int = 0
    cut: int = 0
    skipped: Counter = field(default_factory=Counter)
    why: str = ""  # the first file-level reason given (unreadable, no text column), for messages

    def skip(self, kind: Skip, n: int = 1, why: str = "") -> None:
        self.skipped[kind] += n
        if why:
            self.why = self.why or why
            log.warning("%s: %s (%s)", self.source.path, why, kind.value)

    def to_dict(self) -> dict:
        return {"path": self.source.path.as_posix(), "format": self.source.format.value, "bytes": self.bytes,
                "documents": self.documents, "cut": self.cut,
                "skipped": {k.value: n for k, n in sorted(self.skipped.items()) if n}}


def format_of(path: Path) -> Format | None:
    """The format a file's name says; None for a name a folder walk does not take."""
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return Format.JSONL
    if name.endswith(PARQUET_SUFFIXES):
        return Format.PARQUET
    if name.endswith(TEXT_SUFFIXES):
        return Format.TEXT
    return None


def sources(paths: list[Path]) -> list[Source]:
    """Each path given, in order: a file as itself (text unless its name says JSONL or Parquet), a
    folder as its .txt/.raw/.jsonl*/.parquet files in sorted order (hidden ones skipped, others
    logged and left out). A path that does not exist is an error before anything is written."""
    found: list[Source] = []
    for given in paths:
        try:
            found.extend(_walk(given))
        except OSError as exc:
            raise DataError(f"{given} cannot be listed: {exc.strerror or exc}") from exc
    if not found:
        raise DataError(f"no input files in {', '.join(str(p) for p in paths)}")
    return found


def _walk(given: Path) -> list[Source]:
    if given.is_file():
        return [Source(given, format_of(given) or Format.TEXT, given.stat().st_size)]
    if not given.is_dir():
        raise DataError(f"{given}: no such file or folder")
    files = sorted(p for p in given.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(given).parts))
    taken = [p for p in files if format_of(p) is not None]
    if len(taken) < len(files):
        log.info("%s: %d files left out (names not ending in %s)", given, len(files) - len(taken),
                 ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES))
    return [Source(given / p.relative_to(given), format_of(p), p.stat().st_size) for p in taken]


def documents(report: SourceReport, *, text_field: str = "text", block: int = BLOCK_BYTES,
              max_document: int = MAX_DOCUMENT_BYTES) -> Iterator[list[bytes]]:
    """The source's documents, a batch at a time (one per block read). A file that fails part way
    keeps the documents read before the failure and counts as `unreadable`."""
    src = report.source
    try:
        if src.format is Format.PARQUET:
            yield from parquet_documents(report, text_field, max_document)
            return
        with open(src.path, "rb", buffering=0) as raw:
            chunks = _chunks(raw, src.path, block)
            if src.format is Format.TEXT:
                batches = text_documents(chunks, report, max_document=max_document)
            else:
                batches = jsonl_documents(chunks, report, text_field, max_document=max_document)
            for batch in batches:
                report.bytes = raw.tell()
                yield batch
            report.bytes = raw.tell()
    except (OSError, EOFError, zlib.error, zstandard.ZstdError) as exc:
        report.skip(Skip.UNREADABLE, why=f"cannot be read: {getattr(exc, 'strerror', None) or exc}")


def _chunks(raw: BinaryIO, path: Path, block: int) -> Iterator[bytes]:
    """The file's bytes, decompressed by its suffix, `block` bytes at most at a time."""
    name = path.name.lower()
    if name.endswith(".zst"):
        f = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False)
    else:
        f = gzip.GzipFile(fileobj=raw, mode="rb") if name.endswith(".gz") else raw
    while data := f.read(block):
        yield data
    if name.endswith(".zst") and not zstd_frames_complete(path):
        raise EOFError("the zstd stream ends inside a frame (truncated?)")


def zstd_frames_complete(path: Path) -> bool:
    """Whether every zstd frame in the file ends (python-zstandard's readers stop silently at a
    truncated one, where gzip raises). Walks the frame and block headers, decompressing nothing."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        while magic := f.read(4):
            kind = int.from_bytes(magic, "little")
            if 0x184D2A50 <= kind <= 0x184D2A5F:  # a skippable frame: its length, then that many bytes
                f.seek(int.from_bytes(f.read(4), "little"), 1)
                continue
            descriptor = f.read(1)
            if len(magic) < 4 or kind != 0xFD2FB528 or not descriptor:
                return False
            d = descriptor[0]
            single = bool(d & 0x20)
            f.seek((0, 2, 4, 8)[d >> 6] + (single and d >> 6 == 0) + (not single) + (0, 1, 2, 4)[d & 3], 1)
            last = False
            while not last:
                header = f.read(3)
                if len(header) < 3:
                    return False
                h = int.from_bytes(header, "little")
                last = bool(h & 1)
                f.seek(1 if (h >> 1) & 3 == 1 else h >> 3, 1)  # an RLE block holds one byte
            f.seek(4 if d & 4 else 0, 1)  # the content checksum
            if f.tell() > size:
                return False
    return True


def text_documents(chunks: Iterable[bytes], report: SourceReport, *,
                   max_document: int = MAX_DOCUMENT_BYTES) -> Iterator[list[bytes]]:
    """Paragraphs of a plain-text stream, a batch per chunk. Only the tail after the last blank line
    is carried to the next chunk; a paragraph is cut every `max_document` bytes from its start, so
    what is held stays under a chunk plus `max_document` whatever the file. The documents do not
    depend on how the stream is chunked, but for lines of about `max_document` spaces and tabs,
    which a bounded reader cannot hold whole until it knows whether they are blank lines."""
    carry = b""
    fresh = True  # the carry starts a paragraph (it follows blank lines or starts the file)
    pending = False  # the carry is the rest of a cut paragraph: one more cut if anything of it follows
    seen_any = False
    for data in chunks:
        buf = carry + data if carry else data
        pieces = BLANK_LINES.split(_lstrip_blank(buf) if fresh else buf)
        carry = pieces.pop()
        if pieces:
            if b"\r" in buf:
                pieces = [p[:-1] if p.endswith(b"\r") else p for p in pieces]
            report.cut += pending and bool(pieces[0])
            batch, fresh, pending = _cut([p for p in pieces if p], max_document, report), True, False
        elif len(carry) > max_document and fresh and not carry.strip(b" \t\r"):
            carry, batch = carry[-max_document:], []  # blanks that may yet end a blank line: hold a bounded tail
        elif len(carry) > max_document:  # no blank line in sight: emit the paragraph's whole chunks so far
            keep = (_uncommitted(carry, max_document) - 1) // max_document * max_document
            batch = [carry[i:i + max_document] for i in range(0, keep, max_document)]
            report.cut += len(batch) - 1 + pending
            carry, fresh, pending = carry[keep:], False, True
        else:
            batch = []  # still inside one paragraph
        seen_any = seen_any or bool(batch)
        report.documents += len(batch)
        yield batch
    tail = TRAILING_BLANK.sub(b"", _lstrip_blank(carry) if fresh else carry)
    if tail and not (fresh and tail.isspace()):  # blanks after a cut are the paragraph's own
        report.cut += pending
        batch = _cut([tail], max_document, report)
        report.documents += len(batch)
        yield batch
    elif not seen_any:
        report.skip(Skip.EMPTY, why="no text in the file")


def _uncommitted(carry: bytes, max_document: int) -> int:
    """Where a cut may no longer fall: before a last line of blanks, which may yet make a blank line
    (unless it is too long to matter)."""
    nl = carry.rfind(b"\n")
    if nl >= 0 and len(carry) - nl <= max_document and not carry[nl + 1:].strip(b" \t\r"):
        return nl
    return len(carry)


def _lstrip_blank(piece: bytes) -> bytes:
    m = LEADING_BLANK.match(piece)
    return piece[m.end():] if m else piece


def _cut(pieces: list[bytes], max_document: int, report: SourceReport) -> list[bytes]:
    """Pieces longer than `max_document` split into `max_document`-sized documents (each cut counted)."""
    if all(len(p) <= max_document for p in pieces):
        return pieces
    out = []
    for p in pieces:
        if len(p) > max_document:
            report.cut += (len(p) - 1) // max_document
            out.extend(p[i:i + max_document] for i in range(0, len(p), max_document))
        else:
            out.append(p)
    return out


def jsonl_documents(chunks: Iterable[bytes], report: SourceReport, text_field: str, *,
                    max_document: int = MAX_DOCUMENT_BYTES) -> Iterator[list[bytes]]:
    """One document per JSON line, a batch per chunk; a line longer than `max_document` is dropped as
    it streams past (counted as too_long), never held whole."""
    carry = b""
    dropping = False  # inside a too-long line: discard up to its newline
    for data in chunks:
        if dropping:
            nl = data.find(b"\n")
            if nl < 0:
                continue
            data, dropping = data[nl + 1:], False
        lines = (carry + data if carry else data).split(b"\n")
        carry = lines.pop()
        if len(carry) > max_document:
            report.skip(Skip.TOO_LONG)
            carry, dropping = b"", True
        yield _records(lines, report, text_field, max_document)
    if carry and not dropping:
        yield _records([carry], report, text_field, max_document)


def _records(lines: list[bytes], report: SourceReport, text_field: str, max_document: int) -> list[bytes]:
    batch: list[bytes | None] = []
    for line in lines:
        if not line or line.isspace():
            continue
        if len(line) > max_document:
            report.skip(Skip.TOO_LONG)
            continue
        try:
            record = json.loads(line)
            value = record.get(text_field) if isinstance(record, dict) else None
            batch.append(value.encode() if isinstance(value, str) else None)
        except (ValueError, UnicodeError):  # not JSON, not UTF-8, or a lone surrogate in the string
            report.skip(Skip.NOT_JSON)
    return _checked(batch, report)


def parquet_documents(report: SourceReport, text_field: str, max_document: int) -> Iterator[list[bytes]]:
    """One document per row of the `text_field` column (string or binary), read in batches of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(report.source.path, pre_buffer=False)  # pre-buffering reads the whole file ahead
        rows, schema = pf.metadata.num_rows, pf.schema_arrow
        kind = schema.field(text_field).type if text_field in schema.names else None
        if kind is None or not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                                or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
            report.skip(Skip.NO_TEXT, rows, why=f"no string column {text_field!r} (columns: {', '.join(schema.names)})")
            report.bytes = report.source.size
            return
        done = 0
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
            docs = [value.encode() if isinstance(value, str) else value for value in batch.column(0).to_pylist()]
            done += batch.num_rows
            report.bytes = report.source.size * done // max(rows, 1)
            yield _cut(_checked(docs, report), max_document, report)
    except pa.ArrowException as exc:
        report.skip(Skip.UNREADABLE, why=f"cannot be read as Parquet: {exc}")


def _checked(docs: list[bytes | None], report: SourceReport) -> list[bytes]:
    """The documents that hold text; missing (None) and blank ones counted."""
    batch = []
    for doc in docs:
        if doc is None:
            report.skip(Skip.NO_TEXT)
        elif not doc or doc.isspace():
            report.skip(Skip.EMPTY)
        else:
            batch.append(doc)
    report.documents += len(batch)
    return batch
