"""Frames (design §3.5): one tensor = a header (name, dtype, shape, codec, raw and payload sizes,
sha256 of the raw bytes) and a zstd payload, sent as chunks of at most CHUNK_BYTES. A bundle (issue
#40) carries every tensor of a stream in one zstd frame behind one header (codec, count, the raw sizes
a sparse codec needs, the frames digest): names and shapes are the spec both sides hold, in its order.

`encode_frames` / `bundle` / `iter_chunks` produce the wire sequence; `FrameAssembler` consumes one and
checks every rule against the exact tensor spec the receiver expects, so that nothing partial or
invalid is ever handed on. This module knows no gRPC: rpc/ converts these to protobuf messages.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import zstandard

from btnode.codec.bundles import BundleHeader, BundleReader, compressed, frames_digest
from btnode.codec.codecs import Codec, decode, encode, raw_size
from btnode.codec.sparse import CHUNK, SparseTensor
from btnode.errors import MalformedInput, TooLarge

FRAME_SLACK = 64 << 10  # zstd may grow incompressible data slightly
CHUNK_BYTES = 1 << 20  # at most 1 MiB of payload per chunk
ZSTD_LEVEL = 1
DTYPE = "float32"  # the only decoded dtype blocks use

Spec = Mapping[str, tuple[int, ...]]  # tensor name → shape, in canonical order


@dataclass(frozen=True)
class FrameHeader:
    name: str
    shape: tuple[int, ...]
    codec: Codec
    raw_bytes: int
    payload_bytes: int
    sha256: bytes
    dtype: str = DTYPE


@dataclass(frozen=True)
class Frame:
    header: FrameHeader
    payload: bytes

    @property
    def raw_bytes(self) -> int:
        return self.header.raw_bytes

    @property
    def payload_bytes(self) -> int:
        return self.header.payload_bytes

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[ChunkData]:
        payload = self.payload
        yield ChunkData(self.header, payload[:chunk_bytes])
        for lo in range(chunk_bytes, len(payload), chunk_bytes):
            yield ChunkData(None, payload[lo:lo + chunk_bytes])


@dataclass(frozen=True)
class ChunkData:
    header: FrameHeader | BundleHeader | None  # present on the first chunk of each frame or bundle
    data: bytes


class Bundle:
    """Every tensor of a stream in one zstd frame behind one BundleHeader, compressed as its chunks are
    asked for (the compression of chunk k+1 overlaps the sending of chunk k). `raw`: (name, raw codec
    bytes) in the spec's order. `payload_bytes` is known once the chunks have all been made (`on_sent`
    hears it then: a caller that lists its frames before sending them has not sent them yet). The tensors
    go in name order (bundles.bundle_order), whatever order `raw` lists them in: a reader's spec may
    hold the same names in another order (an aggregator's after a restart did)."""

    def __init__(self, codec: Codec, raw: Sequence[tuple[str, bytes]], *, level: int = ZSTD_LEVEL,
                 on_sent: Callable[[int, int], None] | None = None):
        self.codec, self.raw, self.level = codec, sorted(raw, key=lambda p: p[0]), level
        self.on_sent = on_sent  # called with (raw bytes, payload bytes) each time its last chunk has been made
        digest = frames_digest({n: hashlib.sha256(r).digest() for n, r in self.raw})
        self.header = BundleHeader(codec, len(self.raw), tuple(len(r) for _, r in self.raw) if codec.sparse else (),
                                   bytes.fromhex(digest))
        self.raw_bytes = sum(len(r) for _, r in self.raw)
        self.payload_bytes = 0

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[ChunkData]:
        pending, header, sent = bytearray(), self.header, 0
        for out in compressed((r for _, r in self.raw), self.raw_bytes, self.level):
            pending += out
            while len(pending) >= chunk_bytes:
                yield ChunkData(header, bytes(pending[:chunk_bytes]))
                del pending[:chunk_bytes]
                header, sent = None, sent + chunk_bytes
        for lo in range(0, len(pending), chunk_bytes) if pending else ():
            yield ChunkData(header, bytes(pending[lo:lo + chunk_bytes]))
            header = None
        self.payload_bytes = sent + len(pending)
        if self.on_sent is not None:
            self.on_sent(self.raw_bytes, self.payload_bytes)


def bundle(tensors: Mapping[str, torch.Tensor], codec: Codec, *, keep: int = CHUNK) -> Bundle:
    """A bundle of `tensors` (sent in name order, as every bundle)."""
    return Bundle(codec, [(n, encode(codec, t, keep=keep)) for n, t in tensors.items()])


def spec_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in tensors.items()}


