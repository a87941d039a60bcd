"""Relay audits (aggregate/trust/evidence.py): a relay's kept round recombines, from the evidence it
serves, to its combined push bit for bit; any change to the pushed values, a child's frames, a
weight or the list of children fails the check."""

import hashlib
from dataclasses import replace

import pytest
import torch

from btnode.aggregate.sums.averaging import OuterConfig
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.evidence import RelayAuditConfig, RelayAudits, RelayAuditJob, check_evidence, frames_digest
from btnode.aggregate.relay.forward import RelayBlock
from btnode.aggregate.relay.roundlog import Receipt
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec, decode, encode
from btnode.codec.frames import Frame, iter_chunks
from btnode.errors import InputError, MalformedInput
from btnode.model.config import ModelConfig
from btnode.protocol import EvidenceChild, ManifestEntry, Outcome, PushHeader, VersionInfo
from btnode.store.files import state_sha256
from btnode.store.versions import VersionStore

INIT = {"w": torch.randn(64, 96, generator=torch.Generator().manual_seed(1)), "b": torch.zeros(5000)}
SPEC = {n: tuple(t.shape) for n, t in INIT.items()}
CLAIMS = ClaimConfig(batch=1, lr=1.0, steps_per_round=4, enforce=True)
CHILDREN = {"c0": Codec.INT8, "c1": Codec.FP32, "c2": Codec.BF16}


def closed_round(tmp_path, *, clip: bool = False, robust: str = "mean"):
    """A relay block that took three children's updates (three codecs) and closed: (block, combined)."""
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=10.0), claims=CLAIMS, outer=OuterConfig(robust=robust),
                            clip=clip)
    block = RelayBlock(0, INIT, VersionStore(tmp_path, 0, keep=acfg.keep), acfg, clock=lambda: 1000.0,
                       sketch_key=b"k" * 32)
    out = []
    block.on_combined = out.append
    for w in CHILDREN:
        block.register(w)
    block._norms.extend([1.0, 1.0, 1.0])  # with --clip: a median norm every child is over
    for i, (w, codec) in enumerate(CHILDREN.items()):
        g = torch.Generator().manual_seed(10 + i)
        raw = {n: encode(codec, 0.01 * torch.randn(s, generator=g)) for n, s in SPEC.items()}
        delta = {n: decode(codec, raw[n], s) for n, s in SPEC.items()}
        head = PushHeader(worker_id=w, block=0, base_version=0, samples=float(1 + i), loss=1.0, codec=codec,
                          update_id=f"{w}-u", steps=tuple(range(1 + i)))
        block.digests[head.update_id] = frames_digest({n: hashlib.sha256(b).digest() for n, b in raw.items()})
        assert block.submit(head, delta, raw=raw).outcome is Outcome.ACCEPTED
    (combined,) = out  # all three reported: the round closed into one combined update
    return block, combined


def job_of(combined) -> RelayAuditJob:
    header = PushHeader(worker_id="r1", block=0, base_version=combined.base_version, samples=combined.weight, loss=1.0,
                        codec=Codec.FP32, update_id="push-1", manifest=combined.manifest)
    return RelayAuditJob(header=header, pushed={n: encode(Codec.FP32, t) for n, t in combined.delta.items()},
                         arrived=0.0)


def wire(parts) -> list:
    """The evidence as a parent receives it: children as they are, frames as chunks."""
    return [c for p in parts for c in (iter_chunks([p]) if isinstance(p, Frame) else [p])]


@pytest.mark.parametrize("clip", [False, True])
def test_an_honest_relays_evidence_recombines_to_its_push_bit_for_bit(tmp_path, clip):
    block, combined = closed_round(tmp_path, clip=clip)
    assert [e.worker_id for e in combined.manifest] == list(CHILDREN)
    parts = wire(block.evidence(combined))
    if clip:  # every child was over the median norm: each was scaled down, and the evidence says by how much
        assert all(p.scale < 1 for p in parts if isinstance(p, EvidenceChild))
    check_evidence(job_of(combined), block.unit, parts, SPEC)
    check_evidence(job_of(combined), block.unit, wire(block.evidence(combined)), SPEC)  # re-readable


