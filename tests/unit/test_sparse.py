"""Sparse codecs (codec/sparse.py, issue #24): round trips keep exactly each chunk's top k_c within the
codec's error, error feedback sends what was meant, and every hostile byte string is a MalformedInput
with its reason."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from btnode.codec.codecs import Codec, decode, encode, raw_size
from btnode.codec.frames import encode_update
from btnode.codec.sparse import CHUNK, EF_DECAY, HEADER, Layout, decode_sparse, keep_of, top_positions
from btnode.errors import MalformedInput

SPARSE = (Codec.SPARSE8, Codec.SPARSE2)
SIZES = (0, 1, 100, 4095, 4096, 4097, 3 * CHUNK + 5)
KEEPS = (1, 41, 410, 4096)


def chunks_of(n: int) -> list[tuple[int, int]]:
    """(start, length) of every chunk of an n-value tensor: full chunks, then a shorter last one."""
    return [(lo, min(CHUNK, n - lo)) for lo in range(0, n, CHUNK)]


def kept_per_chunk(length: int, keep: int) -> int:
    """k_c as documented: ⌈keep · len_c / CHUNK⌉, at most the chunk."""
    return min(length, -(-keep * length // CHUNK))


def positions(codec: Codec, raw: bytes, n: int) -> torch.Tensor:
    return decode_sparse(raw, n, codec is Codec.SPARSE2)[0]


def assert_top_k_per_chunk(x: torch.Tensor, pos: torch.Tensor, keep: int) -> None:
    """Each chunk sends k_c positions, and none it dropped is larger than one it kept (ties either way)."""
    for lo, length in chunks_of(x.numel()):
        mine = pos[(pos >= lo) & (pos < lo + length)] - lo
        assert mine.numel() == kept_per_chunk(length, keep)
        mag = x[lo:lo + length].abs()
        dropped = torch.ones(length, dtype=torch.bool)
        dropped[mine] = False
        if dropped.any():
            assert float(mag[mine].min()) >= float(mag[dropped].max())


@pytest.mark.parametrize("codec", SPARSE, ids=lambda c: c.name)
@pytest.mark.parametrize("keep", KEEPS)
@pytest.mark.parametrize("n", SIZES)
def test_round_trips_keep_each_chunks_top_k_within_the_codecs_error(codec, keep, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + keep))  # continuous: no ties
    raw = encode(codec, x, keep=keep)
    assert len(raw) <= raw_size(codec, n)
    pos = positions(codec, raw, n)
    assert torch.all(pos[1:] > pos[:-1])
    for lo, length in chunks_of(n):  # exactly the top k_c by magnitude (no ties, so the set is unique)
        top = x[lo:lo + length].abs().topk(kept_per_chunk(length, keep)).indices + lo
        assert torch.equal(pos[(pos >= lo) & (pos < lo + length)], top.sort().values)
    y = decode(codec, raw, (n,))
    dropped = torch.ones(n, dtype=torch.bool)
    dropped[pos] = False
    assert not y[dropped].any()
    for lo, length in chunks_of(n):
        mine = pos[(pos >= lo) & (pos < lo + length)]
        sent, got = x[mine], y[mine]
        if codec is Codec.SPARSE8:  # half a step of the chunk's absmax/127, plus fp32 rounding
            assert float((got - sent).abs().max()) <= float(sent.abs().max()) / 254 * (1 + 1e-5)
        else:  # each value becomes the mean of its bin (at most four per chunk), in fp16, with its sign
            assert torch.unique(got).numel() <= 4 and torch.all(torch.sign(got) == torch.sign(sent))
            for v in torch.unique(got):
                assert float(v) == pytest.approx(float(sent[got == v].mean()), rel=1e-3)


def test_layout_of_a_short_last_chunk_keeps_the_same_share():
    lay = Layout.of(3 * CHUNK + 5, 41)
    assert [(c, length, k) for c, length, k, _ in lay.groups] == [(3, CHUNK, 41), (1, 5, 1)]
    assert lay.kept == 3 * 41 + 1 and Layout.of(4097, 4096).kept == 4097 and Layout.of(0, 7).groups == ()
    assert keep_of(0.01) == 41 and keep_of(0.1) == 410 and keep_of(1.0) == CHUNK and keep_of(1e-9) == 1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3 * CHUNK + 5), keep=st.integers(1, CHUNK), seed=st.integers(0, 2**31),
       levels=st.sampled_from([0, 1, 3]), codec=st.sampled_from(SPARSE), scale=st.sampled_from([1e-6, 1.0, 1e4]))
def test_any_tensor_round_trips_to_its_top_k(n, keep, seed, levels, codec, scale):
    """Any size, keep and magnitudes, ties included (`levels` rounds values to a few magnitudes)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    if levels:
        x = torch.round(x / scale * levels) * scale / levels
    raw = encode(codec, x, keep=keep)
    assert len(raw) <= raw_size(codec, n)
    pos = positions(codec, raw, n)
    assert torch.all(pos[1:] > pos[:-1])
    assert_top_k_per_chunk(x, pos, keep)
    y = decode(codec, raw, (n,))  # no larger than the largest value (bin means and int8 steps stay inside), but
    top = (float(x.abs().max()) if n else 0.0) * (1 + 1e-3) + 2**-24  # for fp16 rounding, subnormals included
    assert bool(torch.isfinite(y).all()) and bool((y.abs() <= top).all())


