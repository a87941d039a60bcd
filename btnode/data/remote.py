"""A prepared dataset served over HTTP(S): the manifest, then each shard fetched on first need into a
local cache bounded in size. A shard is sha256-checked before anything can read it: what is not the
manifest's bytes never reaches the final path, so it is never trained on.

Cache layout (one folder per manifest URL, named by the URL's sha256):

    CACHE/.lock                          flock'd while a shard is checked, downloaded or evicted
    CACHE/<key>/url                      the manifest URL, for people looking at the folder
    CACHE/<key>/manifest.json            the last manifest fetched (used when the server is unreachable)
    CACHE/<key>/shards/<shard.path>      verified shards; the file's mtime is its last use (LRU)
    CACHE/<key>/partial/<shard.path>.part  a download in progress, resumed with an HTTP Range request

The size bound covers every dataset's verified shards under CACHE. An evicted shard that a reader
still has memory-mapped keeps its disk blocks until it is unmapped; the reader calls `locate` again
when it next opens the shard and gets a fresh copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import http.client
import itertools
import logging
import os
import random
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from btnode.data.manifest import MANIFEST, MAX_MANIFEST_BYTES, Manifest, Shard
from btnode.durable import atomic_write
from btnode.errors import ConfigError, DataError

log = logging.getLogger(__name__)

GB = 10**9  # --data-cache-gb counts decimal gigabytes, as disk sizes are sold
CHUNK = 1 << 20
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}  # the server may answer differently later
T = TypeVar("T")


def is_remote(path: str | Path) -> bool:
    return str(path).startswith(("http://", "https://"))


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "btnode" / "data"


@dataclass(frozen=True)
class Backoff:
    """The wait before retry n (from 0): first_s · 2^n, at most max_s, times a random factor in
    [1 - jitter, 1] so that workers restarted together do not knock on the server together."""

    first_s: float = 1.0
    max_s: float = 30.0
    jitter: float = 0.5

    def delay(self, n: int) -> float:
        return min(self.max_s, self.first_s * 2**n) * (1 - self.jitter * random.random())


class _Transient(Exception):
    """Worth another try: refused or reset connection, timeout, a body that ended early, a 5xx."""


class _Unreachable(DataError):
    """Every try failed with a _Transient: the server is down or stalled (a cached manifest may do)."""


class _Mismatch(Exception):
    """The server's bytes are not the manifest's (size or sha256): fetched again once from byte 0."""


@dataclass(frozen=True)
class Transport:
    """GET with a socket timeout and a bounded number of retries with exponential backoff."""

    timeout_s: float = 30.0
    retries: int = 5
    backoff: Backoff = Backoff()

    def retry(self, what: str, url: str, attempt: Callable[[], T]) -> T:
        for n in itertools.count():
            try:
                return attempt()
            except _Transient as exc:
                if n == self.retries:
                    raise _Unreachable(f"{what}: {url} failed {n + 1} time{'s' * (n > 0)}; the last: {exc}") from None
                wait = self.backoff.delay(n)
                log.warning("%s: %s (%s); retry %d of %d in %.1f s", what, url, exc, n + 1, self.retries, wait)
                time.sleep(wait)

    def open(self, what: str, url: str, offset: int = 0) -> http.client.HTTPResponse:
        request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset else {})
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code in RETRY_STATUS:
                raise _Transient(f"HTTP {exc.code} {exc.reason}") from None
            if exc.code == 416 and offset:
                raise _Mismatch(f"the server refused a range from byte {offset}: its file is shorter") from None
            raise DataError(f"{what}: {url} answered HTTP {exc.code} {exc.reason}") from None
        except (OSError, http.client.HTTPException) as exc:  # URLError and timeouts are OSErrors
            raise _Transient(_describe(exc)) from None


def _describe(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or exc
    return f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__


def _read(resp: http.client.HTTPResponse, n: int) -> bytes:
    try:
        return resp.read(n)
    except (OSError, http.client.HTTPException) as exc:
        raise _Transient(_describe(exc)) from None


def shard_url(manifest_url: str, path: str) -> str:
    """The shard's URL: its path, quoted, relative to the manifest's folder, and refused if it leaves it."""
    base = urllib.parse.urljoin(manifest_url, ".")
    url = urllib.parse.urljoin(base, urllib.parse.quote(path))
    if not url.startswith(base):
        raise DataError(f"{manifest_url}: shard path {path!r} resolves to {url}, outside {base}")
    return url


def _fetch_manifest(transport: Transport, url: str) -> bytes:
    with transport.open("manifest", url) as resp:
        body = _read(resp, MAX_MANIFEST_BYTES + 1)
        declared = resp.headers.get("Content-Length")
    if declared is not None and declared.isdigit() and len(body) < int(declared) <= MAX_MANIFEST_BYTES:
        raise _Transient(f"the body ended after {len(body)} of {declared} bytes")
    return body


class ShardCache:
    """The cache folder: one lock for everything that writes in it, and its size bound, kept by
    deleting the least recently used verified shards (of any dataset) before a download."""

    def __init__(self, root: Path, bound_bytes: int):
        self.root, self.bound_bytes = Path(root), bound_bytes

    def folder(self, url: str) -> Path:
        return self.root / hashlib.sha256(url.encode()).hexdigest()[:32]

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive against other processes and threads: each call opens its own file description."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def make_room(self, need: int) -> None:
        """Evict LRU shards until `need` more bytes fit (all of them, if one shard is over the bound)."""
        shards = [(p.stat(), p) for p in self.root.glob("*/shards/**/*") if p.is_file()]
        total = sum(st.st_size for st, _ in shards)
        for st, path in sorted(shards, key=lambda s: s[0].st_mtime_ns):
            if total + need <= self.bound_bytes:
                break
            path.unlink()
            total -= st.st_size
            log.info("data cache: evicted %s (%.1f MB, over the %.2f GB bound)", path, st.st_size / 1e6,
                     self.bound_bytes / GB)


def load_manifest(transport: Transport, url: str, cache: ShardCache) -> Manifest:
    """The server's manifest, checked, and kept in the cache; the kept copy (with a warning) when the
    server cannot be reached. A server that answers with an error or a bad manifest is not masked."""
    folder = cache.folder(url)
    kept = folder / MANIFEST
    try:
        text = transport.retry("manifest", url, lambda: _fetch_manifest(transport, url))
    except _Unreachable as exc:
        if not kept.is_file():
            raise
        log.warning("%s; using the manifest cached at %s", exc, kept)
        return Manifest.from_json(kept.read_bytes(), origin=str(kept))
    manifest = Manifest.from_json(text, origin=url)
    with cache.locked():
        if not kept.is_file() or kept.read_bytes() != text:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(folder / "url", url.encode() + b"\n")
            atomic_write(kept, text)
    return manifest


def _touch(path: Path, size: int) -> bool:
    """Mark a cached shard used now (its mtime orders eviction); False if it is gone or the wrong size."""
    try:
        if path.stat().st_size != size:
            return False
        now = time.time_ns()
        os.utime(path, ns=(now, now))
        return True
    except FileNotFoundError:
        return False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _start_of(resp: http.client.HTTPResponse, have: int, shard: Shard) -> int:
    """Where the body starts in the shard: `have` when the server honours our Range (206), 0 when it
    sends the whole file (200). Refuses a server whose file is not the manifest's size."""
    if resp.status == 206:
        span = resp.headers.get("Content-Range", "")
        m = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", span)
        if not m or int(m[1]) != have:
            raise _Transient(f"Content-Range {span!r} does not start at byte {have}")
        total = m[2]
    elif resp.status == 200:
        if have:
            log.info("shard %s: the server ignores Range; fetching it from byte 0", shard.path)
        have, total = 0, resp.headers.get("Content-Length")
    else:
        raise _Transient(f"unexpected HTTP {resp.status}")
    if total is not None and total.isdigit() and int(total) != shard.bytes:
        raise _Mismatch(f"the server's file has {total} bytes, the manifest says {shard.bytes}")
    return have