def test_a_pushed_value_one_ulp_off_fails(tmp_path):
    block, combined = closed_round(tmp_path)
    w = combined.delta["w"].clone()
    w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(1.0))
    for forged in ({**combined.delta, "w": w}, {n: t * 1.01 for n, t in combined.delta.items()}):
        with pytest.raises(MalformedInput, match="not the mean of its children") as e:
            check_evidence(job_of(replace(combined, delta=forged)), block.unit,
                           wire(block.evidence(combined)), SPEC)
        assert e.value.reason == "evidence"


def test_evidence_that_is_not_the_childrens_frames_fails(tmp_path):
    block, combined = closed_round(tmp_path)
    job = job_of(combined)
    parts = list(block.evidence(combined))
    children = [i for i, p in enumerate(parts) if isinstance(p, EvidenceChild)]

    def fails(bad, match: str) -> None:
        with pytest.raises(MalformedInput, match=match) as e:
            check_evidence(job, block.unit, wire(bad), SPEC)
        assert e.value.reason in ("evidence", "nested"), e.value

    # another child's frames under c0's entry (a relay showing frames that are not what c0 sent)
    swapped = parts[:children[0] + 1] + parts[children[1] + 1:children[2]] + parts[children[1]:]
    fails(swapped, "not those its manifest entry names")
    fails(parts[:children[2]], "covers 2 of the manifest's 3")  # a child left out
    heavier = [replace(p, weight=p.weight * 2) if i == children[1] else p for i, p in enumerate(parts)]
    fails(heavier, "digest or weight")
    nested = [replace(p, entries=2) if i == children[0] else p for i, p in enumerate(parts)]
    fails(nested, "child relay")
    check_evidence(job, block.unit, wire(parts), SPEC)  # the untouched list passes
    with pytest.raises(MalformedInput, match="power of two"):
        check_evidence(job, 3.0, wire(parts), SPEC)


def test_evidence_of_a_round_not_kept_is_an_error(tmp_path):
    block, combined = closed_round(tmp_path)
    with pytest.raises(InputError, match="not kept"):
        block.evidence(replace(combined, base_version=5))


def test_draws_follow_the_rate_and_the_secret():
    ids = [f"u{i}" for i in range(2000)]
    a = RelayAudits(RelayAuditConfig(rate=0.1), b"s" * 32, clock=lambda: 0.0)
    b = RelayAudits(RelayAuditConfig(rate=0.1), b"t" * 32, clock=lambda: 0.0)
    drawn_a = {u for u in ids if a.drawn(u)}
    assert 140 <= len(drawn_a) <= 260  # ~200
    assert drawn_a != {u for u in ids if b.drawn(u)}  # another secret, other draws
    assert all(RelayAudits(RelayAuditConfig(rate=1.0), b"s" * 32, lambda: 0.0).drawn(u) for u in ids[:50])
    assert not any(RelayAudits(RelayAuditConfig(rate=0.0), b"s" * 32, lambda: 0.0).drawn(u) for u in ids[:50])


def test_a_relay_audit_without_evidence_in_time_revokes_the_relay_and_keeps_its_push_out(tmp_path):
    now = [0.0]
    cfg = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=3, context=32, segments=(1, 8))
    acfg = AggregatorConfig(relay_audit=RelayAuditConfig(rate=1.0, timeout_s=5.0))
    agg = SwarmAggregator(cfg, acfg, tmp_path, blocks=[0], clock=lambda: now[0], audit_secret=b"s" * 32)
    h = PushHeader(worker_id="r1", block=0, base_version=0, samples=1.0, loss=0.0, codec=Codec.FP32, update_id="x",
                   manifest=(ManifestEntry("w", "u", 0, 1.0, "00" * 32),))
    agg.relay_audits.open(h, {})
    now[0] = 4.0
    agg.expire_relay_audits()
    assert not agg.identities.is_revoked("r1")  # not yet late
    now[0] = 6.0
    agg.expire_relay_audits()
    assert agg.identities.is_revoked("r1") and agg.counters[("relay_audits", "timeout")] == 1
    assert agg.counters[("revoked", "relay_timeout")] == 1 and agg.relay_audits.waiting_for("x") is None
    with pytest.raises(MalformedInput, match="no relay audit waits"):
        agg.submit_evidence(h, 1.0, [])
    h2 = replace(h, update_id="y")  # another of its pushes (an amendment) failing too: one revocation
    agg.relay_audits.open(h2, {})
    now[0] = 12.0
    agg.expire_relay_audits()
    assert agg.counters[("relay_audits", "timeout")] == 2 and agg.counters[("revoked", "relay_timeout")] == 1