# -- error feedback -----------------------------------------------------------------------------
def feedback_rounds(codec: Codec, delta: torch.Tensor, rounds: int, keep: int,
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Push a fixed Δ `rounds` times with error feedback: (what each round sent, the residual after it)."""
    base = {"w": torch.zeros_like(delta)}
    residual: dict[str, torch.Tensor] = {}
    sent, left = [], []
    for _ in range(rounds):
        raw, residual = encode_update({"w": delta}, base, residual, codec, error_feedback=True, keep=keep)
        sent.append(decode(codec, raw["w"], tuple(delta.shape)))
        left.append(residual["w"])
    return sent, left


@pytest.mark.parametrize("codec", SPARSE, ids=lambda c: c.name)
def test_error_feedback_sends_what_was_meant_with_a_bounded_residual(codec):
    delta = torch.randn(2 * CHUNK, generator=torch.Generator().manual_seed(1))
    rounds, keep = 60, 410  # 10 %: over 1/(1−β) = 20 rounds every coordinate's pile gets its turn
    assert codec.ef_decay == EF_DECAY
    sent, left = feedback_rounds(codec, delta, rounds, keep)
    bound = float(delta.abs().max()) / (1 - EF_DECAY) * (1 + 1e-3)  # |e| ≤ |Δ| + β|e|: the pile saturates
    assert all(float(e.abs().max()) <= bound for e in left)
    # Σ sent = T·Δ − e_T − (1−β)·Σ_{t<T} e_t: the books balance each round, what decays is the only loss
    books = rounds * delta - left[-1] - (1 - EF_DECAY) * torch.stack(left[:-1]).sum(0)
    assert torch.allclose(torch.stack(sent).sum(0), books, atol=1e-3)
    meant = rounds * delta
    err = float((torch.stack(sent).sum(0) - meant).norm() / meant.norm())
    without = float((rounds * decode(codec, encode(codec, delta, keep=keep), (delta.numel(),)) - meant).norm()
                    / meant.norm())
    assert err < 0.25 and without > 0.6, (err, without)  # top-10 % alone loses most of Δ; feedback sends it


@pytest.mark.parametrize("codec", SPARSE, ids=lambda c: c.name)
def test_a_residual_decays_by_beta_once_the_delta_stops(codec):
    delta = torch.randn(CHUNK + 7, generator=torch.Generator().manual_seed(2))
    _, left = feedback_rounds(codec, delta, 10, 41)
    base = {"w": torch.zeros_like(delta)}
    residual = {"w": left[-1]}
    for _ in range(20):
        before = float(residual["w"].abs().max())
        _, residual = encode_update(base, base, residual, codec, error_feedback=True, keep=41)
        assert float(residual["w"].abs().max()) <= EF_DECAY * before * (1 + 1e-3)


# -- hostile bytes ------------------------------------------------------------------------------
def unary_bytes(bits: np.ndarray | list[int]) -> bytes:
    """A unary section of these bits, padded with ones to a byte."""
    padded = np.ones(-(-len(bits) // 8) * 8, np.uint8)
    padded[:len(bits)] = bits
    return np.packbits(padded, bitorder="little").tobytes()


def rebuilt(codec: Codec, n: int, keep: int, unary: list[int]) -> bytes:
    """A valid frame's bytes before its unary section, then the given unary bits."""
    head = encode(codec, torch.randn(n, generator=torch.Generator().manual_seed(3)), keep=keep)
    return head[:Layout.of(n, keep).fixed_bytes(codec is Codec.SPARSE2)] + unary_bytes(unary)


def patched(raw: bytes, at: int, data: bytes) -> bytes:
    return raw[:at] + data + raw[at + len(data):]


def refusal(codec: Codec, raw: bytes, n: int) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even a numpy warning on hostile bytes
        with pytest.raises(MalformedInput) as err:
            decode(codec, raw, (n,))
    return err.value.reason


def frame(codec: Codec, n: int = 100, keep: int = 4096) -> bytes:
    return encode(codec, torch.randn(n, generator=torch.Generator().manual_seed(4)), keep=keep)


@pytest.mark.parametrize("codec", SPARSE, ids=lambda c: c.name)
def test_hostile_headers_and_sizes_are_refused_with_their_reason(codec):
    raw = frame(codec)  # 100 values, all kept: k = 100, Rice r = 0, so the unary section is 100 zeros
    assert decode(codec, raw, (100,)).numel() == 100
    for keep in (0, CHUNK + 1, 65535):
        assert refusal(codec, keep.to_bytes(HEADER, "little") + raw[HEADER:], 100) == "layout"
    fixed = Layout.of(100, 4096).fixed_bytes(codec is Codec.SPARSE2)
    for cut in (b"", raw[:1], raw[:fixed - 1], raw + b"\xff", raw + bytes(64)):
        assert refusal(codec, cut, 100) == "size"
    assert refusal(codec, raw[:-1], 100) == "count"  # the last byte of the unary section holds gaps
    assert refusal(codec, rebuilt(codec, 100, 4096, [0] * 99), 100) == "count"  # too few gaps
    assert refusal(codec, rebuilt(codec, 100, 4096, [0] * 101), 100) == "count"  # too many
    assert refusal(codec, rebuilt(codec, 100, 4096, [1] + [0] * 100), 100) == "range"  # the last one lands on 100
    assert refusal(codec, raw, 99) in ("size", "range")  # another tensor's size


@pytest.mark.parametrize("codec", SPARSE, ids=lambda c: c.name)
def test_non_zero_padding_is_refused(codec):
    """Padding bits are zero (ones in the unary section), so one tensor has one encoding and one sha256."""
    raw = frame(codec, n=CHUNK, keep=1)  # one value: Rice r = 11, so 11 remainder bits and 5 bits of padding
    lay = Layout.of(CHUNK, 1)
    rem_at = lay.fixed_bytes(codec is Codec.SPARSE2) - 2
    assert refusal(codec, patched(raw, rem_at + 1, bytes([raw[rem_at + 1] | 0x80])), CHUNK) == "size"
    if codec is Codec.SPARSE2:  # one 2-bit code in a byte: 6 bits of padding
        at = HEADER + 8
        assert refusal(codec, patched(raw, at, bytes([raw[at] | 0x80])), CHUNK) == "size"
    assert refusal(codec, raw[:-1] + bytes([raw[-1] & 0x7F]), CHUNK) == "count"  # a zero in the unary padding


def test_sparse8_values_and_scales_are_checked():
    raw = frame(Codec.SPARSE8)
    scale, values = HEADER, HEADER + 4
    assert refusal(Codec.SPARSE8, patched(raw, values + 5, b"\x80"), 100) == "range"  # −128
    for bad in (float("nan"), float("inf"), -1.0, 3e38):  # 3e38 × 127 overflows to Inf
        assert refusal(Codec.SPARSE8, patched(raw, scale, np.float32(bad).tobytes()), 100) == "nonfinite"


@pytest.mark.parametrize("entry", range(4))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_sparse2_tables_must_be_finite_even_in_a_bin_no_value_uses(entry, bad):
    raw = frame(Codec.SPARSE2, n=CHUNK, keep=1)  # one value, so three of the four bins are unused
    assert refusal(Codec.SPARSE2, patched(raw, HEADER + 2 * entry, np.float16(bad).tobytes()), CHUNK) == "nonfinite"


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), codec=st.sampled_from(SPARSE), keep=st.sampled_from([1, 41, 410]))
def test_duplicate_positions_cannot_be_written(seed, codec, keep):
    """Positions travel as gaps g ≥ 0 (i_j = i_{j−1} + g + 1), so any remainder and unary bits whatsoever
    decode to strictly increasing positions, or are refused: a duplicate or unordered index has no encoding,
    and there is no duplicate check to get wrong. Here: random remainder bits and a random unary section
    with the right number of gaps."""
    n, two = 2 * CHUNK + 300, codec is Codec.SPARSE2
    lay = Layout.of(n, keep)
    rng = np.random.default_rng(seed)
    head = frame(codec, n, keep)
    rem_at = lay.fixed_bytes(two) - -(-lay.remainder_bits // 8)
    rem = np.zeros(-(-lay.remainder_bits // 8) * 8, np.uint8)
    rem[:lay.remainder_bits] = rng.integers(0, 2, lay.remainder_bits)
    unary = np.ones(lay.kept + int(rng.integers(0, lay.max_unary_bits() - lay.kept + 1)), np.uint8)
    unary[rng.choice(unary.size, lay.kept, replace=False)] = 0
    raw = head[:rem_at] + np.packbits(rem, bitorder="little").tobytes() + unary_bytes(unary)
    try:
        pos, _ = decode_sparse(raw, n, two)
    except MalformedInput as err:
        assert err.reason in ("range", "size"), err  # a gap past its chunk, or one byte of trailing ones
        return
    assert pos.numel() == lay.kept and bool(torch.all(pos[1:] > pos[:-1])) and 0 <= int(pos[0]) and int(pos[-1]) < n


def reference_top(x: np.ndarray, k: int) -> np.ndarray:
    """Each row's k largest |x|, ties to the lower position, sorted: the rule top_positions documents."""
    return np.sort(np.argsort(-np.abs(x), axis=1, kind="stable")[:, :k], axis=1)


@pytest.mark.parametrize("values", ["normal", "ties", "zeros", "off_sample"])
@pytest.mark.parametrize("chunks,length,k", [(40, CHUNK, 123), (6, CHUNK, 369), (3, CHUNK, 1), (2, 1000, 31),
                                             (2, CHUNK, CHUNK), (1, 17, 3)])
def test_the_encoders_selection_is_the_top_k_with_ties_to_the_lower_position(values, chunks, length, k):
    """top_positions's fast path (a sampled threshold, then an exact selection among the candidates) picks
    exactly what a full sort picks: on ties, on zeros, and where the large values all lie between the
    sampled positions (every such row takes the exact selection over all its values)."""
    rng = np.random.default_rng(7)
    x = {"normal": lambda: rng.standard_normal((chunks, length)),
         "ties": lambda: rng.integers(-3, 4, (chunks, length)),
         "zeros": lambda: np.zeros((chunks, length)),
         "off_sample": lambda: rng.standard_normal((chunks, length)) * np.where(np.arange(length) % 4 == 1, 100, 0.01),
         }[values]().astype(np.float32)
    assert np.array_equal(top_positions(x, k), reference_top(x, k))


def test_the_selection_is_what_torch_topk_chose_on_distinct_values():
    """On distinct magnitudes the selection is the one the encoder made before #40 (torch.topk): same bytes."""
    x = torch.randn(50 * CHUNK)
    before = x.view(-1, CHUNK).abs().topk(123, dim=1, sorted=False).indices.sort(dim=1).values.numpy()
    assert np.array_equal(top_positions(x.view(-1, CHUNK).numpy(), 123), before)
