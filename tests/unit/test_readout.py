"""Readouts as a type: the enum is the CLI's strings and the wire's btnode.v2.Readout, one default serves
the library, the CLI and the wire, every readout has its reader, and a generation request is checked and
defaulted in one place."""

import dataclasses
import inspect

import pytest
import torch

from btnode.errors import InputError, MalformedInput
from btnode.evaluation.metrics import sampler_ce
from btnode.model.noise import default_steps
from btnode.model.readout import DEFAULT_READOUT, SWEEP_READOUTS, Readout, default_readout
from btnode.model.sampler import sweep
from btnode.rpc.stages import _segment_from_pb, _segment_to_pb, request_from_pb, request_to_pb, tensor_to_pb
from btnode.serve.readouts import READERS, Carry
from btnode.serve.request import GenerationRequest
from btnode.serve.stages import SegmentState, initial_state
from btnode.v2 import serve_pb2 as pb


def test_readouts_are_the_wire_strings_and_parse_with_a_typed_error():
    assert [r.value for r in Readout] == ["pool", "last", "commit", "spec", "spec-fill"]
    assert Readout.parse("spec-fill") is Readout.SPEC_FILL and Readout.POOL == "pool"
    with pytest.raises(InputError, match=r"readout must be one of \['pool', 'last', 'commit', 'spec', 'spec-fill'\]"):
        Readout.parse("mean")
    assert {r for r in Readout if r.drafts} == {Readout.SPEC, Readout.SPEC_FILL}
    assert {r for r in Readout if r.pools} == {Readout.POOL, Readout.SPEC, Readout.SPEC_FILL}
    assert set(READERS) == set(Readout)  # every readout has its reader


def test_one_default_for_the_library_and_the_cli():
    from btnode_cli.evaluate import evaluate

    assert default_readout(0) is DEFAULT_READOUT is Readout.POOL and default_readout(4) is Readout.LAST
    assert DEFAULT_READOUT in SWEEP_READOUTS
    defaults = [inspect.signature(f).parameters["readout"].default for f in (sweep, sampler_ce, evaluate)]
    assert defaults == [DEFAULT_READOUT, DEFAULT_READOUT, DEFAULT_READOUT.value]


def test_a_request_fills_its_defaults_and_is_checked_once(tiny_cfg):
    r = GenerationRequest(b"hi", 8, readout="commit")
    assert r.readout is Readout.COMMIT
    full = GenerationRequest(b"hi", 8).checked(tiny_cfg, 3)  # the serving default: spec, K = min(16, N/8)
    assert (full.k, full.n_steps, full.readout) == (4, default_steps(tiny_cfg), Readout.SPEC)
    assert GenerationRequest(b"hi", 8, k=8, n_tail=0).checked(tiny_cfg, 3).readout is Readout.SPEC
    tailed = dataclasses.replace(tiny_cfg, tail_blocks=1)
    assert GenerationRequest(b"hi", 8, n_tail=4).checked(tailed, 3).readout is Readout.LAST
    swept = GenerationRequest(b"hi", 8, readout="pool").checked(tiny_cfg, 3)  # a sweep keeps a trained K
    assert (swept.k, swept.readout) == (16, Readout.POOL)
    assert GenerationRequest(b"hi", 8).checked(tiny_cfg) == GenerationRequest(b"hi", 8)  # the AR chain fills nothing
    for bad, match in ((dict(n_bytes=0), "asked for 0 bytes"), (dict(k=4, readout="pool"), "K=4 was not trained"),
                       (dict(request_id="r" * 129), "request id of 129"), (dict(prompt=b"x" * 26, k=8), "at most 25")):
        with pytest.raises(InputError, match=match):
            dataclasses.replace(GenerationRequest(b"hi", 8), **bad).checked(tiny_cfg, 3)
    for bad, match in ((dict(draft_len=16), "G=16 is out of range"), (dict(temperature=-1.0), "temperature"),
                       (dict(prompt=b"x" * 33), "the context is 32 bytes")):
        with pytest.raises(InputError, match=match):
            dataclasses.replace(GenerationRequest(b"hi", 8), **bad).checked(tiny_cfg)
    with pytest.raises(InputError, match="readout must be one of"):
        GenerationRequest(b"hi", 8, readout="avg")


