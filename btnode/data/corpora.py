"""Named public corpora that `btnode data fetch` turns into dataset folders: which pinned package
each comes from (checked by sha256), which of its files are documents, and the JSONL that
`btnode data prepare` then splits by document. The package is a Debian .deb, read in Python (an
`ar` archive whose data.tar.xz holds the files), so no dpkg is needed; only the download uses apt.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from btnode.data.manifest import Manifest
from btnode.data.prepare import PrepareConfig, PrepareProgress, prepare
from btnode.data.readers import MAX_DOCUMENT_BYTES
from btnode.errors import DataError

log = logging.getLogger(__name__)

AR_MAGIC = b"!<arch>\n"
AR_HEADER = 60
SPDX_LINE = re.compile(r"\A\.\. SPDX-License-Identifier:[^\n]*\n")


@dataclass(frozen=True)
class DebCorpus:
    """A corpus read out of one pinned Debian package."""

    name: str  # what `btnode data fetch NAME` calls it
    package: str
    version: str
    deb_sha256: str
    docroot: str  # the folder in the package whose files are the documents
    skip: tuple[str, ...]  # top-level folders under docroot left out (translations, generated, not prose)
    suffixes: tuple[str, ...]  # documents by name, before a .gz
    jsonl_sha256: str  # of the JSONL the documents make: pins the extraction as well as the package
    license: str
    tune: float = 0.02  # shares of documents by content hash; at 0.01 the test split is too small to score
    test: float = 0.02

    @property
    def deb_name(self) -> str:
        return f"{self.package}_{self.version}_all.deb"  # the name `apt-get download` writes

    @property
    def jsonl_name(self) -> str:
        return f"{self.package}_{self.version}.jsonl"

    def source(self) -> dict:
        """What the manifest says about where the dataset came from."""
        return {"name": self.name, "package": self.package, "version": self.version, "deb": self.deb_name,
                "deb_sha256": self.deb_sha256, "jsonl_sha256": self.jsonl_sha256, "license": self.license,
                "documents": f"{self.docroot}**/*{{{','.join(self.suffixes)}}}[.gz] less {', '.join(self.skip)}/; "
                             "a first '.. SPDX-License-Identifier' line removed; one JSONL line per file, by path"}


LINUX_DOC = DebCorpus(
    name="linux-doc", package="linux-doc-6.12", version="6.12.118-1~deb12u1",
    deb_sha256="57832c90306ded11cadafed9b6f639e54de7a392dfdacf32742d1a57fecdc8e1",
    docroot="./usr/share/doc/linux-doc-6.12/Documentation/",
    skip=("translations", "devicetree", "ABI", "sphinx", "output"), suffixes=(".rst", ".txt"),
    jsonl_sha256="61152d24e31998af4f2f3218fab964c649d28c8108c018e61976570d6a1a62c7",
    license="GPL-2.0 (the Linux kernel's documentation; some media API documents GFDL-1.1)")
CORPORA = {c.name: c for c in (LINUX_DOC,)}


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "btnode" / "corpora"


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def deb_member(path: Path, prefix: bytes = b"data.tar") -> bytes:
    """The bytes of the member of a .deb (an `ar` archive) whose name starts with `prefix`."""
    try:
        with open(path, "rb") as f:
            if f.read(len(AR_MAGIC)) != AR_MAGIC:
                raise DataError(f"{path} is not a Debian package (no ar archive header)")
            while header := f.read(AR_HEADER):
                if len(header) < AR_HEADER or header[58:60] != b"`\n":
                    raise DataError(f"{path}: a truncated or malformed ar member header")
                name, size_text = header[:16].rstrip(b" /"), header[48:58].strip()
                if not size_text.isdigit():
                    raise DataError(f"{path}: ar member {name!r} has no size")
                size = int(size_text)
                if name.startswith(prefix):
                    data = f.read(size)
                    if len(data) != size:
                        raise DataError(f"{path}: ar member {name.decode(errors='replace')} is truncated")
                    return data
                f.seek(size + size % 2, os.SEEK_CUR)  # members start on even offsets
    except OSError as exc:
        raise DataError(f"{path} cannot be read: {exc.strerror or exc}") from exc
    raise DataError(f"{path} holds no {prefix.decode()}* member")


def documents(deb: Path, corpus: DebCorpus) -> Iterator[tuple[str, str]]:
    """(path under docroot, text) for each document file in the package, in archive order."""
    try:
        with tarfile.open(fileobj=io.BytesIO(deb_member(deb))) as tar:  # xz, gz or zstd: tarfile sniffs it
            for m in tar:
                if not (m.isfile() and m.name.startswith(corpus.docroot)):
                    continue
                rel = m.name[len(corpus.docroot):]
                base = rel.removesuffix(".gz")
                if rel.split("/")[0] in corpus.skip or not base.endswith(corpus.suffixes):
                    continue
                raw = tar.extractfile(m).read()  # type: ignore[union-attr]
                if rel.endswith(".gz"):
                    raw = gzip.GzipFile(fileobj=io.BytesIO(raw)).read(MAX_DOCUMENT_BYTES + 1)
                if len(raw) > MAX_DOCUMENT_BYTES:
                    raise DataError(f"{deb}: {rel} is larger than a document may be ({MAX_DOCUMENT_BYTES} bytes)")
                text = SPDX_LINE.sub("", raw.decode("utf-8")).strip()
                if text:
                    yield base, text
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, UnicodeDecodeError, LookupError) as exc:
        raise DataError(f"{deb}: its files cannot be read: {exc}") from exc


def write_jsonl(deb: Path, corpus: DebCorpus, out: Path) -> str:
    """One line {"id": path, "text": text} per document, sorted by path; returns the file's sha256."""
    digest = hashlib.sha256()
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "wb") as f:
        for path, text in sorted(documents(deb, corpus)):
            line = (json.dumps({"id": path, "text": text}, ensure_ascii=False) + "\n").encode()
            digest.update(line)
            f.write(line)
    tmp.replace(out)
    return digest.hexdigest()


