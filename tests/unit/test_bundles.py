"""Bundles (issue #40): every tensor of a stream behind one header; the same tensors as frames give, a
header that does not grow with the tensors' names, and every malformed bundle refused with its reason."""

import dataclasses
import hashlib

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from btnode.codec.codecs import Codec, decode, encode
from btnode.codec.frames import (CHUNK_BYTES, Bundle, ChunkData, FrameAssembler, bundle, encode_frames, iter_chunks,
                                 spec_of, stream_digest)
from btnode.codec.sparse import SparseTensor
from btnode.errors import MalformedInput, PeerInputError, TooLarge
from btnode.rpc.convert import chunk_from_pb, chunk_to_pb

TENSORS = {"big": torch.randn(700, 800), "small": torch.randn(3, 5), "vec": torch.randn(257), "none": torch.randn(0)}
SPEC = spec_of(TENSORS)
KEEP = 41


def feed(chunks, spec=SPEC, codecs=tuple(Codec), **kw):
    a = FrameAssembler.for_spec(spec, codecs, **kw)
    try:
        for c in chunks:
            a.add(c)
        return a.finish()
    finally:
        a.close()


def dense(t):
    return t.dense() if isinstance(t, SparseTensor) else t


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("mode", ["live", "deferred", "file", "lazy"])
def test_a_bundle_gives_what_the_codec_decodes_through_protobuf_in_every_mode(codec, mode, tmp_path):
    b = bundle(TENSORS, codec, keep=KEEP)
    chunks = [chunk_from_pb(chunk_to_pb(c)) for c in b.chunks()]
    assert chunks[0].header is not None and all(c.header is None for c in chunks[1:])
    assert b.payload_bytes == sum(len(c.data) for c in chunks) and all(len(c.data) <= CHUNK_BYTES for c in chunks)
    kw = {"live": {}, "deferred": {"defer": True}, "file": {"defer": True, "defer_dir": tmp_path},
          "lazy": {"defer": True, "lazy": True, "keep_sparse": True}}[mode]
    out = feed(chunks, **kw)
    for n, t in TENSORS.items():
        assert torch.equal(dense(out[n]), decode(codec, encode(codec, t, keep=KEEP), SPEC[n]))
    assert stream_digest([b]) == stream_digest(encode_frames(TENSORS, codec, keep=KEEP))  # what a receipt signs


def test_one_header_for_the_whole_stream_whatever_the_names():
    names = {f"blocks.{i}.attention.query_key_value.weight": torch.randn(4, 4) for i in range(40)}

    def overhead(frames):
        return sum(chunk_to_pb(c).ByteSize() - len(c.data) for c in iter_chunks(frames))

    per_frame = overhead(encode_frames(names, Codec.SPARSE8, keep=KEEP))
    bundled = overhead([bundle(names, Codec.SPARSE8, keep=KEEP)])
    assert per_frame > 40 * (32 + 40)  # a sha256 and a name a tensor
    assert bundled <= 32 + 40 + 16  # the digest, a one-byte size a tensor, and a few bytes of fields
    assert overhead([bundle(names, Codec.INT8)]) <= 32 + 12  # a dense codec states no sizes


def with_bundle(chunks, **changes):
    return [ChunkData(dataclasses.replace(chunks[0].header, **changes), chunks[0].data), *chunks[1:]]


def good(codec=Codec.SPARSE8, tensors=TENSORS, chunk_bytes=CHUNK_BYTES):
    return list(bundle(tensors, codec, keep=KEEP).chunks(chunk_bytes))


@pytest.mark.parametrize("changes, reason, match", [
    ({"tensors": 3}, "bundle", "a bundle of 3 tensors; the spec has 4"),
    ({"raw_sizes": (1, 2)}, "bundle", "states 2 sizes for 4 tensors"),
    ({"digest": b"short"}, "checksum", "32-byte frames digest"),
    ({"digest": hashlib.sha256(b"x").digest()}, "checksum", "fails its frames digest"),
])
def test_a_bundle_header_that_lies_is_refused(changes, reason, match):
    with pytest.raises(MalformedInput, match=match) as e:
        feed(with_bundle(good(), **changes))
    assert e.value.reason == reason


