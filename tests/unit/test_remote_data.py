"""A dataset over HTTP (btnode/data/remote.py) against a real HTTP server on 127.0.0.1, with the
faults a server can have: cut bodies, wrong bytes, ignored Range, silence, hostile manifest paths."""

from __future__ import annotations

import hashlib
import json
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from btnode.data.manifest import MANIFEST, Shard, write_dataset
from btnode.data.remote import Backoff, open_remote, shard_url
from btnode.errors import ConfigError, DataError

FAST = dict(timeout_s=0.3, retries=2, backoff=Backoff(first_s=0.01, max_s=0.02))
SHARD = 100


class DatasetServer:
    """Serves `root` with Range support; faults are set per test. `requests` lists (path, Range)."""

    def __init__(self, root: Path):
        self.root = root
        self.requests: list[tuple[str, str | None]] = []
        self.cut = lambda path, n: None  # body bytes to send on the n-th request for path (None: all)
        self.flip: set[str] = set()  # shard paths served with one byte changed
        self.honour_range = True
        self.stall = False  # shard requests get no answer until the server stops
        self.released = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/{MANIFEST}"

    def count(self, path: str) -> int:
        return sum(1 for p, _ in self.requests if p == path)

    def stop(self) -> None:
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def _handler(srv: DatasetServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            path, span = self.path.lstrip("/"), self.headers.get("Range")
            srv.requests.append((path, span))
            if path != MANIFEST and srv.stall:
                srv.released.wait()
                return
            try:
                data = (srv.root / path).read_bytes()
            except OSError:
                self.send_error(404)
                return
            if path in srv.flip:
                data = data[:-1] + bytes([data[-1] ^ 1])
            start = int(span.removeprefix("bytes=").removesuffix("-")) if span and srv.honour_range else 0
            self.send_response(206 if start else 200)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            cut = srv.cut(path, srv.count(path))
            self.wfile.write(data[start:] if cut is None else data[start:start + cut])
            self.close_connection = cut is not None
    return Handler


def _documents(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [bytes(rng.randrange(32, 127) for _ in range(rng.randrange(20, 90))) for _ in range(n)]


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "served"
    manifest = write_dataset(root, {"train": _documents(12), "tune": _documents(3, 1), "test": _documents(3, 2)},
                             shard_bytes=SHARD)
    return root, manifest


@pytest.fixture
def server(dataset):
    srv = DatasetServer(dataset[0])
    yield srv
    srv.stop()


def _all_shards(manifest) -> list[Shard]:
    return [sh for split in manifest.splits.values() for sh in split.shards]


def _finals(cache: Path, shard: Shard) -> list[Path]:
    """Files at a shard's final name anywhere in the cache (a download in progress ends in .part)."""
    return list(cache.rglob(Path(shard.path).name))


def test_fetches_every_shard_once_and_reuses_the_cache_with_the_server_down(dataset, server, tmp_path):
    root, source = dataset
    cache = tmp_path / "cache"
    manifest, locate = open_remote(server.url, cache_dir=cache, cache_gb=1, **FAST)
    assert manifest == source and len(source.split("train").shards) >= 5
    streams = {name: b"".join(locate(sh).read_bytes() for sh in split.shards) for name, split in manifest.splits.items()}
    for name, split in source.splits.items():
        assert streams[name] == b"".join((root / sh.path).read_bytes() for sh in split.shards)
        assert len(streams[name]) == split.bytes
    for sh in _all_shards(source):
        assert server.count(sh.path) == 1
        assert locate(sh).read_bytes() == (root / sh.path).read_bytes()  # a second locate does not fetch
        assert server.count(sh.path) == 1

    server.stop()
    again, locate2 = open_remote(server.url, cache_dir=cache, cache_gb=1, **FAST)
    assert again == source  # the server is down: the manifest came from the cache
    for sh in _all_shards(source):
        assert locate2(sh).read_bytes() == (root / sh.path).read_bytes()


def test_a_body_cut_once_is_resumed_with_a_range_request(dataset, server, tmp_path):
    _, source = dataset
    shard = source.split("train").shards[1]
    server.cut = lambda path, n: 37 if path == shard.path and n == 1 else None
    _, locate = open_remote(server.url, cache_dir=tmp_path / "cache", cache_gb=1, **FAST)
    assert locate(shard).read_bytes() == (dataset[0] / shard.path).read_bytes()
    assert [span for path, span in server.requests if path == shard.path] == [None, "bytes=37-"]


def test_a_server_that_ignores_range_is_read_again_from_byte_0(dataset, server, tmp_path):
    _, source = dataset
    shard = source.split("train").shards[0]
    server.honour_range = False
    server.cut = lambda path, n: 37 if path == shard.path and n == 1 else None
    _, locate = open_remote(server.url, cache_dir=tmp_path / "cache", cache_gb=1, **FAST)
    assert locate(shard).read_bytes() == (dataset[0] / shard.path).read_bytes()
    assert [span for path, span in server.requests if path == shard.path] == [None, "bytes=37-"]


def test_a_download_interrupted_in_one_run_resumes_in_the_next(dataset, server, tmp_path):
    _, source = dataset
    shard = source.split("test").shards[0]
    server.cut = lambda path, n: 20 if path == shard.path and n == 1 else None
    _, locate = open_remote(server.url, cache_dir=tmp_path / "cache", cache_gb=1, **{**FAST, "retries": 0})
    with pytest.raises(DataError, match=f"shard {shard.path}.*ended after 20 of {shard.bytes} bytes"):
        locate(shard)
    _, locate = open_remote(server.url, cache_dir=tmp_path / "cache", cache_gb=1, **FAST)
    assert locate(shard).read_bytes() == (dataset[0] / shard.path).read_bytes()
    assert [span for path, span in server.requests if path == shard.path] == [None, "bytes=20-"]


def test_a_server_that_always_cuts_the_body_gets_a_clear_error(dataset, server, tmp_path):
    _, source = dataset
    shard = source.split("train").shards[2]
    server.cut = lambda path, n: 7 if path == shard.path else None
    cache = tmp_path / "cache"
    _, locate = open_remote(server.url, cache_dir=cache, cache_gb=1, **FAST)
    with pytest.raises(DataError, match=f"shard {shard.path}: .*{shard.path} failed 3 times.*ended after 21 of"):
        locate(shard)
    assert server.count(shard.path) == 3 and _finals(cache, shard) == []


def test_wrong_bytes_are_refused_and_never_reach_the_cache(dataset, server, tmp_path):
    root, source = dataset
    shard = source.split("train").shards[3]
    server.flip = {shard.path}
    data = (root / shard.path).read_bytes()
    served = hashlib.sha256(data[:-1] + bytes([data[-1] ^ 1])).hexdigest()
    cache = tmp_path / "cache"
    _, locate = open_remote(server.url, cache_dir=cache, cache_gb=1, **FAST)
    with pytest.raises(DataError) as err:
        locate(shard)
    assert shard.path in str(err.value) and served in str(err.value) and shard.sha256 in str(err.value)
    assert server.count(shard.path) == 2  # fetched again once from byte 0, then refused
    assert _finals(cache, shard) == [] and list(cache.rglob("*.part")) == []


def test_a_served_file_of_another_size_is_refused_before_its_body_is_read(dataset, server, tmp_path):
    root, source = dataset
    shard = source.split("train").shards[4]
    with open(root / shard.path, "ab") as f:
        f.write(b"!")
    cache = tmp_path / "cache"
    _, locate = open_remote(server.url, cache_dir=cache, cache_gb=1, **FAST)
    with pytest.raises(DataError, match=f"shard {shard.path} from .*: the server's file has {shard.bytes + 1} "
                                        f"bytes, the manifest says {shard.bytes}"):
        locate(shard)
    assert server.count(shard.path) == 2 and _finals(cache, shard) == []


def test_a_manifest_cut_once_is_fetched_again(dataset, server, tmp_path):
    server.cut = lambda path, n: 50 if path == MANIFEST and n == 1 else None
    manifest, _ = open_remote(server.url, cache_dir=tmp_path / "cache", cache_gb=1, **FAST)
    assert manifest == dataset[1] and server.count(MANIFEST) == 2


def test_the_cache_bound_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match="--data-cache-gb must be positive, not 0"):
        open_remote("http://127.0.0.1:9/manifest.json", cache_dir=tmp_path, cache_gb=0)


def test_a_missing_shard_is_an_error_without_retries(dataset, server, tmp_path):
    root, source = dataset
    shard = source.split("tune").shards[0]
    (root / shard.path).unlink()
    _, locate = open_remote(server.url, cache_dir=tmp_path / "cache", cache_gb=1, **FAST)
    with pytest.raises(DataError, match=f"shard {shard.path}: .* answered HTTP 404"):
        locate(shard)
    assert server.count(shard.path) == 1


def test_a_manifest_path_that_escapes_its_folder_is_refused(dataset, server, tmp_path):
    root, _ = dataset
    doc = json.loads((root / MANIFEST).read_text())
    doc["splits"]["train"]["shards"][0]["path"] = "../secret.bin"
    (root / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(DataError, match="'../secret.bin' escapes the dataset folder"):
        open_remote(server.url, cache_dir=tmp_path / "cache", cache_gb=1, **FAST)
    assert not any(p.name == "manifest.json" for p in (tmp_path / "cache").rglob("*"))


def test_shard_urls_stay_under_the_manifest_folder():
    base = "https://data.example/sets/web/manifest.json"
    assert shard_url(base, "train/000001.bin") == "https://data.example/sets/web/train/000001.bin"
    assert shard_url(base, "http://evil.example/x") == "https://data.example/sets/web/http%3A/evil.example/x"
    assert shard_url(base, "a b?c#d") == "https://data.example/sets/web/a%20b%3Fc%23d"
    with pytest.raises(DataError, match="outside https://data.example/sets/web/"):
        shard_url(base, "train/../../x")


def test_a_server_that_never_answers_the_manifest(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never accepts
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/manifest.json"
        with pytest.raises(DataError, match=f"manifest: {url} failed 3 times; the last: .*timed out"):
            open_remote(url, cache_dir=tmp_path / "cache", cache_gb=1, **FAST)


def test_a_server_that_stops_answering_shards(dataset, server, tmp_path):
    _, source = dataset
    shard = source.split("train").shards[0]
    server.stall = True
    cache = tmp_path / "cache"
    _, locate = open_remote(server.url, cache_dir=cache, cache_gb=1, **FAST)
    with pytest.raises(DataError, match=f"shard {shard.path}: http://.*/{shard.path} failed 3 times.*timed out"):
        locate(shard)
    assert server.count(shard.path) == 3 and _finals(cache, shard) == []


def test_the_cache_bound_evicts_the_least_recently_used_shard(dataset, server, tmp_path):
    root, source = dataset
    s = source.split("train").shards
    assert all(sh.bytes == SHARD for sh in s[:5])
    cache = tmp_path / "cache"
    _, locate = open_remote(server.url, cache_dir=cache, cache_gb=3.5 * SHARD / 1e9, **FAST)

    def held() -> set[str]:
        return {sh.path for sh in s[:5] if _finals(cache, sh)}

    for sh in s[:3]:
        locate(sh)
    locate(s[0])  # s[0] used again: s[1] is now the least recently used
    assert locate(s[3]).read_bytes() == (root / s[3].path).read_bytes()
    assert held() == {s[0].path, s[2].path, s[3].path}
    assert locate(s[1]).read_bytes() == (root / s[1].path).read_bytes()  # fetched again, s[2] goes
    assert held() == {s[0].path, s[1].path, s[3].path} and server.count(s[1].path) == 2
    for sh in s:
        locate(sh)
        assert sum(p.stat().st_size for p in cache.rglob("*.bin")) <= 3.5 * SHARD + max(x.bytes for x in s)


def test_two_workers_sharing_a_cache_fetch_each_shard_once(dataset, server, tmp_path):
    root, source = dataset
    shards = _all_shards(source)
    got: dict[int, list[bytes]] = {}

    def worker(i: int) -> None:
        _, locate = open_remote(server.url, cache_dir=tmp_path / "cache", cache_gb=1, **FAST)
        got[i] = [locate(sh).read_bytes() for sh in shards]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = [(root / sh.path).read_bytes() for sh in shards]
    assert got == {0: want, 1: want}
    assert all(server.count(sh.path) == 1 for sh in shards)


def test_a_replaced_dataset_is_fetched_again_not_served_from_the_cache(dataset, server, tmp_path):
    root, source = dataset
    cache = tmp_path / "cache"
    _, locate = open_remote(server.url, cache_dir=cache, cache_gb=1, **FAST)
    old = source.split("train").shards[0]
    locate(old)
    new = write_dataset(root, {"train": _documents(12, seed=9), "tune": _documents(3, 1), "test": _documents(3, 2)},
                        shard_bytes=SHARD).split("train").shards[0]
    assert new.path == old.path and new.sha256 != old.sha256
    _, locate = open_remote(server.url, cache_dir=cache, cache_gb=1, **FAST)
    assert locate(new).read_bytes() == (root / new.path).read_bytes()
    assert server.count(new.path) == 2
