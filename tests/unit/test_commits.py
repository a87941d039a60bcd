"""A root that replays audits and its relays' child updates (aggregate/trust/commits.py): each is committed
(Draw) before a relay counts it: its claim's chain is checked then, and one not drawn gets a token
that binds its worker, update id, base version and frames digest; a combined push whose entries do
not each carry their own token is refused whole, reason "uncommitted"."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from btnode.aggregate.trust.audit import AuditConfig
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.evidence import RelayAuditConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames, iter_chunks
from btnode.errors import MalformedInput
from btnode.protocol import EMPTY_STATE, ManifestEntry, Outcome, PushHeader, WorkClaim
from lab.fuzz import CFG

from procs import honest_terms

CLAIMS = ClaimConfig(batch=1, lr=0.01, steps_per_round=2)
DIGEST = "ab" * 32


def _root(tmp_path, share: float) -> SwarmAggregator:
    acfg = AggregatorConfig(audit=AuditConfig(share=share, probation=0), claims=CLAIMS,
                            relay_audit=RelayAuditConfig(rate=0.0))  # (relay audits: test_relay_evidence.py)
    root = SwarmAggregator(CFG, acfg, tmp_path, corpus=bytes(range(256)) * 4, blocks=[0])
    fingerprint, config = CFG.fingerprint(), json.dumps(CFG.to_dict())
    assert root.join("r1", 0, fingerprint, config, relay=True).audits  # the relay learns it must commit
    for w in ("w1", "w2"):
        root.join(w, 0, fingerprint, config, training_json=honest_terms(CLAIMS))
    return root


def _child(root: SwarmAggregator, worker: str, **claim: str) -> PushHeader:
    """A child's push header whose claim starts a fresh chain on the root's current version."""
    start = WorkClaim(base_sha256=root.block(0).current()[0].sha256, data_id="", recipe="{}",
                      optimizer_start=EMPTY_STATE, optimizer_end="cd" * 32, residual_start=EMPTY_STATE,
                      residual_end=EMPTY_STATE)
    return PushHeader(worker_id=worker, block=0, base_version=0, samples=1.0, loss=1.0, codec=Codec.FP32,
                      update_id=f"{worker}-u", steps=(0, 1), claim=replace(start, **claim))


def _combined(root: SwarmAggregator, entries: list[ManifestEntry], update_id: str):
    header = PushHeader(worker_id="r1", block=0, base_version=0, samples=sum(e.weight for e in entries), loss=1.0,
                        codec=Codec.FP32, update_id=update_id, manifest=tuple(entries))
    frames = encode_frames({n: torch.full(s, 1e-4) for n, s in root.block(0).spec.items()}, Codec.FP32)
    return root.push(header, iter_chunks(frames))


def test_a_child_update_not_drawn_is_counted_only_with_the_token_of_its_own_commit(tmp_path):
    root = _root(tmp_path, share=1e-12)
    tokens = {}
    for w in ("w1", "w2"):
        drawn = root.draw(_child(root, w), DIGEST)
        assert not drawn.drawn and len(drawn.token) == 32
        assert root.draw(_child(root, w), DIGEST) == drawn  # committed again (a failover): the same token
        tokens[w] = drawn.token
    entry = {w: ManifestEntry(w, f"{w}-u", 0, 1.0, DIGEST, samples=1.0, token=tokens[w]) for w in tokens}
    forged = {
        "no token": replace(entry["w1"], token=b""),
        "another update's token": replace(entry["w1"], token=tokens["w2"]),
        "other frames than committed": replace(entry["w1"], sha256="ef" * 32),
        "a flipped bit": replace(entry["w1"], token=bytes([tokens["w1"][0] ^ 1]) + tokens["w1"][1:]),
    }
    for i, (what, e) in enumerate(forged.items()):
        with pytest.raises(MalformedInput, match="did not commit") as exc:
            _combined(root, [e, entry["w2"]], f"forged-{i}")
        assert exc.value.reason == "uncommitted", what
    assert root.block(0).status().accepted_in_round == 0
    assert _combined(root, [entry["w1"], entry["w2"]], "honest").outcome is Outcome.PENDING
    assert root.counters[("draws", "committed")] == 2


def test_a_claim_that_breaks_its_workers_chain_is_refused_at_the_commit_without_revoking_it(tmp_path):
    root = _root(tmp_path, share=1e-12)
    with pytest.raises(MalformedInput, match="another optimizer state") as exc:  # a fresh join starts fresh
        root.draw(_child(root, "w1", optimizer_start="ee" * 32), DIGEST)
    # through a relay the order of a worker's claims is the relay's (it could replay an old signed one)
    assert exc.value.reason == "chain" and not root.identities.is_revoked("w1")
    assert not root.draw(_child(root, "w1"), DIGEST).drawn  # its chain is where it was: the right claim goes in
    with pytest.raises(MalformedInput, match="claims version 0 has hash") as exc:
        root.draw(_child(root, "w2", base_sha256="00" * 32), DIGEST)
    assert exc.value.reason == "claim" and not root.identities.is_revoked("w2")


def test_a_drawn_child_update_gets_no_token_and_its_chain_waits_for_its_own_push(tmp_path):
    root = _root(tmp_path, share=1.0)
    drawn = root.draw(_child(root, "w1"), DIGEST)
    assert drawn.drawn and drawn.token == b""
    assert root.draw(_child(root, "w1"), DIGEST).drawn  # not advanced: the push itself advances it
    with pytest.raises(MalformedInput) as exc:  # listed in a combined push, it is not counted
        _combined(root, [ManifestEntry("w1", "w1-u", 0, 1.0, DIGEST, samples=1.0)], "kept")
    assert exc.value.reason == "uncommitted"


def test_a_committed_child_update_its_relay_left_out_is_counted_against_that_relay(tmp_path):
    root = _root(tmp_path, share=1e-12)
    tokens = {w: root.draw(_child(root, w), DIGEST, relay="r1").token for w in ("w1", "w2")}
    root.settle_commits()
    assert ("relay_uncounted", "r1") not in root.counters  # its round is still open
    kept = ManifestEntry("w1", "w1-u", 0, 1.0, DIGEST, samples=1.0, token=tokens["w1"])  # w2's update dropped
    assert _combined(root, [kept], "c1").outcome is Outcome.PENDING
    (info,) = root.drain()
    assert info.included == ("w1-u",)
    root.settle_commits()
    root.settle_commits()  # settled once
    assert root.counters[("relay_uncounted", "r1")] == 1
