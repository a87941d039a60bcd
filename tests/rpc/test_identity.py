"""Identities under mutual TLS (docs/security.md): real gRPC servers, certificates made by
`btnode ca init` / `btnode admit`'s code. The certificate's name is the worker id; pushes need a
join and come one per round; an operator revokes at run time; status shows each identity's record."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.identities import Identities, Role
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames
from btnode.errors import ConfigError, Forbidden, InputError, PeerUnavailable, Refused
from btnode.protocol import Outcome, PushHeader
from btnode.rpc.certs import admit, init_ca
from btnode.rpc.client import SwarmClient
from btnode.rpc.security import Security
from btnode.rpc.server import serve

from conftest import CFG
from procs import honest_terms

CLAIMS = ClaimConfig(batch=1, lr=0.01, steps_per_round=4)  # a step of lr 0.01 may move 0.0117: the pushes move 1e-3


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    init_ca(d / "ca")
    admit(d / "ca", "agg", role=Role.AGGREGATOR, hosts=("127.0.0.1",), out=d)
    for name in ("w1", "w2"):
        admit(d / "ca", name, out=d)
    admit(d / "ca", "op", role=Role.OPERATOR, out=d)
    admit(d / "ca", "old", out=d, days=1, now=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3))
    init_ca(d / "rogue")
    admit(d / "rogue", "w1", out=d / "rogue")  # w1's name, signed by a CA the swarm does not trust
    return d


@pytest.fixture
def swarm(tmp_path, pki):
    """(address, aggregator, client(name)) of a real aggregator under mutual TLS."""
    agg = SwarmAggregator(CFG, AggregatorConfig(claims=CLAIMS), tmp_path / "state")
    server, port, _ = serve(agg, "127.0.0.1:0", security=Security(cert=pki / "agg.pem", key=pki / "agg.key",
                                                                  ca=pki / "ca" / "ca.pem", client_auth=True))
    clients = []

    def client(name: str, folder: Path = pki) -> SwarmClient:
        c = SwarmClient(f"127.0.0.1:{port}", timeout_s=10, security=Security(
            ca=pki / "ca" / "ca.pem", cert=folder / f"{name}.pem", key=folder / f"{name}.key"))
        clients.append(c)
        return c

    yield f"127.0.0.1:{port}", agg, client
    for c in clients:
        c.close()
    server.stop(0).wait()


def join(c: SwarmClient, worker: str, block: int = 0):
    return c.join(worker, block, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms(CLAIMS))


def push(c: SwarmClient, agg: SwarmAggregator, worker: str, update_id: str, base: int = 0):
    spec = agg.block(0).spec
    header = PushHeader(worker_id=worker, block=0, base_version=base, samples=1.0, loss=1.0, codec=Codec.FP32,
                        update_id=update_id, steps=(base,))  # one step of one window
    return c.push(header, encode_frames({n: torch.full(s, 1e-3) for n, s in spec.items()}, Codec.FP32))


def record(agg: SwarmAggregator, name: str):
    return next(r for r in agg.status().identities if r.name == name)


def test_an_admitted_worker_joins_and_pushes_under_its_certificates_name(swarm):
    address, agg, client = swarm
    w1 = client("w1")
    assert join(w1, "w1").data_key == "0/0"
    assert push(w1, agg, "w1", "u1").outcome is Outcome.PENDING
    assert agg.block(0).info.version == 1  # its only replica reported: the round closed with its update
    st = w1.status_dict()["identities"]
    assert [(r["name"], r["role"], r["joined"], r["accepted"], r["refused"], r["revoked_at_unix"]) for r in st] == [
        ("w1", "worker", [0], 1, {}, None)]
    assert len(st[0]["fingerprint"]) == 64


def test_a_certificate_speaks_only_for_its_own_name(swarm):
    """A Join under another name is refused (it may be a mistake); once joined under its own, a call in
    another's name is impersonation: refused, and the identity revoked."""
    _, agg, client = swarm
    w1 = client("w1")
    with pytest.raises(Forbidden, match="certificate names 'w1'.*'w2'"):
        join(w1, "w2")
    assert not agg.identities.is_revoked("w1")
    join(w1, "w1")
    with pytest.raises(Forbidden, match="certificate names 'w1'.*'w2'"):
        push(w1, agg, "w2", "u1")
    assert agg.block(0).registered == {"w1"} and agg.block(0).info.version == 0  # nothing of w2's got in
    assert record(agg, "w1").refused == {"name": 2}
    assert agg.identities.is_revoked("w1") and agg.counters[("revoked", "impersonation")] == 1
    with pytest.raises(Forbidden, match="revoked"):
        push(w1, agg, "w1", "u2")


def test_a_push_needs_a_join_of_its_block(swarm):
    _, agg, client = swarm
    w2 = client("w2")
    judged = push(w2, agg, "w2", "u1")  # a refused push comes back as a judgement the worker acts on
    assert judged.outcome is Outcome.REJECTED and "'w2' pushed to block 0 without joining it" in judged.reason
    assert agg.block(0).info.version == 0 and not agg.block(0).counters[("pending", "")]


