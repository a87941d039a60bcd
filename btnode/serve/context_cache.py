"""A stage's per-request caches of its block's clean stream, and the canonical chunked encoding of
a context window that makes a cached stage and an uncached one compute the same bits.

A window is encoded in chunks: its first `first` bytes (one `encode_context`), then one
`extend_context` per segment's K new bytes. Batched and incremental arithmetic differ in the last
bits, so the uncached path (a miss, a window restart, a spare after a re-route, the cache off)
replays the same chunks rather than encoding the window in one go: cached or not, the same
tensors, hence the same logits and bytes.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from btnode.errors import ConfigError, InputError
from btnode.model.block import ContextCache, DiffusionBlock

log = logging.getLogger(__name__)
MAX_REQUEST_ID = 128  # characters: uuid4().hex is 32; a longer id is refused, not stored


@dataclass(frozen=True)
class ContextCacheConfig:
    """How much one stage keeps. A local setting: stages of one chain may differ (exactness does
    not depend on it). max_bytes = 0 or max_entries = 0 turns caching off."""

    max_bytes: int = 256 << 20  # tensor storage over all requests, keys/values and outputs
    max_entries: int = 1024  # requests kept; the least recently used go first

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.max_entries < 0:
            raise ConfigError(f"context cache bounds must be ≥ 0, got {self.max_bytes} bytes, {self.max_entries} entries")

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0


def check_chunks(length: int, first: int, k: int) -> None:
    """InputError unless a window of `length` bytes is a first chunk of `first` bytes and whole
    segments of k after it (what the driver's window rule produces)."""
    if not 1 <= first <= length:
        raise InputError(f"the window's first chunk must be 1…{length} bytes (the window), got {first}")
    if (length - first) % k:
        raise InputError(f"a window of {length} bytes with a first chunk of {first} is not whole segments of "
                         f"K={k} after it")


def encode_window(block: DiffusionBlock, window: bytes, first: int, k: int, device: torch.device,
                  prefix: ContextCache | None = None) -> ContextCache:
    """The canonical cache of `window`: window[:first] in one call, then k bytes per call. `prefix`,
    when given, is the canonical cache of window[:prefix.n_clean]; only the chunks after it run."""
    ids = torch.tensor(list(window), dtype=torch.long, device=device)[None]  # (1, Tc)
    cache = prefix if prefix is not None else block.encode_context(ids[:, :first])
    for end in range(cache.n_clean + k, len(window) + 1, k):
        cache = block.extend_context(cache, ids[:, end - k:end])
    assert cache.n_clean == len(window), (cache.n_clean, len(window), first, k)
    return cache


def cache_bytes(cache: ContextCache) -> int:
    """Bytes of storage the cache holds alive (a view of a larger tensor counts the whole storage)."""
    storages = {}
    for t in [cache.out, *(x for kv in cache.kv for x in kv)]:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


@dataclass(frozen=True)
class _Entry:
    window: bytes  # the bytes the cache covers
    first: int
    k: int
    cache: ContextCache
    nbytes: int


class ContextCacheStore:
    """LRU over request ids within a byte budget; thread-safe (the gRPC server runs requests on a
    thread pool). Entries are never changed in place: a segment extends the cache into new tensors
    and puts the result back, so a concurrent request with the same id sees one whole entry or
    another, each the canonical cache of its own window. In memory only: a restart drops it all."""

    def __init__(self, config: ContextCacheConfig = ContextCacheConfig()):
        self.config = config
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, rid: str, window: bytes, first: int, k: int) -> ContextCache | None:
        """The cached prefix of `window` for request `rid`, if the entry is one (same first chunk,
        same K, its bytes a prefix of the window); None for a miss or a stale entry."""
        with self._lock:
            e = self._entries.get(rid)
            if e is not None:
                self._entries.move_to_end(rid)
            if (e is not None and e.first == first and e.k == k and len(e.window) <= len(window)
                    and window.startswith(e.window)):
                self.hits += 1
                return e.cache
            self.misses += 1
        log.debug("context cache miss for request %s (%s)", rid[:8], "stale" if e is not None else "absent")
        return None

    def store(self, rid: str, window: bytes, first: int, k: int, cache: ContextCache) -> None:
        nbytes = cache_bytes(cache) + len(window) + len(rid)
        with self._lock:
            self._pop(rid)
            if nbytes > self.config.max_bytes:
                return  # larger than the whole budget: never kept
            self._entries[rid] = _Entry(window, first, k, cache, nbytes)
            self.nbytes += nbytes
            while self.nbytes > self.config.max_bytes or len(self._entries) > self.config.max_entries:
                self._pop(next(iter(self._entries)))
                self.evictions += 1

    def drop(self, rid: str) -> None:
        with self._lock:
            self._pop(rid)

    def _pop(self, rid: str) -> None:
        e = self._entries.pop(rid, None)
        if e is not None:
            self.nbytes -= e.nbytes
