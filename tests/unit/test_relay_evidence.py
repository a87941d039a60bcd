"""Relay audits (aggregate/trust/evidence.py): a relay's kept round recombines, from the evidence it
serves, to its combined push bit for bit; any change to the pushed values, a child's frames, a
weight or the list of children fails the check."""

import json
from dataclasses import replace

import pytest
import torch

from btnode.aggregate.relay.forward import RelayBlock
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.service import SwarmAggregator, relay_swarm
from btnode.aggregate.sums.averaging import OuterConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.evidence import RelayAuditConfig, RelayAudits, RelayAuditJob, check_evidence
from btnode.codec.codecs import Codec, encode
from btnode.codec.frames import Frame, encode_frames, iter_chunks
from btnode.errors import InputError, MalformedInput
from btnode.model.config import ModelConfig
from btnode.protocol import (EMPTY_STATE, Drawn, EvidenceChild, JoinInfo, ManifestEntry, Outcome, PushHeader, VersionInfo,
                             WorkClaim, claim_digest)
from btnode.store.files import state_sha256

from procs import honest_terms

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1,))
CLAIMS = ClaimConfig(batch=1, lr=1.0, steps_per_round=4, enforce=True)
CHILDREN = {"c0": Codec.INT8, "c1": Codec.FP32, "c2": Codec.BF16}


class Parent:
    """The relay's parent, in process: it admits every join with one data key and, replaying audits,
    commits each child update the relay asks it to (a token per worker), drawing none."""

    def join(self, worker_id, block, fingerprint, config_json, data_id="", *, training_json="", relay=False,
             proof=None) -> JoinInfo:
        return JoinInfo(current=VersionInfo(block=block, version=0, base_version=0, sha256=""), deadline_s=10.0,
                        codecs=tuple(Codec), max_staleness=2, data_key="k0", audits=True)

    def leave(self, worker_id, block) -> None:
        pass

    def draw(self, header: PushHeader, digest: str, relay: str = "", *, refused: bool = False) -> Drawn:
        return Drawn(False, f"token-{header.worker_id}".encode())


def relay_of(tmp_path, *, clip: bool = False, robust: str = "mean") -> tuple[SwarmAggregator, RelayBlock]:
    """A relay (as node/relay.py builds one, under a parent that replays audits) whose children have
    joined through it: (relay, its block)."""
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=10.0), claims=CLAIMS, outer=OuterConfig(robust=robust),
                            clip=clip)
    relay = relay_swarm(CFG, acfg, tmp_path, upstream=Parent(), name="r1", blocks=[0], parent_replays=True,
                        clock=lambda: 1000.0)
    assert relay.upstream is not None
    block = relay.upstream.blocks[0]
    for w in CHILDREN:
        relay.join(w, 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(CLAIMS))
    return relay, block


def closed_into(relay: SwarmAggregator) -> list:
    """The combined updates the relay's rounds closed into, taken from its outbox (where node/relay.py
    pushes upstream from): the production sink, not a stand-in."""
    q, out = relay.upstream.outbox, []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def claim_of(worker: str) -> WorkClaim:
    return WorkClaim(base_sha256="ab" * 32, data_id="", recipe="{}", optimizer_start=EMPTY_STATE,
                     optimizer_end=f"end-{worker}", residual_start=EMPTY_STATE, residual_end=EMPTY_STATE)


def push(relay: SwarmAggregator, i: int, worker: str, codec: Codec, base_version: int = 0):
    """A child's push, through the relay's own Push path: its frames' digest, receipt and commit token
    noted on the way, as a child's push over gRPC is."""
    spec = relay.block(0).spec
    g = torch.Generator().manual_seed(10 + i)
    frames = encode_frames({n: 0.01 * torch.randn(s, generator=g) for n, s in spec.items()}, codec)
    head = PushHeader(worker_id=worker, block=0, base_version=base_version, samples=float(1 + i), loss=1.0,
                      codec=codec, update_id=f"{worker}-u{base_version}", steps=tuple(range(1 + i)),
                      claim=claim_of(worker), cert=f"cert-{worker}".encode(), signature=f"sig-{worker}".encode())
    return relay.push(head, iter_chunks(frames))


