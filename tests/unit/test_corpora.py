"""`btnode data fetch`'s pieces on a small synthetic .deb built here (an ar archive holding a
data.tar.xz): which files become documents, the JSONL and its sha256, the pinned-package checks,
the apt-get download path (a stand-in apt-get on PATH) and the dataset folder with its source."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import stat
import tarfile
from pathlib import Path

import pytest

from btnode.data import corpora
from btnode.data.corpus import load
from btnode.data.manifest import read_manifest
from btnode.errors import DataError

ROOT = "./usr/share/doc/pkg/Documentation/"
FILES = {
    "a/intro.rst.gz": gzip.compress(b".. SPDX-License-Identifier: GPL-2.0\n\nIntro\n=====\n\nHello.\n"),
    "b/notes.txt": b"Plain notes.\n",
    "odd.rst": b"x",  # an odd-sized member: ar pads it to an even offset
    "translations/it/intro.rst": b"Ciao.\n",
    "devicetree/bindings.txt": b"compatible = ...\n",
    "a/page.html": b"<p>not a document</p>\n",
    "a/empty.rst": b"\n\n",
}


def tar_xz(files: dict[str, bytes], root: str = ROOT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(root + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def ar(members: list[tuple[str, bytes]]) -> bytes:
    out = bytearray(corpora.AR_MAGIC)
    for name, data in members:
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode()
        out += data + (b"\n" if len(data) % 2 else b"")
    return bytes(out)


def make_deb(path: Path, files: dict[str, bytes] = FILES) -> Path:
    path.write_bytes(ar([("debian-binary", b"2.0\n"), ("control.tar.xz", b"c"),
                         ("data.tar.xz", tar_xz(files))]))
    return path


def recipe(deb: Path, **changes) -> corpora.DebCorpus:
    """The synthetic package's corpus, pinned to `deb`'s sha256 and to the JSONL it makes."""
    base = corpora.DebCorpus(name="synthetic", package="pkg", version="1.0-1", deb_sha256=corpora.file_sha256(deb),
                             docroot=ROOT, skip=("translations", "devicetree"), suffixes=(".rst", ".txt"),
                             jsonl_sha256="0" * 64, license="test", tune=0.3, test=0.3)
    return dataclasses.replace(base, **changes)


def test_documents_are_the_english_rst_and_txt_files_without_their_spdx_line(tmp_path):
    deb = make_deb(tmp_path / "pkg.deb")
    docs = dict(corpora.documents(deb, recipe(deb)))
    assert docs == {"a/intro.rst": "Intro\n=====\n\nHello.", "b/notes.txt": "Plain notes.", "odd.rst": "x"}


def test_the_jsonl_is_one_line_per_document_sorted_by_path_with_its_sha256(tmp_path):
    deb = make_deb(tmp_path / "pkg.deb")
    out = tmp_path / "docs.jsonl"
    digest = corpora.write_jsonl(deb, recipe(deb), out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [d["id"] for d in lines] == ["a/intro.rst", "b/notes.txt", "odd.rst"]
    assert lines[1] == {"id": "b/notes.txt", "text": "Plain notes."}
    assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
    again = tmp_path / "again.jsonl"  # the same package in another member order gives the same bytes
    make_deb(tmp_path / "other.deb", dict(reversed(list(FILES.items()))))
    assert corpora.write_jsonl(tmp_path / "other.deb", recipe(deb), again) == digest


@pytest.mark.parametrize("blob, why", [(b"PK\x03\x04 a zip", "not a Debian package"),
                                       (corpora.AR_MAGIC + b"debian-binary/  0", "truncated or malformed"),
                                       (ar([("debian-binary", b"2.0\n")]), "no data.tar"),
                                       (ar([("data.tar.xz", b"not xz at all")]), "cannot be read")])
def test_a_file_that_is_not_a_good_deb_is_a_data_error(tmp_path, blob, why):
    bad = tmp_path / "bad.deb"
    bad.write_bytes(blob)
    with pytest.raises(DataError, match=why):
        list(corpora.documents(bad, recipe(bad)))


def test_a_deb_given_by_hand_must_be_the_pinned_one(tmp_path):
    deb = make_deb(tmp_path / "pkg.deb")
    assert corpora.obtain_deb(recipe(deb), tmp_path / "cache", deb) == deb
    other = recipe(deb, deb_sha256="1" * 64)
    with pytest.raises(DataError, match=r"pinned to pkg version 1\.0-1.*--deb PATH"):
        corpora.obtain_deb(other, tmp_path / "cache", deb)
    with pytest.raises(DataError, match="does not exist"):
        corpora.obtain_deb(other, tmp_path / "cache", tmp_path / "missing.deb")


def fake_apt(folder: Path, script: str) -> None:
    apt = folder / "apt-get"
    apt.write_text("#!/bin/sh\n" + script)
    apt.chmod(apt.stat().st_mode | stat.S_IEXEC)


def test_without_a_deb_it_is_downloaded_with_apt_get_into_the_cache(tmp_path, monkeypatch):
    deb = make_deb(tmp_path / "pkg.deb")
    corpus = recipe(deb)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    # the stand-in apt-get checks what it is asked for and writes the file where apt-get would
    fake_apt(bin_, f'[ "$1 $2" = "download pkg=1.0-1" ] || exit 9\ncp {deb} ./{corpus.deb_name}\n')
    monkeypatch.setenv("PATH", f"{bin_}:/usr/bin:/bin")
    got = corpora.obtain_deb(corpus, tmp_path / "cache", None)
    assert got == tmp_path / "cache" / corpus.deb_name and got.read_bytes() == deb.read_bytes()
    fake_apt(bin_, "exit 1\n")  # cached now: apt-get is not asked again
    assert corpora.obtain_deb(corpus, tmp_path / "cache", None) == got


def test_a_version_apt_cannot_find_fails_naming_it_and_the_way_by_hand(tmp_path, monkeypatch):
    deb = make_deb(tmp_path / "pkg.deb")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    fake_apt(bin_, "echo \"E: Can't find a source to download version '1.0-1' of 'pkg:amd64'\" >&2\nexit 100\n")
    monkeypatch.setenv("PATH", f"{bin_}:/usr/bin:/bin")
    with pytest.raises(DataError) as err:
        corpora.obtain_deb(recipe(deb), tmp_path / "cache", None)
    text = str(err.value)
    assert "Can't find a source" in text and "pinned to version 1.0-1" in text and "--deb PATH" in text
    assert "snapshot.debian.org/binary/pkg/" in text


def test_fetch_prepares_a_dataset_whose_manifest_names_its_source(tmp_path):
    deb = make_deb(tmp_path / "pkg.deb")
    digest = corpora.write_jsonl(deb, recipe(deb), tmp_path / "probe.jsonl")
    corpus = recipe(deb, jsonl_sha256=digest)
    manifest = corpora.fetch(corpus, tmp_path / "ds", cache=tmp_path / "cache", deb=deb)
    assert manifest.documents == 3 and sum(s.documents for s in manifest.splits.values()) == 3
    on_disk = read_manifest(tmp_path / "ds")
    assert on_disk.extra["source"] == corpus.source()
    assert on_disk.extra["source"]["deb_sha256"] == corpus.deb_sha256 and on_disk.extra["source"]["jsonl_sha256"] == digest
    assert [s["path"] for s in on_disk.sources] == [corpus.jsonl_name]  # no machine's folder in the manifest
    assert on_disk.split_rule["tune"] == 0.3 and on_disk.split_rule["test"] == 0.3
    data = load(tmp_path / "ds")
    text = b"".join(bytes(s.read(0, len(s))) for s in (data.train, data.tune, data.test) if len(s))
    assert b"Hello." in text and b"Ciao" not in text and b"SPDX" not in text
    again = corpora.fetch(corpus, tmp_path / "ds2", cache=tmp_path / "cache", deb=deb)  # the kept JSONL is reused
    assert again.to_json() == manifest.to_json()


def test_fetch_refuses_a_jsonl_that_is_not_the_pinned_one_and_leaves_no_dataset(tmp_path):
    deb = make_deb(tmp_path / "pkg.deb")
    with pytest.raises(DataError, match="extraction rules changed"):
        corpora.fetch(recipe(deb), tmp_path / "ds", cache=tmp_path / "cache", deb=deb)
    assert not (tmp_path / "ds").exists()
    assert not list((tmp_path / "cache").glob("*.jsonl"))
