"""`btnode data prepare`: every input format read to the same documents, the hash split a pure function
of content, byte-identical re-runs, bad input counted by kind (or an error under --strict), shard
bounds, `verify` catching a flipped byte, bounded memory, and the real CLI end to end."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from btnode.data.manifest import SPLITS, is_dataset, read_manifest
from btnode.data.prepare import HashSplit, PrepareConfig, prepare, verify
from btnode.data.readers import (Format, Skip, Source, SourceReport, documents, format_of, jsonl_documents,
                                 text_documents)
from btnode.errors import ConfigError, DataError
from procs import CLI

DOCS = [f"document {i}: {'word ' * (i % 7)}end".encode() for i in range(200)]


def split_docs(folder: Path) -> dict[str, list[bytes]]:
    """Each split's documents, read back from its shards."""
    m = read_manifest(folder)
    out = {}
    for name, s in m.splits.items():
        stream = b"".join((folder / h.path).read_bytes() for h in s.shards)
        out[name] = stream.split(m.separator) if stream else []
        assert len(out[name]) == s.documents
    return out


def all_docs(folder: Path) -> list[bytes]:
    return sorted(d for docs in split_docs(folder).values() for d in docs)


def jsonl(docs: list[bytes], field: str = "text") -> bytes:
    return b"".join(json.dumps({field: d.decode(), "id": i}).encode() + b"\n" for i, d in enumerate(docs))


def report_for(fmt: Format = Format.TEXT) -> SourceReport:
    return SourceReport(Source(Path("x"), fmt, 0))


def chunked(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def text_docs(data: bytes, size: int, max_document: int = 1 << 20) -> tuple[list[bytes], int]:
    report = report_for()
    docs = [d for batch in text_documents(chunked(data, size), report, max_document=max_document) for d in batch]
    return docs, report.cut


# ---------------------------------------------------------------- formats

def test_each_format_gives_the_same_documents(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\n\n".join(DOCS) + b"\n")
    (tmp_path / "b.jsonl").write_bytes(jsonl(DOCS))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(jsonl(DOCS, "body")))
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(DOCS)))
    pq.write_table(pa.table({"text": [d.decode() for d in DOCS], "n": list(range(len(DOCS)))}),
                   tmp_path / "e.parquet", row_group_size=64)
    for name in ("a.txt", "b.jsonl", "d.jsonl.zst", "e.parquet"):
        m = prepare([tmp_path / name], tmp_path / f"out-{name}")
        assert all_docs(tmp_path / f"out-{name}") == sorted(DOCS), name
        assert m.documents == len(DOCS) and m.sources[0]["documents"] == len(DOCS)
        assert m.sources[0]["bytes"] == (tmp_path / name).stat().st_size
    prepare([tmp_path / "c.jsonl.gz"], tmp_path / "gz", PrepareConfig(text_field="body"))
    assert all_docs(tmp_path / "gz") == sorted(DOCS)


def test_a_folder_is_its_data_files_in_sorted_order(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_bytes(b"two")
    (src / "a.raw").write_bytes(b"one\n\nalso one")
    (src / "sub" / "c.jsonl").write_bytes(jsonl([b"three"]))
    (src / "sub" / "d.txt.gz").write_bytes(gzip.compress(b"four\n"))
    (src / "notes.md").write_bytes(b"left out")
    (src / ".hidden.txt").write_bytes(b"left out")
    m = prepare([src], tmp_path / "out")
    assert [(s["path"], s["format"], s["documents"]) for s in m.sources] == [
        (f"{src}/a.raw", "text", 2), (f"{src}/b.txt", "text", 1), (f"{src}/sub/c.jsonl", "jsonl", 1),
        (f"{src}/sub/d.txt.gz", "text", 1)]
    assert all_docs(tmp_path / "out") == sorted([b"one", b"also one", b"two", b"three", b"four"])


def test_paragraphs_are_split_on_blank_lines_whatever_their_line_endings():
    text = b"\n \n first line\r\nsecond line \r\n\r\n  \t\n\n second para \n\nthird\n \n"
    assert text_docs(text, 1 << 20)[0] == [b" first line\r\nsecond line ", b" second para ", b"third"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([b" ", b"\n", b"\r", b"\t", b"a", b"b"]), max_size=300).map(b"".join), st.integers(1, 40),
       st.integers(3, 50))
