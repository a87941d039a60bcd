"""Workers under mutual TLS through a relay (docs/security.md, "Relay audits"): real gRPC servers
(a root and a relay, each with its certificate) in this process. A worker signs its join and its
push receipt; the relay passes both on; the root checks them against the swarm CA, so a relay can
neither invent a join or a child update under a worker's name nor alter a listed one."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from btnode.aggregate.trust.audit import AuditConfig
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.evidence import RelayAuditConfig, frames_digest
from btnode.aggregate.trust.identities import Role
from btnode.aggregate.service import SwarmAggregator, relay_swarm
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames
from btnode.errors import Forbidden, MalformedInput
from btnode.node.relay import _header
from btnode.protocol import EMPTY_STATE, Outcome, PushHeader, WorkClaim
from btnode.rpc.certs import admit, check_receipt, init_ca
from btnode.rpc.client import SwarmClient
from btnode.rpc.security import Security
from btnode.rpc.server import serve

from conftest import CFG
from procs import honest_terms

CLAIMS = ClaimConfig(batch=1, lr=0.01, steps_per_round=4)
ACFG = AggregatorConfig(claims=CLAIMS, relay_audit=RelayAuditConfig(rate=0.0))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    init_ca(d / "ca")
    admit(d / "ca", "root", role=Role.AGGREGATOR, hosts=("127.0.0.1",), out=d)
    admit(d / "ca", "r1", role=Role.RELAY, hosts=("127.0.0.1",), out=d)
    for name in ("w1", "w2"):
        admit(d / "ca", name, out=d)
    init_ca(d / "rogue")
    admit(d / "rogue", "w2", out=d / "rogue")  # w2's name under a CA the swarm does not trust
    return d


def creds(pki: Path, name: str, folder: Path | None = None, server: bool = False) -> Security:
    folder = folder or pki
    return Security(cert=folder / f"{name}.pem", key=folder / f"{name}.key", ca=pki / "ca" / "ca.pem",
                    client_auth=server)


def _tree(tmp_path: Path, pki: Path, audit: AuditConfig = AuditConfig(share=0.0)):  # hand-made pushes: no claims
    """(root aggregator, relay, relay's upstream client, client(name, folder) to the relay)."""
    root = SwarmAggregator(CFG, replace(ACFG, audit=audit), tmp_path / "root", corpus=bytes(range(256)) * 4)
    rserver, rport, _ = serve(root, "127.0.0.1:0", security=creds(pki, "root", server=True))
    upstream = SwarmClient(f"127.0.0.1:{rport}", timeout_s=10, security=creds(pki, "r1"))
    replays = upstream.join("r1", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), relay=True).audits
    relay = relay_swarm(CFG, ACFG, tmp_path / "relay", upstream=upstream, name="r1", blocks=[0], parent_replays=replays,
                        check_receipt=functools.partial(check_receipt, (pki / "ca" / "ca.pem").read_bytes()))  # as node/relay.py
    server, port, _ = serve(relay, "127.0.0.1:0", security=creds(pki, "r1", server=True))
    clients = [upstream]

    def client(name: str, folder: Path | None = None) -> SwarmClient:
        clients.append(SwarmClient(f"127.0.0.1:{port}", timeout_s=10, security=creds(pki, name, folder)))
        return clients[-1]

    yield root, relay, upstream, client
    for c in clients:
        c.close()
    server.stop(0).wait()
    rserver.stop(0).wait()


@pytest.fixture
def tree(tmp_path, pki):
    yield from _tree(tmp_path, pki)


@pytest.fixture
def replaying_tree(tmp_path, pki):
    """The tree under a root that replays every update (p = 1, no probation)."""
    yield from _tree(tmp_path, pki, AuditConfig(share=1.0, probation=0))


@pytest.fixture
def committing_tree(tmp_path, pki):
    """The tree under a root that replays audits but draws no update (p = 1e-12)."""
    yield from _tree(tmp_path, pki, AuditConfig(share=1e-12, probation=0))


def signed_update(w: SwarmClient, root: SwarmAggregator, worker: str, update_id: str, **claim: str):
    """A worker's signed header with a claim that starts a fresh chain on the root's version, its frames and digest."""
    fresh = WorkClaim(base_sha256=root.block(0).current()[0].sha256, data_id="", recipe="{}", optimizer_start=EMPTY_STATE,
                      optimizer_end="cd" * 32, residual_start=EMPTY_STATE, residual_end=EMPTY_STATE)
    frames = encode_frames({n: torch.full(s, 1e-3) for n, s in root.block(0).spec.items()}, Codec.FP32)
    header = w.signed(PushHeader(worker_id=worker, block=0, base_version=0, samples=2.0, loss=1.0, codec=Codec.FP32,
                                 update_id=update_id, steps=(0, 1), claim=replace(fresh, **claim)), frames)
    return header, frames, frames_digest({f.header.name: f.header.sha256 for f in frames})


