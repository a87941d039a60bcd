"""Sparse low-bit codecs (issue #24): chunked top-k with Rice-coded positions and 8- or 2-bit values.

A tensor is cut into chunks of CHUNK = 4,096 values (the last may be shorter). Each chunk keeps its
k_c largest-magnitude values, k_c = ⌈keep · len_c / CHUNK⌉ (so a short chunk keeps the same share;
a tie at the k_c-th magnitude goes to the lower position), and sends where they are and what they are:

  positions  sorted within the chunk and sent as gaps (g = i_j − i_{j−1} − 1 ≥ 0), each Rice-coded
             with parameter r = ⌊log2(0.69 · len_c / k_c)⌋: the low r bits as they are, the rest in
             unary. Gaps of a uniform draw are near-geometric, for which this is within a few % of
             the entropy: about 7.6 bits a position at 1.6 % density, against 12 for packed 12-bit
             indices (SparseLoCo). Duplicate or unordered positions cannot be written at all;
             out-of-range ones (past the chunk) are refused on decode.
  values     SPARSE8: int8 in [−127, 127] times one fp32 absmax scale per chunk.
             SPARSE2: 2-bit codes (sign × above/below the chunk's median kept magnitude), decoded
             through a per-chunk table of the four bins' means (fp16), as SparseLoCo's bin-mean table.

Raw layout (little-endian; bit streams packed least-significant bit first):

  keep        u16, 1 … CHUNK: values kept per full chunk (the header the counts must agree with)
  scales      SPARSE8: n_chunks × f32      SPARSE2: n_chunks × 4 × f16 (bin means, codes 0..3)
  values      SPARSE8: K × i8              SPARSE2: ⌈2K / 8⌉ bytes of 2-bit codes
  remainders  ⌈Σ r_c·k_c / 8⌉ bytes: the low bits of every gap, chunk by chunk
  unary       the rest: for every gap, q = g >> r ones and a zero; padded with ones to a byte

K = Σ k_c follows from (numel, keep), so every section but the last has a known size, and the
last must hold exactly K zeros and at most 7 bits of padding, all ones. Anything else is a
MalformedInput. `decode_sparse` gives the (positions, values) pairs, which is how the aggregator
sums updates without making them dense (aggregate/sums/accumulate.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from btnode.errors import MalformedInput

CHUNK = 4096  # values per chunk
HEADER = 2  # the u16 keep
TABLE = 4  # SPARSE2 codes
EF_DECAY = 0.95  # error feedback of a sparse codec: e ← β·e + Δ (SparseLoCo's β), so that a residual is bounded


@dataclass(frozen=True)
class Layout:
    """Where the kept values of a tensor of `numel` values at `keep` lie: one row per group of
    chunks that share a length (the full chunks, then a shorter last one)."""

    numel: int
    keep: int
    groups: tuple[tuple[int, int, int, int], ...]  # (chunks, chunk length, kept per chunk, Rice r)

    @classmethod
    def of(cls, numel: int, keep: int) -> Layout:
        if not 1 <= keep <= CHUNK:
            raise MalformedInput("layout", f"a sparse frame keeps 1…{CHUNK} values per chunk, not {keep}")
        groups = []
        full, tail = divmod(numel, CHUNK)
        for chunks, length in ((full, CHUNK), (1 if tail else 0, tail)):
            if chunks:
                k = min(length, -(-keep * length // CHUNK))
                groups.append((chunks, length, k, rice_parameter(length, k)))
        return cls(numel, keep, tuple(groups))

    @property
    def chunks(self) -> int:
        return sum(g[0] for g in self.groups)

    @property
    def kept(self) -> int:
        return sum(c * k for c, _, k, _ in self.groups)

    @property
    def remainder_bits(self) -> int:
        return sum(c * k * r for c, _, k, r in self.groups)

    def fixed_bytes(self, two_bit: bool) -> int:
        """Bytes before the unary section."""
        scales = self.chunks * (2 * TABLE if two_bit else 4)
        values = -(-2 * self.kept // 8) if two_bit else self.kept
        return HEADER + scales + values + -(-self.remainder_bits // 8)

    def max_unary_bits(self) -> int:
        """Σ over chunks of k_c + ⌊(len_c − k_c) / 2^r⌋ bounds the unary bits (the gaps of a chunk sum to
        at most len_c − k_c)."""
        return sum(c * (k + ((length - k) >> r)) for c, length, k, r in self.groups)


def rice_parameter(length: int, k: int) -> int:
    """Near-optimal Rice r for the gaps of k draws out of `length`: log2 of ln2 × the mean gap."""
    return max(0, int(math.floor(math.log2(max(1.0, 0.69 * length / k)))))


def keep_of(density: float) -> int:
    """Values kept per chunk for a density in (0, 1]."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    return max(1, min(CHUNK, round(density * CHUNK)))