def frame_from_raw(name: str, shape: tuple[int, ...], codec: Codec, raw: bytes,
                   compressor: zstandard.ZstdCompressor | None = None) -> Frame:
    """One frame; pass a compressor to reuse its context across the frames of one stream
    (contexts are not thread-safe, so never share one between streams)."""
    payload = (compressor or zstandard.ZstdCompressor(level=ZSTD_LEVEL)).compress(raw)
    header = FrameHeader(name=name, shape=tuple(shape), codec=codec, raw_bytes=len(raw),
                         payload_bytes=len(payload), sha256=hashlib.sha256(raw).digest())
    return Frame(header, payload)


def encode_raw(tensors: Mapping[str, torch.Tensor], codec: Codec, *, keep: int = CHUNK) -> dict[str, bytes]:
    """Codec representation of each tensor (before zstd), in the mapping's order; `keep`: a sparse
    codec's values per chunk."""
    return {name: encode(codec, t, keep=keep) for name, t in tensors.items()}


def encode_update(params: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor],
                  residual: Mapping[str, torch.Tensor], codec: Codec, *, error_feedback: bool,
                  keep: int = CHUNK) -> tuple[dict[str, bytes], dict[str, torch.Tensor]]:
    """The codec bytes of Δ = params − base (+ β × the residual of the last update, with error
    feedback; β = codec.ef_decay) and the residual this one leaves (what the codec did not send).
    One function for the worker that pushes and the auditor that replays it, so that the two
    compute the same bytes."""
    delta = {n: params[n].detach().cpu() - base[n] for n in base}
    if error_feedback:
        beta = codec.ef_decay
        delta = {n: (d + (residual[n] if beta == 1 else beta * residual[n]) if n in residual else d)
                 for n, d in delta.items()}
    raw = encode_raw(delta, codec, keep=keep)
    if not error_feedback:
        return raw, {}
    return raw, {n: delta[n] - decode(codec, raw[n], tuple(delta[n].shape)) for n in delta}


def encode_frames(tensors: Mapping[str, torch.Tensor], codec: Codec, *, keep: int = CHUNK) -> list[Frame]:
    return list(lazy_frames(tensors, codec, keep=keep))


def lazy_frames(tensors: Mapping[str, torch.Tensor], codec: Codec, *, keep: int = CHUNK) -> Iterator[Frame]:
    """Frames encoded one at a time as the consumer asks: fed to a gRPC stream, the encoding of
    tensor k+1 overlaps the sending of tensor k (zstd and sha256 release the GIL)."""
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    for name, t in tensors.items():
        yield frame_from_raw(name, tuple(t.shape), codec, encode(codec, t, keep=keep), compressor)


def bundle_limit(spec: Spec, codec: Codec) -> int:
    """Compressed bytes a bundle of `spec` in `codec` may take: its largest raw size and zstd's slack."""
    largest = sum(raw_size(codec, math.prod(s)) for s in spec.values())
    return largest + largest // 128 + FRAME_SLACK


class ReplayableFrames:
    """An update's frames, made anew by `make` each time they are iterated, so that a refused push
    can be sent again (lazily each time: nothing is held between attempts)."""

    def __init__(self, make: Callable[[], Iterator[Frame]]):
        self.make = make

    def __iter__(self) -> Iterator[Frame]:
        return self.make()


def iter_chunks(frames: Iterable[Frame | Bundle], chunk_bytes: int = CHUNK_BYTES) -> Iterator[ChunkData]:
    for f in frames:
        yield from f.chunks(chunk_bytes)


def wire_bytes(frames: Iterable[Frame | Bundle]) -> tuple[int, int]:
    """(raw bytes before compression, payload bytes after) of a frame list (a bundle is compressed to count)."""
    raw = payload = 0
    for f in frames:
        if isinstance(f, Bundle) and not f.payload_bytes:
            for _ in f.chunks():
                pass
        raw += f.raw_bytes
        payload += f.payload_bytes
    return raw, payload