def test_one_identity_pushes_one_update_per_round_and_a_retry_is_answered_as_before(swarm):
    _, agg, client = swarm
    w1, w2 = client("w1"), client("w2")
    join(w1, "w1")
    join(w2, "w2")  # a second replica keeps the round open
    first = push(w1, agg, "w1", "u1")
    assert first.outcome is Outcome.PENDING and agg.block(0).status().accepted_in_round == 1
    assert push(w1, agg, "w1", "u1") == first  # the retry of u1 (a dropped connection): its first answer
    second = push(w1, agg, "w1", "u2")
    assert second.outcome is Outcome.REJECTED and "already pushed update u1" in second.reason
    assert agg.block(0).status().accepted_in_round == 1
    assert push(w2, agg, "w2", "v1").outcome is Outcome.PENDING  # the other identity is untouched
    assert agg.block(0).info.version == 1 and agg.block(0).info.accepted == 2
    rec = record(agg, "w1")
    assert (rec.accepted, dict(rec.refused)) == (1, {"second_push": 1})


def test_an_operator_revokes_an_identity_at_run_time(swarm, tmp_path):
    _, agg, client = swarm
    w1, w2, op = client("w1"), client("w2"), client("op")
    join(w1, "w1")
    with pytest.raises(Forbidden, match="only an operator may revoke"):
        w2.revoke("w1")
    with pytest.raises(InputError, match="no identity 'w9'.*known: op, w1, w2"):
        op.revoke("w9")
    with pytest.raises(Forbidden, match="may not call Join"):  # an operator is no worker
        join(op, "op")
    assert op.revoke("w1") > 0
    for call in (lambda: join(w1, "w1"), w1.status, lambda: push(w1, agg, "w1", "u1")):
        with pytest.raises(Forbidden, match="'w1' was revoked"):
            call()
    assert join(w2, "w2").data_key == "0/1"  # others go on
    rows = {r["name"]: r for r in op.status_dict()["identities"]}
    assert rows["w1"]["revoked_at_unix"] and rows["w1"]["refused"]["revoked"] == 3 and not rows["w2"]["revoked_at_unix"]
    assert "w1" in Identities(tmp_path / "state").revoked  # durable: a restarted aggregator keeps refusing it
    events = {(c["name"], c["labels"]["reason"]): c["value"] for c in op.status_dict()["counters"]}
    assert events[("identity_refused", "revoked")] >= 2  # the join and the status call, in the swarm's counters


def test_untrusted_and_expired_certificates_fail_the_handshake(swarm, pki):
    _, agg, client = swarm
    for c in (client("w1", pki / "rogue"), client("old")):
        with pytest.raises(PeerUnavailable):
            join(c, "w1")
    assert not agg.block(0).registered and not agg.status().identities


def test_without_mutual_tls_there_is_nothing_to_revoke(live):
    with pytest.raises(Refused, match="--tls-client-auth"):
        live.client.revoke("w1")
    assert not live.agg.status().identities


def test_admit_refuses_bad_names_requests_and_overwrites(pki, tmp_path):
    with pytest.raises(InputError, match="identity name '../w1'"):
        admit(pki / "ca", "../w1", out=tmp_path)
    with pytest.raises(InputError, match="not a PEM CSR"):
        admit(pki / "ca", "w3", out=tmp_path, csr=b"-----BEGIN CERTIFICATE REQUEST-----\nnope\n")
    with pytest.raises(ConfigError, match="w1.key exists already"):
        admit(pki / "ca", "w1", out=pki)
    with pytest.raises(ConfigError, match="btnode ca init"):
        admit(tmp_path / "no-ca", "w3", out=tmp_path)
    key = ec.generate_private_key(ec.SECP256R1())  # a peer that keeps its key sends a CSR
    csr = (x509.CertificateSigningRequestBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]))
           .sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    issued = admit(pki / "ca", "w4", out=tmp_path, csr=csr)
    cert = x509.load_pem_x509_certificate(issued.cert.read_bytes())
    assert issued.key is None and cert.public_key() == key.public_key()
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "w4"  # the CA names it, not the CSR


def test_the_cli_revokes_and_shows_identities(swarm, pki):
    """Real `btnode revoke` and `btnode status` processes against the aggregator."""
    address, agg, client = swarm
    join(client("w1"), "w1")
    tls = ["--tls-ca", str(pki / "ca" / "ca.pem"), "--tls-cert", str(pki / "op.pem"), "--tls-key", str(pki / "op.key")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cli = [sys.executable, "-m", "btnode_cli.main", *tls]
    done = subprocess.run([*cli, "revoke", "--peer", address, "w1"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "revoked w1" in done.stdout, done.stderr
    again = subprocess.run([*cli, "revoke", "--peer", address, "nobody"], capture_output=True, text=True, env=env)
    assert again.returncode == 5 and "no identity 'nobody'" in again.stderr and "Traceback" not in again.stderr
    st = subprocess.run([*cli, "status", "--peer", address], capture_output=True, text=True, env=env)
    assert st.returncode == 0, st.stderr
    assert "identity w1 (worker, " in st.stdout and "REVOKED; joined [0]; 0 taken into rounds" in st.stdout, st.stdout