def test_the_wire_keeps_its_zero_values_and_an_unspecified_readout_is_the_librarys_default():
    r = GenerationRequest(b"p", 5, seed=3, temperature=0.5, readout=Readout.SPEC, n_tail=0, draft_len=0)
    m = request_to_pb(r)
    assert (m.k, m.n_steps, m.readout, m.no_cache) == (0, 0, pb.READOUT_SPEC, False)
    assert request_from_pb(m) == r
    assert request_to_pb(GenerationRequest(b"p", 5)).readout == pb.READOUT_UNSPECIFIED  # the entry applies the default
    assert request_from_pb(pb.GenerateRequest(prompt=b"p", n_bytes=5)).readout is None
    z = torch.zeros(8, 4)
    for n_tail in (0, 4):  # no readout set: default_readout(n_tail), pool (last through the tail), as the library's
        unset = pb.SegmentRequest(request_id="r", context=b"hi", k=8, n_steps=7, z=tensor_to_pb(z), n_tail=n_tail)
        assert _segment_from_pb(unset).readout is default_readout(n_tail)
    with pytest.raises(MalformedInput, match="unknown btnode.v2.Readout value 99"):
        _segment_from_pb(pb.SegmentRequest(request_id="r", context=b"hi", k=8, n_steps=7, z=tensor_to_pb(z), readout=99))
    lp = torch.full((8, 256), -1.0)
    s = SegmentState(request_id="r", context=b"hi", segment=1, k=8, n_steps=7, seed=0, temperature=1.0, z=z,
                     readout=Readout.SPEC, carry=Carry(pool=lp, draft=bytes(8), draft_logp=lp))
    wire = _segment_to_pb(s)
    assert wire.readout == pb.READOUT_SPEC and wire.draft == bytes(8)
    back = _segment_from_pb(pb.SegmentRequest.FromString(wire.SerializeToString()))
    assert back.readout is Readout.SPEC and back.carry.draft == bytes(8)
    assert torch.equal(back.carry.pool, lp) and torch.equal(back.carry.draft_logp, lp)


def test_a_drafts_segment_leaves_out_its_state_and_a_first_hop_pool_and_decodes_to_the_same(tiny_cfg):
    """Readout spec: z is never swept, so it is not sent (the receiver makes the same bits from the seed);
    on the first hop the pool equals the draft's log-probs and is not sent either. A later hop's pool,
    and a sweep's z, are."""
    k, v = 8, tiny_cfg.vocab
    z = initial_state(tiny_cfg, 5, 3, k, 7)
    q = torch.log_softmax(torch.randn(k, v, generator=torch.Generator().manual_seed(1)), -1)
    first_hop = SegmentState(request_id="r", context=b"hi", segment=3, k=k, n_steps=7, seed=5, temperature=1.0, z=z,
                             readout=Readout.SPEC, carry=Carry(pool=q, draft=bytes(range(k)), draft_logp=q))
    later = dataclasses.replace(first_hop, carry=Carry(pool=q + q, draft=bytes(range(k)), draft_logp=q))
    swept = dataclasses.replace(first_hop, readout=Readout.POOL, carry=Carry(pool=q))
    for s, sent in ((first_hop, {"draft_logp"}), (later, {"draft_logp", "pool"}), (swept, {"z", "pool"})):
        wire = pb.SegmentRequest.FromString(_segment_to_pb(s).SerializeToString())
        assert {f for f in ("z", "pool", "draft_logp") if wire.HasField(f)} == sent
        back = _segment_from_pb(wire, tiny_cfg)
        assert torch.equal(back.z, s.z) and back.carry.draft == s.carry.draft
        assert torch.equal(back.carry.pool, s.carry.pool)
        assert (back.carry.draft_logp is None) == (s.carry.draft_logp is None)
    assert _segment_to_pb(first_hop).ByteSize() < _segment_to_pb(later).ByteSize() / 1.5
    # a hostile K cannot make the receiver build a state: z stays absent and the stage refuses the shape
    huge = _segment_to_pb(dataclasses.replace(first_hop, k=10**9))
    assert _segment_from_pb(huge, tiny_cfg).z.numel() == 0
