"""θ kept in its version file, not in memory (store/theta.py, issue #25): the versions a block publishes so
are bit for bit those of the in-memory path, its files byte for byte, across lossy codecs, momentum, the
robust screen and a restart; a version pruned while a reader holds it stays readable."""

import pytest
import torch

from btnode.aggregate.sums.averaging import OuterConfig
from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.relay.forward import RelayBlock
from btnode.aggregate.round.rounds import RoundConfig
from btnode.codec.codecs import Codec, decode
from btnode.errors import MalformedInput
from btnode.protocol import Outcome, PushHeader
from btnode.store import files
from btnode.store.files import Streamed, state_sha256
from btnode.store.theta import FileTheta
from btnode.store.versions import VersionStore, stem

INIT = {"w": torch.randn(6, 5), "b": torch.randn(9), "a.first": torch.randn(3, 2)}  # not in sorted order
CLAIMS = ClaimConfig(batch=1, lr=1.0, steps_per_round=4, enforce=True)


def make(folder, in_file, **kw):
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=10.0), claims=CLAIMS,
                            theta_in_file_bytes=0 if in_file else 1 << 30, **kw)
    return BlockAggregator(0, INIT, VersionStore(folder, 0, keep=acfg.keep), acfg, clock=lambda: 1000.0)


def header(worker, base, uid=None):
    return PushHeader(worker_id=worker, block=0, base_version=base, samples=2.0, loss=1.0, codec=Codec.FP32,
                      update_id=uid or f"{worker}-{base}", steps=(0, 1))


def delta(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: 0.3 * torch.randn(t.shape, generator=g) for n, t in INIT.items()}


def rounds(agg, first, count, workers=("x", "y", "z")):
    for w in workers:
        agg.register(w)
    for v in range(first, first + count):
        for k, w in enumerate(workers):
            assert agg.submit(header(w, v), delta(100 * v + k)).outcome is Outcome.PENDING
        assert agg.info.version == v + 1


def model_file(folder, version):
    return (folder / "block-0" / files.file_name(stem(version), "model")).read_bytes()


@pytest.mark.parametrize("kw", [
    {},
    {"publish_codec": Codec.INT8, "outer": OuterConfig(lr=0.7, momentum=0.9)},
    {"publish_codec": Codec.SPARSE8, "outer": OuterConfig(robust="mean")},
    {"outer": OuterConfig(robust="median")},
], ids=["fp32-screened", "int8-momentum", "sparse8-mean", "median"])
def test_versions_made_from_the_file_are_bit_identical_to_the_in_memory_ones(tmp_path, kw):
    held, filed = make(tmp_path / "held", False, **kw), make(tmp_path / "filed", True, **kw)
    assert isinstance(filed.current()[1], FileTheta) and isinstance(held.current()[1], dict)
    for agg in (held, filed):
        rounds(agg, 0, 3)
    for v in (2, 3):
        assert model_file(tmp_path / "held", v) == model_file(tmp_path / "filed", v)
    info, theta = filed.current()
    assert info == held.info and info.sha256 == state_sha256(theta)
    assert all(torch.equal(theta[n], held.params[n]) for n in INIT)
    assert held.store.delta(3)[1] == filed.store.delta(3)[1]


def test_a_restart_reads_theta_from_the_file_and_continues_identically(tmp_path):
    kw = {"publish_codec": Codec.INT8, "outer": OuterConfig(lr=0.7, momentum=0.9)}
    held, filed = make(tmp_path / "held", False, **kw), make(tmp_path / "filed", True, **kw)
    for agg in (held, filed):
        rounds(agg, 0, 2)
    held, again = make(tmp_path / "held", False, **kw), make(tmp_path / "filed", True, **kw)
    assert isinstance(again.current()[1], FileTheta) and again.info == held.info
    for agg in (held, again):
        rounds(agg, 2, 2)
    # (not the files' bytes: a restart lays its files out in safetensors' load order, which is not fixed)
    assert again.info == held.info and all(torch.equal(again.params[n], held.params[n]) for n in INIT)