def closed_round(tmp_path, *, clip: bool = False, robust: str = "mean"):
    """A relay block that took three children's updates (three codecs) and closed: (block, combined)."""
    relay, block = relay_of(tmp_path, clip=clip, robust=robust)
    block._norms.extend([1.0, 1.0, 1.0])  # with --clip: a median norm every child is over
    for i, (w, codec) in enumerate(CHILDREN.items()):
        assert push(relay, i, w, codec).outcome is Outcome.PENDING
    (combined,) = closed_into(relay)  # all three reported: the round closed into one combined update
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
    check_evidence(job_of(combined), block.unit, parts, block.spec)
    check_evidence(job_of(combined), block.unit, wire(block.evidence(combined)), block.spec)  # re-readable


def test_a_pushed_value_one_ulp_off_fails(tmp_path):
    block, combined = closed_round(tmp_path)
    first = max(combined.delta, key=lambda n: combined.delta[n].numel())  # a tensor with an 8th value
    w = combined.delta[first].clone()
    w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(1.0))
    for forged in ({**combined.delta, first: w}, {n: t * 1.01 for n, t in combined.delta.items()}):
        with pytest.raises(MalformedInput, match="not the mean of its children") as e:
            check_evidence(job_of(replace(combined, delta=forged)), block.unit,
                           wire(block.evidence(combined)), block.spec)
        assert e.value.reason == "evidence"


def test_evidence_that_is_not_the_childrens_frames_fails(tmp_path):
    block, combined = closed_round(tmp_path)
    job = job_of(combined)
    parts = list(block.evidence(combined))
    children = [i for i, p in enumerate(parts) if isinstance(p, EvidenceChild)]

    def fails(bad, match: str) -> None:
        with pytest.raises(MalformedInput, match=match) as e:
            check_evidence(job, block.unit, wire(bad), block.spec)
        assert e.value.reason in ("evidence", "nested"), e.value

    # another child's frames under c0's entry (a relay showing frames that are not what c0 sent)
    swapped = parts[:children[0] + 1] + parts[children[1] + 1:children[2]] + parts[children[1]:]
    fails(swapped, "not those its manifest entry names")
    fails(parts[:children[2]], "covers 2 of the manifest's 3")  # a child left out
    heavier = [replace(p, weight=p.weight * 2) if i == children[1] else p for i, p in enumerate(parts)]
    fails(heavier, "digest or weight")
    nested = [replace(p, entries=2) if i == children[0] else p for i, p in enumerate(parts)]
    fails(nested, "child relay")
    check_evidence(job, block.unit, wire(parts), block.spec)  # the untouched list passes
    with pytest.raises(MalformedInput, match="power of two"):
        check_evidence(job, 3.0, wire(parts), block.spec)


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
    relay, block = relay_of(tmp_path)
    for i, (w, codec) in enumerate(CHILDREN.items()):
        assert push(relay, i, w, codec).outcome is Outcome.PENDING
    (combined,) = closed_into(relay)
    _, params = block.current()
    block.adopt(VersionInfo(block=0, version=1, base_version=0, sha256=state_sha256(params)), params, raw=None,
                codec=None)
    # the next round's spill takes new bytes under the same file name
    assert push(relay, 3, "c0", Codec.FP32, base_version=1).outcome is Outcome.PENDING
    check_evidence(job_of(combined), block.unit, wire(block.evidence(combined)), block.spec)  # round 0's, bit for bit


def test_a_relay_restarted_mid_round_keeps_its_childrens_receipts_and_evidence(tmp_path):
    relay, _ = relay_of(tmp_path)
    for i, (w, codec) in enumerate(list(CHILDREN.items())[:2]):
        assert push(relay, i, w, codec).outcome is Outcome.PENDING
    del relay  # killed mid-round
    again, block = relay_of(tmp_path)
    assert push(again, 2, "c2", Codec.BF16).outcome is Outcome.PENDING
    (combined,) = closed_into(again)
    assert [(e.worker_id, e.samples, e.cert, e.signature, e.claim_sha256, e.token) for e in combined.manifest] == [
        (w, float(1 + i), f"cert-{w}".encode(), f"sig-{w}".encode(), claim_digest(claim_of(w)), f"token-{w}".encode())
        for i, w in enumerate(CHILDREN)]
    check_evidence(job_of(combined), block.unit, wire(block.evidence(combined)), block.spec)  # bytes taken up too
