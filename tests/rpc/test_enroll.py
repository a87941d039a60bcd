"""Identities by default (rpc/enroll.py): the swarm authority made at first start, single-use join
codes traded for certificates on a real enrollment port, and the identity used against a real
aggregator under mutual TLS. Hostile requests (another key on a used code, a wrong proof, a
malformed request, an expired code, a pin that is not the swarm's) are refused and change nothing."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.aggregate.trust.identities import Role
from btnode.errors import ConfigError, Forbidden, InputError, PeerUnavailable
from btnode.rpc import enroll as en
from btnode.rpc.client import SwarmClient
from btnode.rpc.server import serve
from btnode.v2 import enroll_pb2 as pb
from btnode.v2 import enroll_pb2_grpc as pb_grpc

from conftest import CFG
from procs import honest_terms

from btnode.aggregate.trust.claims import ClaimConfig

CLAIMS = ClaimConfig(batch=1, lr=0.01, steps_per_round=4)


@pytest.fixture
def authority(tmp_path):
    auth = en.SwarmAuthority.create(tmp_path / "state")
    events: list[tuple[str, str]] = []
    server, port = en.serve_enrollment(auth, "127.0.0.1:0", count=lambda e, r: events.append((e, r)))
    yield auth, port, events
    server.stop(0).wait()


def test_first_start_makes_the_ca_an_aggregator_certificate_and_an_operator(tmp_path):
    auth = en.SwarmAuthority.create(tmp_path / "s")
    assert (auth.dir / "ca" / "ca.key").is_file() and (auth.dir / "aggregator.pem").is_file()
    assert en.enrolled(auth.operator) and en.identity_name(auth.operator) == "operator"
    assert oct(os.stat(auth.dir).st_mode & 0o777) == "0o700"
    pin = auth.pin
    assert en.SwarmAuthority.create(tmp_path / "s").pin == pin  # a restart keeps the CA


def test_a_code_becomes_exactly_one_identity(authority, tmp_path):
    auth, port, events = authority
    code, rec = auth.mint(name="w1")
    assert en.JoinCode.parse(str(code)) == code and code.port == port
    assert en.enroll(code, tmp_path / "id1") == "w1"
    assert en.identity_name(tmp_path / "id1") == "w1" and oct(os.stat(tmp_path / "id1" / "identity.key").st_mode & 0o777) == "0o600"
    with pytest.raises(Forbidden, match="used already"):
        en.enroll(code, tmp_path / "id2")  # another key: refused, nothing saved
    assert not (tmp_path / "id2").exists()
    [r] = auth.records()
    assert r.state(0) == "used" and r.name == "w1"
    assert ("enrolled", "worker") in events and ("enroll_refused", "used") in events


def test_a_retry_with_the_same_key_gets_the_same_identity(authority):
    auth, _, _ = authority
    code, _ = auth.mint()
    from cryptography.hazmat.primitives.asymmetric import ec

    csr = en._csr(ec.generate_private_key(ec.SECP256R1()))
    a = auth.redeem(code.code_id, csr, en.proof_of(code.secret, csr))
    b = auth.redeem(code.code_id, csr, en.proof_of(code.secret, csr))
    assert a[1:] == b[1:] and a[1] == f"worker-{code.code_id}"


def test_hostile_requests_are_refused_with_a_status(authority):
    auth, port, _ = authority
    code, _ = auth.mint()
    stub = pb_grpc.EnrollmentStub(ch := grpc.insecure_channel(f"127.0.0.1:{port}"))
    from cryptography.hazmat.primitives.asymmetric import ec

    csr = en._csr(ec.generate_private_key(ec.SECP256R1()))
    cases = [(pb.EnrollRequest(code_id=code.code_id, csr=csr, proof=b"\0" * 32), grpc.StatusCode.PERMISSION_DENIED),
             (pb.EnrollRequest(code_id="deadbeef", csr=csr, proof=en.proof_of(code.secret, csr)),
              grpc.StatusCode.PERMISSION_DENIED),
             (pb.EnrollRequest(code_id=code.code_id, csr=b"not a csr", proof=en.proof_of(code.secret, b"not a csr")),
              grpc.StatusCode.INVALID_ARGUMENT),
             (pb.EnrollRequest(code_id=code.code_id, csr=csr[:-40], proof=en.proof_of(code.secret, csr[:-40])),
              grpc.StatusCode.INVALID_ARGUMENT),
             (pb.EnrollRequest(code_id="open", csr=csr), grpc.StatusCode.PERMISSION_DENIED),  # not an open swarm
             (pb.EnrollRequest(code_id="x" * 100, csr=csr), grpc.StatusCode.INVALID_ARGUMENT)]
    for req, status in cases:
        with pytest.raises(grpc.RpcError) as exc:
            stub.Enroll(req, timeout=10)
        assert exc.value.code() == status, req.code_id
    ch.close()
    [r] = auth.records()
    assert r.state(0) == "open"  # none of it used the code


def test_an_expired_code_and_a_wrong_pin_are_refused(authority, tmp_path):
    auth, _, _ = authority
    code, _ = auth.mint(ttl_s=1)
    auth.clock = lambda: 1e12
    with pytest.raises(Forbidden, match="expired"):
        en.enroll(code, tmp_path / "a")
    auth.clock = __import__("time").time
    code, _ = auth.mint()
    with pytest.raises(Forbidden, match="pins"):
        en.enroll(replace(code, pin="0" * 24), tmp_path / "b")  # the answer's CA is not the pinned one
    assert not (tmp_path / "b").exists()


def test_codes_are_checked_when_minted(authority):
    auth, _, _ = authority
    auth.mint(name="w1")
    for bad in ("w1", "open-x", "aggregator", "a/b"):
        with pytest.raises(InputError):
            auth.mint(name=bad)
    with pytest.raises(ConfigError, match="not a join code"):
        en.JoinCode.parse("btj1-zz")
    with pytest.raises(ConfigError, match="start the aggregator"):
        en.SwarmAuthority(Path("/nonexistent")).mint()


def test_an_open_swarm_enrolls_anyone_as_a_fresh_worker(tmp_path):
    auth = en.SwarmAuthority.create(tmp_path / "state")
    server, _ = en.serve_enrollment(auth, "127.0.0.1:0", open_swarm=True)
    try:
        code = auth.open_code()
        names = {en.enroll(code, tmp_path / f"o{i}") for i in range(2)}
        assert len(names) == 2 and all(n.startswith("open-") for n in names)
    finally:
        server.stop(0).wait()


def test_an_enrolled_worker_joins_and_a_stranger_cannot_connect(authority, tmp_path):
    auth, _, _ = authority
    agg = SwarmAggregator(CFG, AggregatorConfig(claims=CLAIMS), tmp_path / "state")
    server, port, _ = serve(agg, "127.0.0.1:0", security=auth.security())
    code, _ = auth.mint(name="w7")
    en.enroll(code, tmp_path / "w7")
    try:
        c = SwarmClient(f"127.0.0.1:{port}", timeout_s=10, security=en.identity_security(tmp_path / "w7"))
        c.join("w7", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(CLAIMS))
        with pytest.raises(Forbidden):
            c.join("w8", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(CLAIMS))
        c.close()
        op = SwarmClient(f"127.0.0.1:{port}", timeout_s=10, security=en.identity_security(auth.operator))
        assert op.status().blocks
        op.close()
        from btnode.rpc.security import Security

        stranger = SwarmClient(f"127.0.0.1:{port}", timeout_s=3, security=Security())
        with pytest.raises(PeerUnavailable):  # no certificate: the handshake fails, no call is made
            stranger.status()
        stranger.close()
        assert {r.name for r in agg.identities.records()} >= {"w7", "operator"}
        assert Role.WORKER.value == next(r.role for r in agg.identities.records() if r.name == "w7")
    finally:
        server.stop(0).wait()