def test_the_claims_check_reads_theta_from_the_file(tmp_path):
    """The bound of a coordinate grows with |θ| (aggregate/trust/claims.py): read from the file, it is the same."""
    filed = make(tmp_path, True)
    filed.register("x")
    theta = filed.current()[1]
    big = {n: torch.full_like(t, 50.0) for n, t in INIT.items()}  # over what 2 steps at lr 1 can move any value
    with pytest.raises(MalformedInput, match="AdamW steps") as refused:
        filed.submit(header("x", 0), big)
    assert refused.value.reason == "bound"
    assert filed.info.version == 0 and all(torch.equal(theta[n], INIT[n]) for n in INIT)


def test_a_version_pruned_while_read_stays_readable(tmp_path):
    filed = make(tmp_path, True, keep=1)
    info, theta = filed.current()  # what a Pull or an audit's base holds
    rounds(filed, 0, 2)
    assert filed.store.versions() == [2]
    assert state_sha256(theta) == info.sha256 and all(torch.equal(theta[n], INIT[n]) for n in INIT)


def test_a_streamed_group_that_does_not_fit_its_layout_writes_nothing(tmp_path):
    shapes = {n: tuple(t.shape) for n, t in INIT.items()}
    wrong = Streamed(shapes, lambda: iter([("w", INIT["w"]), ("b", torch.zeros(8))]))
    with pytest.raises(ValueError, match="does not fit"):
        files.save(tmp_path, "v1", tensors=wrong, meta={})
    short = Streamed(shapes, lambda: iter([("w", INIT["w"])]))
    with pytest.raises(ValueError, match="ended before"):
        files.save(tmp_path, "v1", tensors=short, meta={})
    assert not any(p.name.endswith(".json") or p.name == "v1.safetensors" for p in tmp_path.iterdir())
    files.save(tmp_path, "v1", tensors=Streamed(shapes, INIT.items), meta={})
    assert (tmp_path / "v1.safetensors").read_bytes() == _in_memory_bytes(tmp_path)


def _in_memory_bytes(tmp_path):
    files.save(tmp_path / "ref", "v1", tensors=dict(INIT), meta={})
    return (tmp_path / "ref" / "v1.safetensors").read_bytes()


def test_a_relay_adopts_versions_into_its_file_and_builds_the_next_on_it(tmp_path):
    """As node/relay.py's _fetch: the parent's delta added to the relay's θ (read from its file), adopted,
    and then θ is the adopted version's file."""
    root, relay = make(tmp_path / "root", True), RelayBlock(0, INIT, VersionStore(tmp_path / "relay", 0),
                                                            AggregatorConfig(claims=CLAIMS, theta_in_file_bytes=0))
    for v in (0, 1):
        rounds(root, v, 1)
        info = root.info
        codec, raw, _ = root.store.delta(info.version)
        have = relay.current()[1]
        new = {n: have[n] + decode(codec, raw[n], INIT[n].shape) for n in have}
        relay.adopt(info, new, raw=raw, codec=codec)
        got = relay.current()
        assert isinstance(got[1], FileTheta) and got[0] == info and state_sha256(got[1]) == info.sha256


def test_a_restart_checks_the_model_file_a_tensor_at_a_time_and_skips_a_corrupted_one(tmp_path):
    filed = make(tmp_path, True)
    rounds(filed, 0, 2)
    newest = tmp_path / "block-0" / files.file_name(stem(2), "model")
    blob = bytearray(newest.read_bytes())
    blob[-5] ^= 0xFF  # a flipped bit in θ's last tensor: same size, another hash
    newest.write_bytes(bytes(blob))
    again = make(tmp_path, True)
    assert again.info.version == 1 and isinstance(again.params, FileTheta)
    assert state_sha256(again.params) == again.info.sha256 and again.spec == filed.spec


def test_theta_read_at_positions_from_the_file_is_theta_there(tmp_path):
    """FileTheta.gather (a sparse push's claims check) reads the values a whole read has at those positions."""
    filed = make(tmp_path, True)
    theta = filed.current()[1]
    assert isinstance(theta, FileTheta)
    for n, t in INIT.items():
        where = torch.randperm(t.numel())[: max(1, t.numel() // 3)].sort().values
        assert torch.equal(theta.gather(n, where), t.reshape(-1)[where])
        assert theta.gather(n, torch.zeros(0, dtype=torch.int64)).numel() == 0