def test_sizes_must_fit_the_codec_and_the_spec():
    chunks = good()
    sizes = list(chunks[0].header.raw_sizes)
    with pytest.raises(MalformedInput, match="'big' declares 9999999 raw bytes") as e:
        feed(with_bundle(chunks, raw_sizes=(9_999_999, *sizes[1:])))
    assert e.value.reason == "size"
    with pytest.raises(MalformedInput, match="zstd frame declares"):  # sizes that fit, but not the payload's
        feed(with_bundle(chunks, raw_sizes=(sizes[0] - 1, *sizes[1:])))
    with pytest.raises(MalformedInput):  # the payload's total, cut in the wrong places: a tensor that cannot decode
        feed(with_bundle(chunks, raw_sizes=(sizes[0] - 1, sizes[1] + 1, *sizes[2:])))
    with pytest.raises(MalformedInput, match="INT8 bundle states no sizes"):
        feed(with_bundle(good(Codec.INT8), raw_sizes=(1, 1, 1, 0)))
    with pytest.raises(MalformedInput, match="uses codec") as e:
        feed(good(Codec.INT8), codecs=[Codec.SPARSE8])
    assert e.value.reason == "codec"


def test_the_order_of_a_bundle_is_the_names_not_either_sides_dict_order():
    """An aggregator restored from its state folder held its spec in another order than its workers (the
    DiLoCo restart test's pull failed its digest): a bundle goes in name order, read back whatever order
    either side lists the tensors in."""
    twins = {"a": torch.randn(300), "b": torch.randn(300)}
    swapped = list(bundle({"b": twins["b"], "a": twins["a"]}, Codec.FP32).chunks())
    got = feed(swapped, spec=spec_of(twins))
    assert all(torch.equal(got[n], twins[n]) for n in twins)
    got = feed(swapped, spec={"b": (300,), "a": (300,)})
    assert all(torch.equal(got[n], twins[n]) for n in twins)


def test_truncated_extended_and_corrupted_payloads():
    chunks = good(Codec.FP32)
    assert len(chunks) >= 2
    with pytest.raises(MalformedInput, match="stream ended inside a bundle") as e:
        feed(chunks[:-1])
    assert e.value.reason == "truncated"
    with pytest.raises(MalformedInput, match="goes on after"):
        feed([*chunks[:-1], ChunkData(None, chunks[-1].data + b"\0")])
    with pytest.raises(MalformedInput, match="goes on after"):
        feed([*chunks, ChunkData(None, b"\0" * 8)])
    corrupt = bytearray(chunks[1].data)
    corrupt[len(corrupt) // 2] ^= 0xFF
    with pytest.raises(MalformedInput) as e:
        feed([chunks[0], ChunkData(None, bytes(corrupt)), *chunks[2:]])
    assert e.value.reason in ("zstd", "checksum", "nonfinite")  # refused, whichever check meets it first


def test_a_zstd_frame_that_declares_no_size_or_another_one_is_refused_before_decompressing():
    raw = b"".join(encode(Codec.INT8, t) for t in TENSORS.values())
    header = bundle(TENSORS, Codec.INT8).header
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(raw)
    with pytest.raises(MalformedInput, match="declares") as e:
        feed([ChunkData(header, unsized)])
    assert e.value.reason == "zstd"
    huge = zstandard.ZstdCompressor(level=1).compressobj(size=2**40)
    with pytest.raises(MalformedInput, match="declares 1099511627776 bytes"):
        feed([ChunkData(header, huge.compress(raw[:1000]) + huge.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))])


def test_bundles_and_frames_do_not_mix_and_a_stream_has_one_bundle():
    frames = list(iter_chunks(encode_frames(TENSORS, Codec.INT8)))
    with pytest.raises(MalformedInput, match="one bundle or frames") as e:
        feed([*frames[:1], *good(Codec.INT8)])
    assert e.value.reason == "bundle"
    with pytest.raises(MalformedInput, match="one bundle or frames"):
        feed([*good(Codec.INT8), *frames[:1]])
    with pytest.raises(MalformedInput, match="one bundle or frames"):
        feed([*good(Codec.INT8), *good(Codec.INT8)])