def test_paragraphs_and_cuts_do_not_depend_on_how_the_file_is_read(text, size, max_document):
    assume(not re.search(rb"(?:\A|\n)[ \t\r]{%d}" % (max_document - 1), text))  # a line of blanks: see text_documents
    whole = text_docs(text, len(text) + 1, max_document)
    assert text_docs(text, size, max_document) == whole
    docs, cut = whole
    assert all(0 < len(d) <= max_document for d in docs) and (cut or not any(d.isspace() for d in docs))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(st.characters(blacklist_categories=["Cs"]), max_size=30), max_size=20), st.integers(1, 64))
def test_jsonl_lines_do_not_depend_on_how_the_file_is_read(texts, size):
    report = report_for(Format.JSONL)
    docs = [d for batch in jsonl_documents(chunked(jsonl([t.encode() for t in texts]), size), report, "text")
            for d in batch]
    assert docs == [t.encode() for t in texts if t.encode() and not t.encode().isspace()]
    assert report.skipped[Skip.EMPTY] == len(texts) - len(docs)


# ---------------------------------------------------------------- the split

def test_the_split_is_a_function_of_content_alone(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\n\n".join(DOCS[:120]))
    (tmp_path / "b.jsonl").write_bytes(jsonl(DOCS[80:] + DOCS[:10]))  # overlaps a.txt: repeats
    config = PrepareConfig(tune=0.25, test=0.25)
    prepare([tmp_path / "a.txt", tmp_path / "b.jsonl"], tmp_path / "ab", config)
    prepare([tmp_path / "b.jsonl", tmp_path / "a.txt"], tmp_path / "ba", config)
    where = {}
    for folder in ("ab", "ba"):
        for name, docs in split_docs(tmp_path / folder).items():
            for d in docs:
                assert where.setdefault(d, name) == name, f"{d!r} in {where[d]} and {name}"
    assert set(where) == set(DOCS) and set(where.values()) == set(SPLITS)
    assigned = HashSplit(0.25, 0.25).assign(DOCS)
    assert all(where[d] == name for name, docs in assigned.items() for d in docs)
    assert 30 < len(assigned["test"]) < 70 and 30 < len(assigned["tune"]) < 70  # 50 expected of 200


def test_fractions_of_zero_put_everything_in_train_and_bad_fractions_are_refused(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\n\n".join(DOCS))
    m = prepare([tmp_path / "a.txt"], tmp_path / "out", PrepareConfig(tune=0, test=0))
    assert m.split("train").documents == len(DOCS) and m.split("test").documents == 0
    assert m.split_rule["tune"] == 0 and "sha256" in m.split_rule["hash"]
    with pytest.raises(ConfigError, match="fractions"):
        prepare([tmp_path / "a.txt"], tmp_path / "bad", PrepareConfig(tune=0.6, test=0.5))


def test_a_rerun_gives_identical_bytes(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\n\n".join(DOCS) + b"\n\n\n")
    (tmp_path / "b.jsonl").write_bytes(jsonl(DOCS) + b"not json\n")
    config = PrepareConfig(tune=0.2, test=0.2, shard_bytes=500)
    for out in ("one", "two"):
        prepare([tmp_path / "a.txt", tmp_path / "b.jsonl"], tmp_path / out, config)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert len(files) > 10 and files == sorted(p.relative_to(tmp_path / "two")
                                               for p in (tmp_path / "two").rglob("*") if p.is_file())
    for f in files:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f


# ---------------------------------------------------------------- bad input

def test_bad_input_is_counted_by_kind(tmp_path):
    lines = [b'{"text": "fine"}', b"{not json", b'{"body": "no text field"}', b'{"text": 7}', b'["a list"]',
             b'{"text": ""}', b'{"text": "  \\n "}', b"", b'{"text": "' + b"x" * 300 + b'"}', b'\xff{"text": "bad utf8"}',
             b'{"text": "also fine"}']
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines))
    (tmp_path / "empty.txt").write_bytes(b" \n\n \t\n")
    (tmp_path / "broken.jsonl.gz").write_bytes(gzip.compress(jsonl(DOCS))[:200])
    (tmp_path / "broken.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(DOCS * 20))[:300])
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "other.parquet")
    pq.write_table(pa.table({"text": ["fine", None, "", "also"]}), tmp_path / "nulls.parquet")
    names = ["a.jsonl", "empty.txt", "broken.jsonl.gz", "broken.jsonl.zst", "broken.parquet", "other.parquet",
             "nulls.parquet"]
    m = prepare([tmp_path / n for n in names], tmp_path / "out", PrepareConfig(max_document=200))
    by_path = {Path(s["path"]).name: s for s in m.sources}
    assert by_path["a.jsonl"]["skipped"] == {"not_json": 2, "no_text": 3, "empty": 2, "too_long": 1}
    assert by_path["a.jsonl"]["documents"] == 2
    assert by_path["empty.txt"]["skipped"] == {"empty": 1}
    for name in ("broken.jsonl.gz", "broken.jsonl.zst", "broken.parquet"):
        assert by_path[name]["skipped"] == {"unreadable": 1}, name
    assert by_path["other.parquet"]["skipped"] == {"no_text": 2}
    assert by_path["nulls.parquet"]["skipped"] == {"no_text": 1, "empty": 1}
    assert m.skipped == {"not_json": 2, "no_text": 6, "empty": 4, "too_long": 1, "unreadable": 3}
    assert b"fine" in all_docs(tmp_path / "out")


def test_a_line_too_long_is_dropped_as_it_streams_past():
    data = b'{"text": "a"}\n{"text": "' + b"y" * 5000 + b'"}\n{"text": "b"}\n'
    report = report_for(Format.JSONL)
    docs = [d for batch in jsonl_documents(chunked(data, 64), report, "text", max_document=100) for d in batch]
    assert docs == [b"a", b"b"] and report.skipped == {Skip.TOO_LONG: 1}


def test_strict_makes_bad_input_an_error_and_leaves_no_dataset(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl(DOCS) + b"{oops\n")
    with pytest.raises(DataError, match=r"a.jsonl: bad input \(1 not_json\)"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "out", PrepareConfig(strict=True))
    assert not is_dataset(tmp_path / "out")
    (tmp_path / "b.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match=r"b.jsonl.gz: bad input \(1 unreadable\): cannot be read"):
        prepare([tmp_path / "b.jsonl.gz"], tmp_path / "out2", PrepareConfig(strict=True))


def test_missing_sources_and_no_documents_are_errors(tmp_path):
    with pytest.raises(DataError, match="nope.txt: no such file"):
        prepare([tmp_path / "nope.txt"], tmp_path / "out")
    (tmp_path / "blank.txt").write_bytes(b"\n\n")
    with pytest.raises(DataError, match="no documents"):
        prepare([tmp_path / "blank.txt"], tmp_path / "out")


# ---------------------------------------------------------------- shards and the output folder

def test_shards_respect_their_bound_and_concatenate_to_the_split(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\n\n".join(DOCS))
    m = prepare([tmp_path / "a.txt"], tmp_path / "out", PrepareConfig(shard_bytes=97, separator=b"\x00"))
    assigned = HashSplit(0.01, 0.01).assign(DOCS)
    for name, s in m.splits.items():
        sizes = [h.bytes for h in s.shards]
        assert all(n == 97 for n in sizes[:-1]) and 0 < sizes[-1] <= 97 if sizes else s.documents == 0
        stream = b"".join((tmp_path / "out" / h.path).read_bytes() for h in s.shards)
        assert stream == b"\x00".join(assigned[name]) and s.bytes == len(stream)
    assert len(m.split("train").shards) > 50


def test_a_cut_paragraph_is_counted(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"short\n\n" + b"z" * 1000 + b"\n\nshort too")
    m = prepare([tmp_path / "a.txt"], tmp_path / "out", PrepareConfig(max_document=300))
    assert m.extra["cut"] == 3 and m.sources[0]["cut"] == 3 and m.documents == 6
    assert b"z" * 100 in all_docs(tmp_path / "out")


def test_a_non_empty_folder_needs_force_which_replaces_the_old_dataset(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\n\n".join(DOCS))
    prepare([tmp_path / "a.txt"], tmp_path / "out", PrepareConfig(shard_bytes=100))
    with pytest.raises(DataError, match="not empty"):
        prepare([tmp_path / "a.txt"], tmp_path / "out")
    m = prepare([tmp_path / "a.txt"], tmp_path / "out", PrepareConfig(force=True))
    assert sorted(p.name for p in (tmp_path / "out" / "train").iterdir()) == ["000000.bin"]
    assert verify(tmp_path / "out") == m


def test_verify_names_a_flipped_byte_and_a_truncated_shard(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\n\n".join(DOCS))
    prepare([tmp_path / "a.txt"], tmp_path / "out", PrepareConfig(shard_bytes=1000))
    shard = tmp_path / "out" / "train" / "000002.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="train/000002.bin does not match its sha256"):
        verify(tmp_path / "out")
    shard.write_bytes(bytes(data[:-1]))
    with pytest.raises(DataError, match="train/000002.bin holds 999 bytes, the manifest says 1000"):
        verify(tmp_path / "out")


# ---------------------------------------------------------------- memory

def test_reading_a_file_holds_a_block_and_a_document_not_the_file(tmp_path):
    """tracemalloc's peak while every document of a 6 MB file streams past: a few blocks, not the file."""
    block, max_document = 64 << 10, 32 << 10
    cases = {"paragraphs.txt": (b"p" * 3000 + b"\n\n") * 2000, "one-line.txt": b"q" * (6 << 20),
             "long-line.jsonl.zst": b'{"text": "' + b"r" * (6 << 20) + b'"}\n' + jsonl(DOCS)}
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(zstandard.ZstdCompressor().compress(data) if name.endswith(".zst") else data)
        del data
        report = SourceReport(Source(path, format_of(path), path.stat().st_size))
        tracemalloc.start()
        biggest = 0
        for batch in documents(report, block=block, max_document=max_document):
            biggest = max([biggest, *map(len, batch)])
            del batch
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert 0 < biggest <= max_document and report.documents >= 190, name
        assert peak < 6 * (block + max_document), f"{name}: peak {peak} bytes"


# ---------------------------------------------------------------- the real command

def btnode(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def test_the_cli_prepares_verifies_and_describes_a_dataset(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\n\n".join(DOCS))
    (tmp_path / "b.jsonl").write_bytes(jsonl(DOCS[:5], "body") + b"{bad\n")
    out = tmp_path / "out"
    p = btnode("data", "prepare", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--out", str(out),
               "--text-field", "body", "--tune", "0.2", "--test", "0.1", "--separator", r"\x1e", "--shard-mb", "0.001")
    assert p.returncode == 0, p.stderr
    assert "205 documents from 2 files" in p.stdout and "skipped: 1 not_json" in p.stdout and "MB/s" in p.stdout
    m = read_manifest(out)
    assert m.separator == b"\x1e" and m.split("train").shards[0].bytes == 1049 and m.split_rule["tune"] == 0.2
    assert m.extra["text_field"] == "body"
    assert f"{m.documents:,} documents" in btnode("data", "info", str(out)).stdout
    shard = out / m.split("train").shards[-1].path
    shard.write_bytes(b"x" + shard.read_bytes()[1:])
    p = btnode("data", "verify", str(out))
    assert p.returncode == 3 and p.stderr.strip().splitlines()[-1].startswith("error: shard") and shard.name in p.stderr