def _by_hand(corpus: DebCorpus) -> str:
    return (f"get {corpus.deb_name} (sha256 {corpus.deb_sha256}) by hand, for example from "
            f"https://snapshot.debian.org/binary/{corpus.package}/, which keeps every published version, "
            f"and pass it with --deb PATH")


def obtain_deb(corpus: DebCorpus, cache: Path, deb: Path | None = None) -> Path:
    """The pinned package, checked: `deb` if given, else a copy in `cache`, else `apt-get download`
    into `cache`. A file whose sha256 is not the pinned one is refused, naming the version wanted."""
    if deb is not None:
        if not deb.is_file():
            raise DataError(f"--deb {deb} does not exist")
        _check_deb(corpus, deb)
        return deb
    cache.mkdir(parents=True, exist_ok=True)
    cached = cache / corpus.deb_name
    if not cached.is_file():
        spec = f"{corpus.package}={corpus.version}"
        if shutil.which("apt-get") is None:
            raise DataError(f"apt-get is not on this machine, so {spec} cannot be downloaded: {_by_hand(corpus)}")
        log.info("downloading %s with apt-get into %s", spec, cache)
        done = subprocess.run(["apt-get", "download", spec], cwd=cache, capture_output=True, text=True)
        if done.returncode != 0 or not cached.is_file():
            said = (done.stderr or done.stdout).strip().splitlines()
            raise DataError(f"apt-get download {spec} failed ({said[-1] if said else f'exit {done.returncode}'}). "
                            f"The corpus is pinned to version {corpus.version}, which Debian replaces when it "
                            f"publishes a newer one: run `apt-get update` if your lists are old, or {_by_hand(corpus)}")
    _check_deb(corpus, cached)
    return cached


def _check_deb(corpus: DebCorpus, path: Path) -> None:
    got = file_sha256(path)
    if got != corpus.deb_sha256:
        raise DataError(f"{path} is not {corpus.deb_name}: sha256 {got}, expected {corpus.deb_sha256} "
                        f"(the corpus is pinned to {corpus.package} version {corpus.version}); {_by_hand(corpus)}")


def fetch(corpus: DebCorpus, out: Path, *, cache: Path | None = None, deb: Path | None = None, force: bool = False,
          progress: Callable[[PrepareProgress], None] | None = None) -> Manifest:
    """Package → checked JSONL (kept in `cache`) → the dataset folder `out`, split by document, whose
    manifest names the source. The manifest's bytes do not depend on where the files lay."""
    cache = cache or default_cache_dir()
    package = obtain_deb(corpus, cache, deb)
    jsonl = cache / corpus.jsonl_name
    if not (jsonl.is_file() and file_sha256(jsonl) == corpus.jsonl_sha256):
        log.info("extracting %s's documents into %s", package, jsonl)
        cache.mkdir(parents=True, exist_ok=True)
        got = write_jsonl(package, corpus, jsonl)
        if got != corpus.jsonl_sha256:
            jsonl.unlink()
            raise DataError(f"the documents of {package} gave a JSONL with sha256 {got}, expected "
                            f"{corpus.jsonl_sha256}: the extraction rules changed or the package is not the pinned one")
    manifest = prepare([jsonl], out, PrepareConfig(tune=corpus.tune, test=corpus.test, force=force), progress=progress)
    sources = tuple({**s, "path": jsonl.name} for s in manifest.sources)
    manifest = dataclasses.replace(manifest, sources=sources, extra={**manifest.extra, "source": corpus.source()})
    manifest.write(out)
    return manifest