def test_evidence_outlives_the_next_version_and_the_next_rounds_spill(tmp_path):
    block, combined = closed_round(tmp_path)
    _, params = block.current()
    block.adopt(VersionInfo(block=0, version=1, base_version=0, sha256=state_sha256(params)), params, raw=None,
                codec=None)
    block.register("c9")  # the next round's spill takes new bytes under the same file name
    raw = {n: encode(Codec.FP32, torch.full(s, 0.02)) for n, s in SPEC.items()}
    head = PushHeader(worker_id="c9", block=0, base_version=1, samples=1.0, loss=1.0, codec=Codec.FP32,
                      update_id="c9-u", steps=(0,))
    assert block.submit(head, {n: decode(Codec.FP32, b, SPEC[n]) for n, b in raw.items()}, raw=raw).outcome is \
        Outcome.ACCEPTED
    check_evidence(job_of(combined), block.unit, wire(block.evidence(combined)), SPEC)  # round 0's, bit for bit


def test_a_relay_restarted_mid_round_keeps_its_childrens_receipts_and_evidence(tmp_path):
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=10.0), claims=CLAIMS, outer=OuterConfig(robust="mean"))

    def relay_block():
        b = RelayBlock(0, INIT, VersionStore(tmp_path, 0, keep=acfg.keep), acfg, clock=lambda: 1000.0,
                       sketch_key=b"k" * 32)
        out = []
        b.on_combined = out.append
        for w in CHILDREN:
            b.register(w)
        return b, out

    def pushed(block, i, w, codec):
        raw = {n: encode(codec, 0.01 * torch.randn(s, generator=torch.Generator().manual_seed(i))) for n, s in SPEC.items()}
        head = PushHeader(worker_id=w, block=0, base_version=0, samples=float(1 + i), loss=1.0, codec=codec,
                          update_id=f"{w}-u", steps=tuple(range(1 + i)))
        block.digests[head.update_id] = frames_digest({n: hashlib.sha256(b).digest() for n, b in raw.items()})
        block.receipts[head.update_id] = Receipt(head.samples, f"cert-{w}".encode(), f"sig-{w}".encode(), f"{i:02d}" * 32,
                                                 f"token-{w}".encode())  # as RelaySwarm.push
        return block.submit(head, {n: decode(codec, raw[n], s) for n, s in SPEC.items()}, raw=raw)

    block, _ = relay_block()
    for i, (w, codec) in enumerate(list(CHILDREN.items())[:2]):
        assert pushed(block, i, w, codec).outcome is Outcome.ACCEPTED
    del block  # killed mid-round
    again, out = relay_block()
    assert pushed(again, 2, "c2", Codec.BF16).outcome is Outcome.ACCEPTED
    (combined,) = out
    assert [(e.worker_id, e.samples, e.cert, e.signature, e.claim_sha256, e.token) for e in combined.manifest] == [
        (w, float(1 + i), f"cert-{w}".encode(), f"sig-{w}".encode(), f"{i:02d}" * 32, f"token-{w}".encode())
        for i, w in enumerate(CHILDREN)]
    check_evidence(job_of(combined), again.unit, wire(again.evidence(combined)), SPEC)  # bytes taken up too
