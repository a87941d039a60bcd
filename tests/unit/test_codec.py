import pytest
import torch

from btnode.codec.codecs import GROUP, Codec, decode, encode, parse, raw_size
from btnode.errors import MalformedInput


@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000, 4096])
def test_fp32_is_lossless_and_sizes_match(n):
    x = torch.randn(n) * 0.01
    for c in Codec:
        raw = encode(c, x)
        assert len(raw) <= raw_size(c, n) if c.sparse else len(raw) == raw_size(c, n)  # sparse: a bound
    assert torch.equal(decode(Codec.FP32, encode(Codec.FP32, x), (n,)), x)


def test_bf16_and_int8_errors_are_small():
    torch.manual_seed(0)
    x = torch.randn(64, 1000) * 1e-3
    rel = lambda y: float((y - x).norm() / x.norm())  # noqa: E731
    assert rel(decode(Codec.BF16, encode(Codec.BF16, x), x.shape)) < 0.004
    err = rel(decode(Codec.INT8, encode(Codec.INT8, x), x.shape))
    assert 0.001 < err < 0.02  # ≈1% relative error, and not lossless
    assert raw_size(Codec.FP32, x.numel()) / raw_size(Codec.INT8, x.numel()) > 3.9


def test_int8_scales_per_group_of_256():
    x = torch.zeros(2 * GROUP)
    x[0], x[GROUP] = 1.0, 1000.0  # a large value in group 1 must not crush group 0
    x[1] = 0.5
    y = decode(Codec.INT8, encode(Codec.INT8, x), x.shape)
    assert y[1].item() == pytest.approx(0.5, rel=0.01) and y[GROUP].item() == pytest.approx(1000.0)


def test_zero_tensor_and_wrong_sizes():
    z = torch.zeros(300)
    assert torch.equal(decode(Codec.INT8, encode(Codec.INT8, z), (300,)), z)
    with pytest.raises(MalformedInput, match="must be 1200 bytes"):
        decode(Codec.FP32, b"\0" * 1199, (300,))


def test_parse():
    assert parse("int8") is Codec.INT8
    with pytest.raises(ValueError, match="unknown codec 'fp8'"):
        parse("fp8")


@pytest.mark.parametrize("codec", [Codec.FP32, Codec.INT8])
@pytest.mark.parametrize("n", [1, GROUP, 3 * GROUP + 7])
def test_decoding_into_a_buffer_gives_the_same_bits(codec, n):
    """decode(out=...) (a lazy update's reads, codec/frames.LazyDelta.each) writes the values decode returns."""
    raw = encode(codec, torch.randn(n) * 3)
    buf = torch.full((n + 5,), float("nan"))
    got = decode(codec, raw, (n,), out=buf)
    assert torch.equal(got, decode(codec, raw, (n,))) and got.data_ptr() == buf.data_ptr()