def join(c: SwarmClient, worker: str):
    return c.join(worker, 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(CLAIMS))


def push(c: SwarmClient, root: SwarmAggregator, worker: str, update_id: str):
    header = PushHeader(worker_id=worker, block=0, base_version=0, samples=1.0, loss=1.0, codec=Codec.FP32,
                        update_id=update_id, steps=(0,))
    return c.push(header, encode_frames({n: torch.full(s, 1e-3) for n, s in root.block(0).spec.items()}, Codec.FP32))


def combined(relay: SwarmAggregator) -> PushHeader:
    """The relay's closed round as the header its forwarder would push (node/relay.py), and its frames."""
    assert relay.upstream is not None
    c = relay.upstream.outbox.get(timeout=10)
    return _header(c, "r1"), encode_frames(c.delta, Codec.FP32)


def test_a_worker_joins_and_pushes_through_a_relay_under_its_own_certificate(tree):
    root, relay, upstream, client = tree
    w1 = client("w1")
    assert join(w1, "w1").data_key  # the root admitted w1 by its signed join, passed on by r1
    assert {r.name: (r.role, r.joined) for r in root.status().identities}["w1"] == ("worker", {0})
    assert push(w1, root, "w1", "u1").outcome is Outcome.PENDING  # at the relay: its only child reported
    header, frames = combined(relay)
    (entry,) = header.manifest
    assert entry.worker_id == "w1" and entry.signature and entry.cert and entry.samples == 1.0
    assert upstream.push(header, frames).outcome is Outcome.PENDING
    assert root.block(0).info.version == 1 and root.block(0).recent[-1].info.included == ("u1",)


def test_a_relay_cannot_alter_or_invent_a_signed_child_update(tree):
    root, relay, upstream, client = tree
    w1 = client("w1")
    join(w1, "w1")
    push(w1, root, "w1", "u1")
    header, frames = combined(relay)
    (entry,) = header.manifest
    forged = {  # each refused whole by the root, reason "signature"
        "another update id": replace(entry, update_id="u-invented"),
        "other frames": replace(entry, sha256="11" * 32),
        "more samples": replace(entry, samples=2.0, weight=2.0),
        "heavier than signed": replace(entry, weight=1.5),
        "unsigned": replace(entry, cert=b"", signature=b""),
    }
    for what, e in forged.items():
        h = replace(header, manifest=(e,), samples=e.weight, update_id=f"{header.update_id}-{len(what)}")
        with pytest.raises(Forbidden, match="signature|signed") as exc:
            upstream.push(h, frames)
        assert exc.value.reason == "signature", what
    assert root.block(0).info.version == 0
    assert upstream.push(header, frames).outcome is Outcome.PENDING  # the untouched one still goes in


def test_a_relay_cannot_pass_on_a_join_it_cannot_prove(tree, pki):
    root, relay, upstream, client = tree
    fp, cfg, terms = CFG.fingerprint(), json.dumps(CFG.to_dict()), honest_terms(CLAIMS)
    with pytest.raises(Forbidden, match="names relay 'r1'"):  # a join the relay makes up (and signs itself)
        upstream.join("w2", 0, fp, cfg, training_json=terms)
    with pytest.raises(Forbidden, match="certificate names 'r1', but the call claims worker id 'w2'"):  # unsigned
        upstream.join("w2", 0, fp, cfg, training_json=terms, proof=(b"", b""))
    w1_join = (pki.joinpath("w1.pem").read_bytes(), b"")
    with pytest.raises(Forbidden, match="names worker 'w1'"):  # w1's certificate under w2's name
        upstream.join("w2", 0, fp, cfg, training_json=terms, proof=w1_join)
    with pytest.raises(Forbidden, match="not issued by this swarm's CA"):  # a rogue CA's w2, through the relay
        upstream.join("w2", 0, fp, cfg, training_json=terms,
                      proof=(pki.joinpath("rogue", "w2.pem").read_bytes(), b"x" * 70))
    with pytest.raises(Forbidden, match="not its key's"):  # w2's real certificate, a signature over another join
        upstream.join("w2", 0, fp, cfg, training_json=terms, proof=(pki.joinpath("w2.pem").read_bytes(), b"x" * 70))
    assert "w2" not in root.keys.of(0)
    assert join(client("w2"), "w2").data_key  # w2 itself, through the same relay, is admitted