class RemoteShards:
    """`locate(shard)`: the local path of a verified copy of the shard, downloaded on first need.

    A shard found in the cache is re-hashed the first time this process uses it (the file may have
    been altered on disk, or the server's dataset replaced, since it was fetched); after that a size
    check is enough."""

    def __init__(self, url: str, folder: Path, cache: ShardCache, transport: Transport):
        self.url, self.folder, self.cache, self.transport = url, folder, cache, transport
        self._checked: set[str] = set()

    def locate(self, shard: Shard) -> Path:
        final = self.folder / "shards" / shard.path
        if shard.path in self._checked and _touch(final, shard.bytes):
            return final
        try:
            with self.cache.locked():
                if not self._still_good(shard, final):
                    self.cache.make_room(shard.bytes)
                    self._download(shard, final)
                self._checked.add(shard.path)
                _touch(final, shard.bytes)
        except OSError as exc:
            raise DataError(f"shard {shard.path}: the data cache {self.cache.root} failed: {exc}") from exc
        return final

    def _still_good(self, shard: Shard, final: Path) -> bool:
        if not final.is_file():
            return False
        if final.stat().st_size == shard.bytes and _sha256(final) == shard.sha256:
            return True
        log.warning("shard %s: the cached copy %s is not the manifest's; fetching it again", shard.path, final)
        final.unlink()
        return False

    def _download(self, shard: Shard, final: Path) -> None:
        url = shard_url(self.url, shard.path)
        part = self.folder / "partial" / (shard.path + ".part")
        part.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        for again in (False, True):
            try:
                self.transport.retry(f"shard {shard.path}", url, lambda: self._fetch(url, part, shard))
                digest = _sha256(part)
                if digest != shard.sha256:
                    raise _Mismatch(f"its sha256 is {digest}, the manifest says {shard.sha256}")
                break
            except _Mismatch as exc:
                part.unlink(missing_ok=True)
                if again:
                    raise DataError(f"shard {shard.path} from {url}: {exc} (fetched twice: the server's "
                                    f"file is not the one its manifest lists)") from None
                log.warning("shard %s from %s: %s; fetching it again", shard.path, url, exc)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, final)
        seconds = time.monotonic() - started
        log.info("fetched shard %s: %.1f MB in %.1f s (%.1f MB/s)", shard.path, shard.bytes / 1e6, seconds,
                 shard.bytes / 1e6 / max(seconds, 1e-6))

    def _fetch(self, url: str, part: Path, shard: Shard) -> None:
        """One request: append to `part` from where it ends (or from 0 if the server ignores Range)."""
        have = part.stat().st_size if part.exists() else -1
        if have == shard.bytes:
            return  # complete from an earlier try; the digest decides
        have = 0 if have > shard.bytes else max(have, 0)
        with self.transport.open(f"shard {shard.path}", url, offset=have) as resp:
            have = _start_of(resp, have, shard)
            with open(part, "ab" if have else "wb") as f:
                while chunk := _read(resp, min(CHUNK, shard.bytes - have + 1)):
                    if have + len(chunk) > shard.bytes:
                        raise _Mismatch(f"the server sent more than the manifest's {shard.bytes} bytes")
                    f.write(chunk)
                    have += len(chunk)
                f.flush()
                os.fsync(f.fileno())
        if have < shard.bytes:
            raise _Transient(f"the body ended after {have} of {shard.bytes} bytes")


def open_remote(url: str, *, cache_dir: Path | None, cache_gb: float, timeout_s: float = 30, retries: int = 5,
                backoff: Backoff = Backoff()) -> tuple[Manifest, Callable[[Shard], Path]]:
    """The dataset whose manifest is at `url`, and `locate(shard)` giving a local, verified copy of a
    shard (fetched into `cache_dir`, default ~/.cache/btnode/data, kept under `cache_gb`)."""
    if not is_remote(url):
        raise DataError(f"{url} is not an http:// or https:// URL")
    if not cache_gb > 0:
        raise ConfigError(f"--data-cache-gb must be positive, not {cache_gb}")
    if retries < 0:
        raise ConfigError(f"retries must be 0 or more, not {retries}")
    cache = ShardCache(Path(cache_dir) if cache_dir is not None else default_cache_dir(), int(cache_gb * GB))
    transport = Transport(timeout_s=timeout_s, retries=retries, backoff=backoff)
    try:
        manifest = load_manifest(transport, url, cache)
    except OSError as exc:
        raise DataError(f"manifest {url}: the data cache {cache.root} failed: {exc}") from exc
    return manifest, RemoteShards(url, cache.folder(url), cache, transport).locate
