"""Bundles (issue #40): every tensor of a stream in one zstd frame behind one header, so that a small
update pays one header, not one per tensor. Names and shapes are the spec both sides hold, in its
order; the header says the codec, the count, each raw size where the codec makes it vary (sparse) and
the frames digest, which the receiver checks over what it decompressed.

`BundleReader` is the receiving half: it decompresses as the payload comes (never past the sizes the
header declared), cuts the output into the spec's tensors and hands each one on whole.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import zstandard

from btnode.codec.codecs import Codec, raw_size
from btnode.errors import MalformedInput, TooLarge

FRAME_HEADER_MAX = 18  # bytes of a zstd frame header at most: enough to read its declared content size
# A tensor of at least this many raw bytes starts and ends its own zstd blocks, so that it gets its own
# entropy tables (tensors' value statistics differ: int8 deltas of a small block came out 3.8 % larger as one
# run of blocks than frame by frame, 0.02 % with this); smaller ones share blocks (a sparse tensor is a
# few bytes, and a block of its own would cost more than it saves)
BLOCK_ALONE = 4096
SLICE = 1 << 20  # raw bytes handed to the compressor at a time: compressed output comes as it is made


@dataclass(frozen=True)
class BundleHeader:
    """The header of a bundle: the spec's tensors in name order (bundle_order), their raw bytes one after another in
    one zstd frame (which must declare its content size: their sum)."""

    codec: Codec
    tensors: int  # how many: every tensor of the spec
    raw_sizes: tuple[int, ...]  # each tensor's raw size for a sparse codec; () for a dense one (the spec fixes it)
    digest: bytes  # frames_digest of the tensors (sha256 over each name and its raw bytes' sha256, name order)


def frames_digest(frame_sha256: Mapping[str, bytes]) -> str:
    """sha256 over each frame's raw-bytes sha256, in name order: what a signed receipt and a relay's
    manifest entry name, and what a bundle's header carries."""
    h = hashlib.sha256()
    for name in sorted(frame_sha256):
        h.update(name.encode())
        h.update(frame_sha256[name])
    return h.hexdigest()


def compressed(pieces: Iterable[bytes], total: int, level: int) -> Iterator[bytes]:
    """One zstd frame of `pieces` one after another, declaring `total` (their summed size), as it is made."""
    cobj = zstandard.ZstdCompressor(level=level).compressobj(size=total)
    shared = False  # bytes in the open block from small pieces
    for raw in pieces:
        alone = len(raw) >= BLOCK_ALONE
        if alone and shared:
            yield cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
        view = memoryview(raw)
        for lo in range(0, len(raw), SLICE):
            yield cobj.compress(view[lo:lo + SLICE])
        shared = not alone and (shared or len(raw) > 0)
        if alone:
            yield cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    yield cobj.flush()