def test_a_payload_over_the_limit_is_refused_as_it_comes():
    chunks = good(Codec.FP32)
    a = FrameAssembler.for_spec(SPEC, [Codec.FP32], defer=True)
    with pytest.raises(TooLarge):
        for _ in range(8):
            a.add(ChunkData(chunks[0].header if a._bundle is None else None, b"\0" * CHUNK_BYTES))


@pytest.mark.parametrize("codec", [Codec.FP32, Codec.INT8])
def test_nan_under_an_honest_digest_is_refused(codec):
    bad = dict(TENSORS, small=torch.full((3, 5), float("nan")))
    with pytest.raises(MalformedInput) as e:
        feed(good(codec, bad))
    assert e.value.reason == "nonfinite"


def test_a_worker_bundle_counts_its_bytes_once_sent():
    heard = []
    b = Bundle(Codec.INT8, [(n, encode(Codec.INT8, t)) for n, t in TENSORS.items()], on_sent=lambda *x: heard.append(x))
    assert b.payload_bytes == 0 and b.raw_bytes == sum(len(encode(Codec.INT8, t)) for t in TENSORS.values())
    frames = list([b])  # as a push that signs its frames' digest lists them first: nothing sent yet
    assert not heard
    sent = list(iter_chunks(frames))
    assert b.payload_bytes == sum(len(c.data) for c in sent) > 0 and heard == [(b.raw_bytes, b.payload_bytes)]
    list(b.chunks())  # a re-push counts again
    assert len(heard) == 2


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzzed_bundles_never_crash_and_never_yield_wrong_tensors(data):
    """Random mutations of a valid bundle stream: either a PeerInputError, or exactly the original tensors."""
    tensors = {"a": torch.arange(12.0).view(3, 4), "b": torch.linspace(-1, 1, 300),
               "c": torch.randn(50, generator=torch.Generator().manual_seed(0))}
    codec = data.draw(st.sampled_from([Codec.FP32, Codec.INT8, Codec.SPARSE8, Codec.SPARSE2]))
    chunks = list(bundle(tensors, codec, keep=410).chunks(64))
    op = data.draw(st.sampled_from(["drop", "dup", "flip", "swap", "truncate", "sizes", "count"]))
    i = data.draw(st.integers(0, len(chunks) - 1))
    h = chunks[0].header
    if op == "drop":
        del chunks[i]
    elif op == "dup":
        chunks.insert(i, chunks[i])
    elif op == "flip" and chunks[i].data:
        b = bytearray(chunks[i].data)
        b[data.draw(st.integers(0, len(b) - 1))] ^= data.draw(st.integers(1, 255))
        chunks[i] = ChunkData(chunks[i].header, bytes(b))
    elif op == "swap":
        j = data.draw(st.integers(0, len(chunks) - 1))
        chunks[i], chunks[j] = chunks[j], chunks[i]
    elif op == "truncate":
        chunks[i] = ChunkData(chunks[i].header, chunks[i].data[: data.draw(st.integers(0, len(chunks[i].data)))])
    elif op == "sizes" and h.raw_sizes:
        sizes = [data.draw(st.integers(0, 2 * s)) for s in h.raw_sizes]
        chunks = with_bundle(chunks, raw_sizes=tuple(sizes))
    elif op == "count":
        chunks = with_bundle(chunks, tensors=data.draw(st.integers(0, 5)))
    a = FrameAssembler(spec_of(tensors), codecs=[codec], max_frame_bytes=1 << 16, max_chunk_bytes=64)
    try:
        for c in chunks:
            a.add(c)
        out = a.finish()
    except PeerInputError:
        return
    for n, t in tensors.items():
        assert torch.equal(out[n], decode(codec, encode(codec, t, keep=410), t.shape))