def keep_in(raw: bytes) -> int:
    """The keep a sparse frame's raw bytes were written with (0 if too short to say)."""
    return int.from_bytes(raw[:HEADER], "little") if len(raw) >= HEADER else 0


def max_raw_size(numel: int) -> int:
    """A bound on the raw size at any keep, for a frame's first check (decode_sparse checks the exact
    range for the frame's keep): per chunk 8 bytes of scales, per value at most one byte, ⌈log2 len⌉
    ≤ 12 remainder bits and two unary bits."""
    return HEADER + 8 * -(-numel // CHUNK) + 3 * numel + 2


def _max_raw(layout: Layout, two_bit: bool) -> int:
    return layout.fixed_bytes(two_bit) + -(-layout.max_unary_bits() // 8)


# -- encoding ------------------------------------------------------------------------------------
def encode_sparse(flat: torch.Tensor, keep: int, two_bit: bool) -> bytes:
    """fp32 CPU vector → raw bytes of the layout above."""
    layout = Layout.of(flat.numel(), keep)
    parts_idx, parts_val, lo = [], [], 0
    for chunks, length, k, _ in layout.groups:
        rows = flat[lo:lo + chunks * length].view(chunks, length)
        lo += chunks * length
        idx = torch.from_numpy(top_positions(rows.numpy(), k))  # (chunks, k), sorted
        parts_idx.append(idx)
        parts_val.append(rows.gather(1, idx))
    scales, values = (_two_bit(parts_val) if two_bit else _eight_bit(parts_val))
    rem, unary = _rice(parts_idx, layout)
    return b"".join([keep.to_bytes(2, "little"), scales, values, rem, unary])


SAMPLE_STEP = 4  # top_positions: every 4th value of a chunk estimates its threshold


def top_positions(rows: np.ndarray, k: int) -> np.ndarray:
    """The positions of each row's k largest magnitudes, sorted (chunks, k): ties at the k-th go to the
    lower position, so the choice is one function of the values (what an audit's replay recomputes),
    whatever selection algorithm finds it. |x| is compared as its fp32 bit pattern (the same order for
    non-negative floats; NaN above Inf). Fast path (issue #40): a threshold from every SAMPLE_STEP-th
    value that leaves about 1.3·k candidates a row, and an exact selection among those only (a row whose
    threshold left fewer than k takes the exact selection over all its values). As fast as the data
    allows: a full top-k of 4,096-value rows was 70 % of an encode."""
    chunks, length = rows.shape
    bits = np.abs(rows).view(np.int32)
    tag = CHUNK - 1 - np.arange(length)  # in a key's low 12 bits: a lower position wins a tie
    if not chunks or not k:
        return np.zeros((chunks, k), np.int64)
    samples = -(-length // SAMPLE_STEP)
    ks = int(k * 1.3 / SAMPLE_STEP) + 6
    if ks >= samples or 4 * k >= length:  # few values or a dense keep: the exact selection over all
        return _top_of(bits.astype(np.int64) << 12 | tag, k)
    tau = np.partition(bits[:, ::SAMPLE_STEP], samples - ks, axis=1)[:, samples - ks]
    mask = bits >= tau[:, None]
    counts = np.count_nonzero(mask, axis=1)
    short = counts < k
    if short.any():
        mask[short], counts[short] = False, 0
    width = max(int(counts.max()), k)
    flat = np.flatnonzero(mask)
    row = flat // length
    col = flat - row * length
    starts = np.cumsum(counts) - counts
    keys = np.full((chunks, width), -1, np.int64)  # (no real key is negative)
    keys.reshape(-1)[row * width + np.arange(flat.size) - starts[row]] = bits.reshape(-1)[flat].astype(np.int64) << 12 | tag[col]
    top = _top_of(keys, k)
    if short.any():
        top[short] = _top_of(bits[short].astype(np.int64) << 12 | tag, k)
    return top


def _top_of(keys: np.ndarray, k: int) -> np.ndarray:
    """Sorted positions of each row's k largest keys (|x| bits << 12 | CHUNK − 1 − position: all distinct)."""
    width = keys.shape[1]
    top = np.partition(keys, width - k, axis=1)[:, width - k:]
    out = CHUNK - 1 - (top & (CHUNK - 1))
    out.sort(axis=1)
    return out


def _eight_bit(parts: list[torch.Tensor]) -> tuple[bytes, bytes]:
    scales, codes = [], []
    for v in parts:
        s = v.abs().amax(dim=1, keepdim=True) / 127.0
        safe = torch.where(s > 0, s, torch.ones_like(s))
        codes.append(torch.round(v / safe).clamp_(-127, 127).to(torch.int8).reshape(-1))
        scales.append(s.reshape(-1))
    return _cat(scales, torch.float32), _cat(codes, torch.int8)


def _two_bit(parts: list[torch.Tensor]) -> tuple[bytes, bytes]:
    tables, codes = [], []
    for v in parts:
        mag = v.abs()
        mid = mag.median(dim=1, keepdim=True).values
        code = (v > 0).long() * 2 + (mag > mid).long()  # 0: −small, 1: −large, 2: +small, 3: +large
        sums = torch.zeros(v.shape[0], TABLE, dtype=torch.float64).scatter_add_(1, code, v.double())
        counts = torch.zeros(v.shape[0], TABLE, dtype=torch.float64).scatter_add_(1, code, torch.ones_like(v, dtype=torch.float64))
        means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
        tables.append(means.clamp(-65504, 65504).to(torch.float16).reshape(-1))
        codes.append(code.reshape(-1))
    code = np.frombuffer(_cat(codes, torch.uint8), np.uint8)
    packed = np.packbits(np.unpackbits(code[:, None], axis=1, bitorder="little")[:, :2].reshape(-1), bitorder="little")
    return _cat(tables, torch.float16), packed.tobytes()


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> bytes:
    return torch.cat(parts).to(dtype).numpy().tobytes() if parts else b""


def _rice(parts: list[torch.Tensor], layout: Layout) -> tuple[bytes, bytes]:
    rem_bits, q_all = [], []
    for idx, (_, _, _, r) in zip(parts, layout.groups):
        gaps = torch.diff(idx, dim=1, prepend=torch.full((idx.shape[0], 1), -1)) - 1
        g = gaps.reshape(-1).numpy().astype(np.int64)
        if r:
            rem_bits.append(((g[:, None] >> np.arange(r)) & 1).astype(np.uint8).reshape(-1))
        q_all.append(g >> r)
    rem = np.packbits(np.concatenate(rem_bits), bitorder="little").tobytes() if rem_bits else b""
    q = np.concatenate(q_all) if q_all else np.zeros(0, np.int64)
    # unary: q ones then a zero, for every gap; the zero of gap j sits at bit (Σ_{i≤j} q_i) + j
    total = int(q.sum()) + q.size
    bits = np.ones(-(-total // 8) * 8, np.uint8)
    bits[np.cumsum(q) + np.arange(q.size)] = 0
    return rem, np.packbits(bits, bitorder="little").tobytes()


# -- decoding ------------------------------------------------------------------------------------
def decode_sparse(raw: bytes, numel: int, two_bit: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw bytes → (flat positions int64, fp32 values), positions strictly increasing; MalformedInput
    for anything that does not fit the layout."""
    name = "SPARSE2" if two_bit else "SPARSE8"
    if len(raw) < HEADER:
        raise MalformedInput("size", f"{name} data shorter than its header")
    layout = Layout.of(numel, int.from_bytes(raw[:HEADER], "little"))
    fixed = layout.fixed_bytes(two_bit)
    if not fixed <= len(raw) <= _max_raw(layout, two_bit):
        raise MalformedInput("size", f"{name} data of {len(raw)} bytes does not fit {numel} values at keep "
                             f"{layout.keep} ({fixed}…{_max_raw(layout, two_bit)} bytes)")
    buf = np.frombuffer(raw, np.uint8)
    at = HEADER
    n_chunks, kept = layout.chunks, layout.kept
    if two_bit:
        table = np.frombuffer(raw, np.float16, count=n_chunks * TABLE, offset=at).astype(np.float32)
        if not np.all(np.isfinite(table)):  # an unused bin too: an honest encoder writes only finite means
            raise MalformedInput("nonfinite", f"{name} bin-mean tables must be finite")
        at += n_chunks * 2 * TABLE
        nbytes = -(-2 * kept // 8)
        bits = np.unpackbits(buf[at:at + nbytes], bitorder="little")
        if bits[2 * kept:].any():  # else one tensor would have several encodings (and sha256s)
            raise MalformedInput("size", f"{name} values: padding after the 2-bit codes is not zero")
        codes = bits.reshape(-1, 2)[:kept]
        at += nbytes
        code = codes[:, 0].astype(np.int64) + 2 * codes[:, 1]
        chunk_of = _chunk_of(layout)
        values = table.reshape(n_chunks, TABLE)[chunk_of, code]
    else:
        scale = np.frombuffer(raw, np.float32, count=n_chunks, offset=at)
        at += 4 * n_chunks
        q = np.frombuffer(raw, np.int8, count=kept, offset=at)
        at += kept
        if kept and int(q.min()) < -127:
            raise MalformedInput("range", f"{name} value −128 is outside the codec's ±127")
        if not np.all(np.isfinite(scale)) or (scale.size and float(scale.min()) < 0):
            raise MalformedInput("nonfinite", f"{name} chunk scales must be finite and ≥ 0")
        with np.errstate(over="ignore"):  # a huge scale × 127 overflows to Inf: refused below, no warning
            values = q.astype(np.float32) * scale[_chunk_of(layout)]
    nrem = -(-layout.remainder_bits // 8)
    rem = buf[at:at + nrem]
    if nrem and int(rem[-1]) >> (layout.remainder_bits - 8 * (nrem - 1)) & 0xFF:  # the last byte's bits after the last
        raise MalformedInput("size", f"{name} positions: padding after the remainders is not zero")
    at += nrem
    q = _unary(np.unpackbits(buf[at:], bitorder="little"), kept, name)
    positions = _positions(layout, rem, q, name)
    if not np.all(np.isfinite(values)):
        raise MalformedInput("nonfinite", f"{name} values contain NaN or Inf")
    return torch.from_numpy(positions), torch.from_numpy(np.ascontiguousarray(values, np.float32))


def _chunk_of(layout: Layout) -> np.ndarray:
    """The chunk number of every kept value, in order."""
    return np.repeat(np.arange(layout.chunks), np.concatenate([np.full(c, k) for c, _, k, _ in layout.groups])
                     if layout.groups else np.zeros(0, np.int64))


def _unary(bits: np.ndarray, kept: int, name: str) -> np.ndarray:
    zeros = np.flatnonzero(bits == 0)
    if zeros.size != kept:
        raise MalformedInput("count", f"{name} positions: {zeros.size} gaps coded, the header's keep needs {kept}")
    end = int(zeros[-1]) + 1 if kept else 0
    if bits.size - end >= 8:
        raise MalformedInput("size", f"{name} positions: {bits.size - end} bits after the last gap")
    return np.diff(zeros, prepend=-1) - 1


def _low_bits(rem: np.ndarray, at_bit: int, n: int, r: int) -> np.ndarray:
    """n values of r bits each from the bit stream `rem` (bytes, least-significant bit first) at bit `at_bit`."""
    if 8 % r == 0 and at_bit % 8 == 0:  # whole values in whole bytes: shifted and masked in place, no bit array
        per = 8 // r
        part = rem[at_bit // 8:at_bit // 8 + -(-n // per)]
        return ((part[:, None] >> np.arange(0, 8, r, dtype=np.uint8)) & ((1 << r) - 1)).reshape(-1)[:n]
    lo = at_bit // 8
    bits = np.unpackbits(rem[lo:lo + -(-(at_bit % 8 + n * r) // 8)], bitorder="little")[at_bit % 8:at_bit % 8 + n * r]
    return bits.reshape(n, r) @ (1 << np.arange(r))


def _positions(layout: Layout, rem: np.ndarray, q: np.ndarray, name: str) -> np.ndarray:
    out, at_bit, at_q, base = [], 0, 0, 0
    for chunks, length, k, r in layout.groups:
        n = chunks * k
        gaps = q[at_q:at_q + n].astype(np.int64) << r
        if r:
            gaps |= _low_bits(rem, at_bit, n, r)
        at_bit += n * r
        at_q += n
        within = np.cumsum(gaps.reshape(chunks, k) + 1, axis=1) - 1  # (chunks, k), strictly increasing
        if k and int(within[:, -1].max()) >= length:
            raise MalformedInput("range", f"{name} position past the end of its {length}-value chunk")
        out.append((within + base + length * np.arange(chunks)[:, None]).reshape(-1))
        base += chunks * length
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def densify(positions: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    # numpy's zeros come from calloc, zero pages the kernel maps as they are written: 5× faster than torch.zeros
    # (a memset of fresh memory) at a large block, where making the dense tensor was most of a decode
    flat = np.zeros(numel, np.float32)
    flat[positions.numpy()] = values.numpy()
    return torch.from_numpy(flat)


@dataclass(frozen=True)
class SparseTensor:
    """A decoded sparse frame as it came: flat positions (strictly increasing) and their values. What
    the aggregator holds of a sparse update: 12 bytes a kept value instead of 4 bytes a parameter."""

    shape: tuple[int, ...]
    positions: torch.Tensor  # int64
    values: torch.Tensor  # fp32

    @classmethod
    def decode(cls, raw: bytes, shape: tuple[int, ...], two_bit: bool) -> SparseTensor:
        positions, values = decode_sparse(raw, math.prod(shape), two_bit)
        return cls(tuple(shape), positions, values)

    def dense(self) -> torch.Tensor:
        return densify(self.positions, self.values, math.prod(self.shape)).reshape(self.shape)

    def scaled(self, factor: float) -> SparseTensor:
        return SparseTensor(self.shape, self.positions, self.values * factor)