def bundle_order(spec: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The order of a bundle's tensors: by name, so that it depends on no side's dict order (an aggregator
    restored from its state folder held its spec in another order than its workers)."""
    return sorted(spec)


def bundle_sizes(h: BundleHeader, spec: Mapping[str, tuple[int, ...]]) -> list[int]:
    """Each tensor's raw size (in bundle_order), checked against the spec: MalformedInput for anything
    that does not fit."""
    if h.tensors != len(spec):
        raise MalformedInput("bundle", f"a bundle of {h.tensors} tensors; the spec has {len(spec)}")
    if len(h.digest) != 32:
        raise MalformedInput("checksum", "a bundle carries its 32-byte frames digest")
    names = bundle_order(spec)
    numels = [math.prod(spec[n]) for n in names]
    if not h.codec.sparse:
        if h.raw_sizes:
            raise MalformedInput("bundle", f"a {h.codec.name} bundle states no sizes: its spec fixes them")
        return [raw_size(h.codec, n) for n in numels]
    if len(h.raw_sizes) != len(spec):
        raise MalformedInput("bundle", f"a {h.codec.name} bundle states {len(h.raw_sizes)} sizes for {len(spec)} tensors")
    for name, n, size in zip(names, numels, h.raw_sizes):
        if not 0 < size <= raw_size(h.codec, n):
            raise MalformedInput("size", f"tensor {name!r} declares {size} raw bytes, {h.codec.name} needs at most "
                                         f"{raw_size(h.codec, n)}")
    return list(h.raw_sizes)


class BundleReader:
    """Reads one bundle's payload as it comes: `feed` compressed bytes, and `take(name, raw)` is called
    for each tensor once its raw bytes are all in; `end` checks the frame ended with the last tensor and
    that the digest is the header's. `max_payload`: compressed bytes allowed (TooLarge past it)."""

    def __init__(self, h: BundleHeader, spec: Mapping[str, tuple[int, ...]], take: Callable[[str, bytes], None],
                 max_payload: int):
        self.header, self.take, self.max_payload = h, take, max_payload
        self.sizes = bundle_sizes(h, spec)
        self.names = bundle_order(spec)
        self.total = sum(self.sizes)
        self.received = 0  # compressed bytes fed
        self._dobj = None  # the decompressor, once the frame's header has been read
        self._head = b""  # compressed bytes held until the zstd frame header can be read
        self._at = 0  # the tensor being filled
        self._parts: list[bytes] = []
        self._filled = 0
        self._sha: dict[str, bytes] = {}

    @property
    def done(self) -> bool:
        return self._at == len(self.names)

    def feed(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > self.max_payload:
            raise TooLarge("frame_size", f"bundle payload over its limit of {self.max_payload} bytes")
        self.feed_deferred(data)

    def feed_deferred(self, data: bytes) -> None:
        """`feed` for bytes already counted against the limit as they came (a deferred read)."""
        if self._dobj is None:
            self._head += data
            if not self._started(final=False):
                return
            data, self._head = self._head, b""
        elif self._dobj.eof:
            raise MalformedInput("size", "bundle payload goes on after its zstd frame ended")
        self._decompress(data)

    def _decompress(self, data: bytes) -> None:
        assert self._dobj is not None
        try:
            out = self._dobj.decompress(data)
        except zstandard.ZstdError as exc:
            raise MalformedInput("zstd", f"bundle payload is not valid zstd data: {exc}") from exc
        self._split(out)
        if self._dobj.eof and self._dobj.unused_data:
            raise MalformedInput("size", "bundle payload goes on after its zstd frame ended")

    def _started(self, *, final: bool) -> bool:
        """Whether the zstd frame header is in (`final`: it must be). zstd allocates what a frame declares,
        so the declared size must be the header's before anything is decompressed, and a frame that
        declares none is refused (its output would be bounded by nothing)."""
        try:
            declared = zstandard.frame_content_size(self._head)
        except zstandard.ZstdError as exc:
            if len(self._head) < FRAME_HEADER_MAX and not final:
                return False  # more of the header to come
            raise MalformedInput("zstd", f"bundle payload has no valid zstd frame header: {exc}") from exc
        if declared != self.total:
            raise MalformedInput("zstd", f"bundle's zstd frame declares {declared} bytes, its header {self.total}")
        self._dobj = zstandard.ZstdDecompressor().decompressobj()
        return True

    def _split(self, out: bytes) -> None:
        view, lo = memoryview(out), 0
        while lo < len(out):
            if self.done:
                raise MalformedInput("size", f"bundle decompressed past its {self.total} declared bytes")
            want = self.sizes[self._at] - self._filled
            piece = view[lo:lo + want]
            self._parts.append(bytes(piece) if len(piece) < len(out) or self._parts else out)
            self._filled += len(piece)
            lo += len(piece)
            if self._filled == self.sizes[self._at]:
                self._complete()
        while not self.done and self.sizes[self._at] == 0:  # (only a dense codec's empty tensor)
            self._complete()

    def _complete(self) -> None:
        name = self.names[self._at]
        raw = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._parts, self._filled, self._at = [], 0, self._at + 1
        self._sha[name] = hashlib.sha256(raw).digest()
        self.take(name, raw)

    def end(self) -> None:
        """The stream ended: raises unless every tensor came whole and the digest holds."""
        if self._dobj is None and self._head and self._started(final=True):
            data, self._head = self._head, b""
            self._decompress(data)
        if not self.done or self._dobj is None or not self._dobj.eof:
            raise MalformedInput("truncated", f"stream ended inside a bundle ({self._at} of {len(self.names)} "
                                              f"tensors, {self.received} payload bytes)")
        if frames_digest(self._sha) != self.header.digest.hex():
            raise MalformedInput("checksum", "bundle fails its frames digest")