def stream_digest(frames: Iterable[Frame | Bundle]) -> str:
    """The frames digest of a stream's frames, or of its bundle (the one its header carries)."""
    frames = list(frames)
    if len(frames) == 1 and isinstance(frames[0], Bundle):
        return frames[0].header.digest.hex()
    return frames_digest({f.header.name: f.header.sha256 for f in frames if isinstance(f, Frame)})


def all_finite(t: torch.Tensor) -> bool:
    """True when no value is NaN or ±Inf. Fast path: a finite sum proves it (NaN and Inf propagate);
    only a non-finite sum, which overflow can also cause, pays for the element-wise check."""
    if t.numel() == 0 or math.isfinite(float(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def absmax(t: torch.Tensor) -> float:
    """max |t| without a tensor of |t| (NaN if t holds one); 0 for an empty tensor."""
    if not t.numel():
        return 0.0
    lo, hi = torch.aminmax(t)
    return max(-float(lo), float(hi)) if not (lo.isnan() or hi.isnan()) else math.nan


class LazyDelta(Mapping[str, "torch.Tensor | SparseTensor"]):
    """An update held as its raw codec bytes, each dense tensor decoded afresh when read and dropped by
    its reader: judging and summing a large update then holds one decoded tensor at a time, not the
    whole update in fp32 (issue #25). Decoding is deterministic, so every read gives the same values,
    bit for bit; the cost is a decode per read. `eager`: tensors already decoded (sparse ones)."""

    def __init__(self, spec: Spec, codecs: Mapping[str, Codec], raw: Mapping[str, bytes],
                 eager: Mapping[str, torch.Tensor | SparseTensor], stats: Mapping[str, tuple[float, float]]):
        self.spec, self.codecs, self.raw, self.eager = dict(spec), dict(codecs), raw, dict(eager)
        self.stats = dict(stats)  # name → (max |v|, ‖v‖₂) of a lazy tensor, taken when it was checked

    def stat(self, name: str) -> tuple[float, float] | None:
        """(max |v|, ‖v‖₂) of tensor `name` without decoding it again, where known."""
        return self.stats.get(name)

    def __getitem__(self, name: str) -> torch.Tensor | SparseTensor:
        if name in self.eager:
            return self.eager[name]
        return decode(self.codecs[name], self.raw[name], self.spec[name])

    def each(self) -> Iterator[tuple[str, torch.Tensor | SparseTensor]]:
        """(name, tensor) in order, each dense tensor decoded into one buffer reused for all: a tensor is valid
        only until the next is asked for (a reader that goes tensor by tensor, as the sum and the screen's
        sketch do, then touches no fresh memory per tensor: issue #40)."""
        buf = None
        for name in self.spec:
            if name in self.eager:
                yield name, self.eager[name]
                continue
            numel = math.prod(self.spec[name])
            if buf is None or buf.numel() < numel:
                buf = torch.empty(max(math.prod(self.spec[n]) for n in self.spec if n not in self.eager))
            yield name, decode(self.codecs[name], self.raw[name], self.spec[name], out=buf)

    def __iter__(self) -> Iterator[str]:
        return iter(self.spec)

    def __len__(self) -> int:
        return len(self.spec)


def each(delta: Mapping[str, torch.Tensor | SparseTensor]) -> Iterator[tuple[str, torch.Tensor | SparseTensor]]:
    """A delta's (name, tensor) pairs in order, for a reader that holds one at a time (LazyDelta.each)."""
    return delta.each() if isinstance(delta, LazyDelta) else iter(delta.items())


class FrameAssembler:
    """Rebuilds tensors from a chunk stream, validating against `spec`.

    Raises MalformedInput (truncated stream, unknown or repeated name, wrong shape/dtype/codec,
    size or checksum mismatch, NaN/Inf) or TooLarge (frame or chunk over its limit). Call
    `finish()` when the stream ends: it raises unless every tensor of the spec arrived whole.
    """

    def __init__(self, spec: Spec, *, codecs: Iterable[Codec], max_frame_bytes: int,
                 max_chunk_bytes: int = CHUNK_BYTES, finite: bool = True, keep_sparse: bool = False,
                 defer: bool = False, defer_dir: Path | None = None, lazy: bool = False):
        self.spec = dict(spec)
        self.codecs = set(codecs)
        self.max_frame_bytes = max_frame_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.finite = finite
        self.keep_sparse = keep_sparse  # a sparse frame becomes a SparseTensor, not a dense tensor
        self.defer = defer  # keep whole frames compressed until finish(), and decode them there
        # where deferred frames wait: (header, payload) here, or (header, offset) with the payload in an
        # unnamed file in `defer_dir` (pushes waiting for a decode slot then hold no payload in memory)
        self._deferred: list[tuple[FrameHeader, bytes | int]] = []
        self.defer_dir = defer_dir
        self.lazy = lazy  # finish() returns a LazyDelta: dense tensors checked here, decoded again when read
        self._codecs: dict[str, Codec] = {}
        self._stats: dict[str, tuple[float, float]] = {}
        self._defer_file = None
        self._defer_at = 0
        self._frame_at = 0
        self.tensors: dict[str, torch.Tensor | SparseTensor] = {}
        self.raw: dict[str, bytes] = {}
        self._current: FrameHeader | None = None
        self._parts: list[bytes] = []
        self._received = 0
        self._bundle: BundleReader | None = None  # a stream of one bundle, not of frames
        self._bundle_parts: list[bytes] = []  # its payload while deferred in memory
        self.wire_bytes = 0  # payload bytes received so far
        self._dctx = zstandard.ZstdDecompressor()
        self._scratch: torch.Tensor | None = None  # where a lazy assembler decodes each tensor to check it

    @classmethod
    def for_spec(cls, spec: Spec, codecs: Iterable[Codec], *, keep_sparse: bool = False,
                 defer: bool = False, defer_dir: Path | None = None, lazy: bool = False) -> FrameAssembler:
        """An assembler whose frame limit is the largest tensor of `spec` in fp32, plus zstd's slack."""
        codecs = list(codecs)
        largest = max(raw_size(c, math.prod(s)) for s in spec.values() for c in {Codec.FP32, *codecs})
        return cls(spec, codecs=codecs, max_frame_bytes=largest + FRAME_SLACK, max_chunk_bytes=CHUNK_BYTES,
                   keep_sparse=keep_sparse, defer=defer, defer_dir=defer_dir, lazy=lazy)

    def add(self, chunk: ChunkData) -> None:
        if len(chunk.data) > self.max_chunk_bytes:
            raise TooLarge("chunk_size", f"chunk of {len(chunk.data)} bytes exceeds {self.max_chunk_bytes}")
        self.wire_bytes += len(chunk.data)
        if isinstance(chunk.header, BundleHeader) or (chunk.header is None and self._bundle is not None):
            return self._add_bundle(chunk)
        if chunk.header is not None:
            if self._bundle is not None:
                raise MalformedInput("bundle", "a stream carries one bundle or frames, not both")
            if self._current is not None:
                raise MalformedInput("truncated", f"frame {self._current.name!r} ended after "
                                     f"{self._received} of {self._current.payload_bytes} payload bytes")
            self._start(chunk.header)
        elif self._current is None:
            raise MalformedInput("no_header", "chunk without a frame header")
        assert self._current is not None
        self._received += len(chunk.data)
        if self._received > self._current.payload_bytes:
            raise MalformedInput("size", f"frame {self._current.name!r} carries more than its "
                                 f"declared {self._current.payload_bytes} payload bytes")
        if self.defer and self.defer_dir is not None:  # straight to the file: a waiting push holds no frame
            self._park(chunk.data)
        else:
            self._parts.append(chunk.data)
        if self._received == self._current.payload_bytes:
            self._complete()

    def _add_bundle(self, chunk: ChunkData) -> None:
        """A bundle's chunk: its header starts the stream's one bundle; its payload is read as it comes
        (or parked, deferred, and read in finish())."""
        if isinstance(chunk.header, BundleHeader):
            if self._bundle is not None or self.tensors or self._current is not None:
                raise MalformedInput("bundle", "a stream carries one bundle or frames, not both")
            h = chunk.header
            if h.codec not in self.codecs:
                raise MalformedInput("codec", f"bundle uses codec {h.codec!r}, accepted: "
                                              f"{sorted(c.name for c in self.codecs)}")
            self._bundle = BundleReader(h, self.spec, self._take, bundle_limit(self.spec, h.codec))
        assert self._bundle is not None
        if not self.defer:
            return self._bundle.feed(chunk.data)
        self._bundle.received += len(chunk.data)  # (the limit is checked as the chunks come, read or not)
        if self._bundle.received > self._bundle.max_payload:
            raise TooLarge("frame_size", f"bundle payload over its limit of {self._bundle.max_payload} bytes")
        if self.defer_dir is not None:
            self._park(chunk.data)
        else:
            self._bundle_parts.append(chunk.data)

    def _take(self, name: str, raw: bytes) -> None:
        """One tensor of a bundle, whole: decoded and checked as a frame's (its digest is checked at the end)."""
        assert self._bundle is not None
        self._check(name, self._bundle.header.codec, self.spec[name], raw)

    def _start(self, h: FrameHeader) -> None:
        if h.name not in self.spec:
            raise MalformedInput("unknown_tensor", f"unknown tensor {h.name!r}")
        if h.name in self.tensors:
            raise MalformedInput("duplicate_tensor", f"tensor {h.name!r} sent twice")
        want = self.spec[h.name]
        if tuple(h.shape) != tuple(want):
            raise MalformedInput("shape", f"tensor {h.name!r} has shape {tuple(h.shape)}, expected {tuple(want)}")
        if h.dtype != DTYPE:
            raise MalformedInput("dtype", f"tensor {h.name!r} has dtype {h.dtype}, expected {DTYPE}")
        if h.codec not in self.codecs:
            raise MalformedInput("codec", f"tensor {h.name!r} uses codec {h.codec!r}, accepted: "
                                 f"{sorted(c.name for c in self.codecs)}")
        expected_raw = raw_size(h.codec, math.prod(want))
        if h.raw_bytes > expected_raw if h.codec.sparse else h.raw_bytes != expected_raw:
            raise MalformedInput("size", f"tensor {h.name!r} declares {h.raw_bytes} raw bytes, {h.codec.name} "
                                 f"needs {'at most ' if h.codec.sparse else ''}{expected_raw}")
        if h.payload_bytes > self.max_frame_bytes:
            raise TooLarge("frame_size", f"frame {h.name!r} of {h.payload_bytes} bytes exceeds "
                           f"the limit of {self.max_frame_bytes}")
        if len(h.sha256) != 32:
            raise MalformedInput("checksum", f"tensor {h.name!r} has no valid sha256")
        self._current, self._parts, self._received = h, [], 0
        self._frame_at = self._defer_at  # where this frame's payload starts in the defer file
        if h.payload_bytes == 0:
            raise MalformedInput("size", f"frame {h.name!r} declares an empty payload")

    def _complete(self) -> None:
        h = self._current
        assert h is not None
        if self.defer:
            self._deferred.append((h, self._frame_at if self.defer_dir is not None else b"".join(self._parts)))
            self.tensors[h.name] = None  # type: ignore[assignment]  # arrived; decoded in finish()
            self._current, self._parts = None, []
            return
        self._decode(h, b"".join(self._parts))

    def _park(self, data: bytes) -> None:
        """Payload bytes of a deferred frame onto the end of the file in `defer_dir`."""
        if self._defer_file is None:
            self._defer_file = tempfile.TemporaryFile(dir=self.defer_dir)
        self._defer_file.write(data)
        self._defer_at += len(data)

    def close(self) -> None:
        """Drop the deferred frames' file (finish() does; a stream cut short should too)."""
        if self._defer_file is not None:
            self._defer_file.close()
            self._defer_file = None
        self._scratch = None

    def _decode(self, h: FrameHeader, payload: bytes) -> None:
        try:
            # A zstd frame may declare its content size, and decompress() allocates what it declares,
            # whatever max_output_size says: a flipped bit there asked for 10^17 bytes (MemoryError,
            # found by the fuzz test). So the declared size must be the header's before anything is
            # allocated; -1 (not declared) leaves max_output_size as the bound.
            declared = zstandard.frame_content_size(payload)
            if declared not in (-1, h.raw_bytes):
                raise MalformedInput("zstd", f"tensor {h.name!r}: zstd frame declares {declared} bytes, "
                                             f"header says {h.raw_bytes}")
            raw = self._dctx.decompress(payload, max_output_size=h.raw_bytes)
        except zstandard.ZstdError as exc:
            raise MalformedInput("zstd", f"tensor {h.name!r}: payload is not valid zstd data: {exc}") from exc
        if len(raw) != h.raw_bytes:
            raise MalformedInput("size", f"tensor {h.name!r} decompressed to {len(raw)} bytes, "
                                 f"header says {h.raw_bytes}")
        if hashlib.sha256(raw).digest() != h.sha256:
            raise MalformedInput("checksum", f"tensor {h.name!r} fails its sha256 check")
        self._check(h.name, h.codec, h.shape, raw)
        self._current, self._parts = None, []

    def _check(self, name: str, codec: Codec, shape: tuple[int, ...], raw: bytes) -> None:
        """A tensor's raw bytes decoded and checked (finite), kept as the assembler keeps them."""
        t: torch.Tensor | SparseTensor | None
        if codec.sparse and self.keep_sparse:
            t = SparseTensor.decode(raw, shape, codec.two_bit)  # its values are checked finite
        else:
            out = None
            if self.lazy:  # decoded to be checked and dropped: into one buffer for all the tensors
                numel = math.prod(shape)
                if self._scratch is None or self._scratch.numel() < numel:
                    self._scratch = torch.empty(max(math.prod(s) for s in self.spec.values()))
                out = self._scratch
            t = decode(codec, raw, shape, out=out)
            if self.finite and not all_finite(t):
                raise MalformedInput("nonfinite", f"tensor {name!r} contains NaN or Inf")
            if self.lazy:
                self._codecs[name] = codec
                self._stats[name] = (absmax(t), float(torch.linalg.vector_norm(t)))
                t = None  # checked; LazyDelta decodes it again when it is read
        self.tensors[name] = t  # type: ignore[assignment]
        self.raw[name] = raw

    def finish(self) -> Mapping[str, torch.Tensor | SparseTensor]:
        if self._bundle is not None:
            return self._finish_bundle(self._bundle)
        if self._current is not None:
            raise MalformedInput("truncated", f"stream ended inside frame {self._current.name!r} "
                                 f"({self._received} of {self._current.payload_bytes} bytes)")
        missing = [n for n in self.spec if n not in self.tensors]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise MalformedInput("truncated", f"stream ended without tensors {', '.join(missing[:3])}{more}")
        if self._defer_file is not None:
            self._defer_file.flush()  # what it buffered, before it is read back by offset
        try:
            while self._deferred:  # whole and complete: only now decompressed, hashed and decoded
                h, payload = self._deferred.pop(0)
                if isinstance(payload, int):
                    assert self._defer_file is not None
                    payload = os.pread(self._defer_file.fileno(), h.payload_bytes, payload)
                self._decode(h, payload)
        finally:
            self.close()
        return self._result()

    def _finish_bundle(self, reader: BundleReader) -> Mapping[str, torch.Tensor | SparseTensor]:
        try:
            if self.defer:  # whole: only now decompressed, hashed and decoded
                if self._defer_file is not None:
                    self._defer_file.flush()
                    for lo in range(0, self._defer_at, CHUNK_BYTES):
                        reader.feed_deferred(os.pread(self._defer_file.fileno(), min(CHUNK_BYTES, self._defer_at - lo), lo))
                while self._bundle_parts:
                    reader.feed_deferred(self._bundle_parts.pop(0))
            reader.end()
        finally:
            self.close()
        return self._result()

    def _result(self) -> Mapping[str, torch.Tensor | SparseTensor]:
        if self.lazy:
            return LazyDelta(self.spec, self._codecs, self.raw,
                             {n: t for n, t in self.tensors.items() if n not in self._codecs}, self._stats)
        return {n: self.tensors[n] for n in self.spec}