def test_a_child_with_a_bad_receipt_is_refused_at_the_relay_and_spoils_nothing(tree, pki):
    root, relay, upstream, client = tree
    w1, w2 = client("w1"), client("w2")
    join(w1, "w1")
    join(w2, "w2")
    spec = root.block(0).spec
    bad = PushHeader(worker_id="w1", block=0, base_version=0, samples=1.0, loss=1.0, codec=Codec.FP32, update_id="u1",
                     steps=(0,), cert=pki.joinpath("w1.pem").read_bytes(), signature=b"x" * 70)
    with pytest.raises(Forbidden, match="not its key's"):
        w1.push(bad, encode_frames({n: torch.full(s, 1e-3) for n, s in spec.items()}, Codec.FP32))
    assert "already pushed update u1" in push(w1, root, "w1", "u1b").reason  # one push per round and identity
    assert push(w2, root, "w2", "u2").outcome is Outcome.PENDING
    header, frames = combined(relay)  # w1 reported (refused), w2 accepted: the relay's round closed with w2's
    assert [e.update_id for e in header.manifest] == ["u2"]
    assert upstream.push(header, frames).outcome is Outcome.PENDING
    assert root.block(0).round.accepted["r1"].included == ("u2",)  # (the root's round waits on w1 until τ)


def test_a_drawn_child_update_reaches_a_replaying_root_under_its_own_receipt_and_claim(replaying_tree):
    root, relay, upstream, client = replaying_tree
    w1 = client("w1")
    join(w1, "w1")
    header, frames, digest = signed_update(w1, root, "w1", "u1")
    claim = header.claim
    assert claim is not None
    # the relay can neither commit w1's update under another claim nor pass it on with other frames
    with pytest.raises(Forbidden, match="not its key's"):
        upstream.draw(replace(header, claim=replace(claim, optimizer_end="ef" * 32)), digest)
    assert upstream.draw(header, digest).drawn  # (drawn: p = 1; its chain advances with its push)
    other = encode_frames({n: torch.full(s, 2e-3) for n, s in root.block(0).spec.items()}, Codec.FP32)
    with pytest.raises(Forbidden, match="not its key's"):
        upstream.push(header, other)
    assert root.block(0).status().accepted_in_round == 0
    judged = w1.push(header, frames)  # through the relay: committed, drawn, passed on as it came
    # drawn: held at the root until its verdict (never published before it), its round open meanwhile
    assert judged.outcome is Outcome.PROBATION and judged.reason.startswith("drawn for audit")
    assert root.block(0).info.version == 0 and "u1" in root.block(0).held
    assert relay.counters[("passed_on", "probation")] == 1 and not relay.block(0).round.accepted
    assert root.audits is not None and root.audits.due()[0][0].header.update_id == "u1"  # its replay is due


def test_a_relay_can_neither_push_a_committed_child_update_itself_nor_frame_its_worker(committing_tree):
    root, relay, upstream, client = committing_tree
    w1 = client("w1")
    join(w1, "w1")
    header, frames, digest = signed_update(w1, root, "w1", "u1")
    assert w1.push(header, frames).outcome is Outcome.PENDING  # at the relay: committed at the root, not drawn
    assert root.counters[("draws", "committed")] == 1
    # pushed directly in w1's name, it would reach the root as a second update of a chain that moved on
    refused = upstream.push(header, frames)
    assert refused.outcome is Outcome.REJECTED and "did not draw for an audit" in refused.reason
    assert root.block(0).counters[("rejected", "not_drawn")] == 1
    # an old claim of w1's, replayed by the relay at a commit, is refused; w1 is not revoked for it
    old, _, old_digest = signed_update(w1, root, "w1", "u0", optimizer_end="ab" * 32)
    with pytest.raises(MalformedInput, match="another optimizer state"):
        upstream.draw(replace(old, base_version=0), old_digest)
    assert not root.identities.is_revoked("w1")
    (combined_header, combined_frames) = combined(relay)  # the relay's round, with w1's token, goes in
    assert combined_header.manifest[0].token and upstream.push(combined_header, combined_frames).outcome is Outcome.PENDING
