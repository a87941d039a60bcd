"""Authentication over real gRPC: the swarm token on every RPC (UNAUTHENTICATED without it), TLS
and mutual TLS with certificates generated on the fly by openssl."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import Codec
from btnode.codec.frames import encode_frames
from btnode.errors import ConfigError, PeerUnavailable, Unauthenticated
from btnode.protocol import PushHeader
from btnode.rpc.client import SwarmClient
from btnode.rpc.security import Security
from btnode.rpc.server import serve
from btnode.store.models import init_block
from btnode.train.config import TrainConfig

from conftest import CFG
from procs import honest_terms

NO_OPENSSL = "openssl is not installed (it makes the test certificates)"


@pytest.fixture
def node(tmp_path):
    """start(security) → address of a real aggregator server with those settings."""
    servers = []

    def start(security: Security) -> tuple[str, SwarmAggregator]:
        agg = SwarmAggregator(CFG, AggregatorConfig(), tmp_path / f"state{len(servers)}")
        server, port, _ = serve(agg, "127.0.0.1:0", security=security)
        servers.append(server)
        return f"127.0.0.1:{port}", agg

    yield start
    for s in servers:
        s.stop(0).wait()


def calls(client: SwarmClient) -> list:
    """One call of each kind: unary (Join, Status), server-streaming (Pull), client-streaming (Push)."""
    spec = {n: tuple(t.shape) for n, t in init_block(CFG, 0, 0).state_dict().items()}
    header = PushHeader(worker_id="w", block=0, base_version=0, samples=float(TrainConfig.batch), loss=1.0,
                        codec=Codec.FP32, update_id="u", steps=(0,))  # one step of the default settings' batch
    frames = encode_frames({n: torch.zeros(s) for n, s in spec.items()}, Codec.FP32)
    return [lambda: client.join("w", 0, CFG.fingerprint(), json.dumps(CFG.to_dict()), training_json=honest_terms()),
            client.status,
            lambda: client.pull(0, "w", spec), lambda: client.push(header, frames)]


def test_every_rpc_needs_the_swarm_token(node):
    address, agg = node(Security(token="correct horse"))
    for token in ("", "wrong"):
        client = SwarmClient(address, timeout_s=10, security=Security(token=token))
        for call in calls(client):
            with pytest.raises(Unauthenticated, match="UNAUTHENTICATED|token"):
                call()
        client.close()
    assert agg.counters[("unauthenticated", "token")] == 8
    assert agg.block(0).info.version == 0 and not agg.block(0).registered  # nothing got through
    good = SwarmClient(address, timeout_s=10, security=Security(token="correct horse"))
    for call in calls(good):
        call()
    assert agg.block(0).counters[("pending", "")] == 1
    good.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost, and a client certificate, all from openssl."""
    if shutil.which("openssl") is None:
        pytest.skip(NO_OPENSSL)
    d = tmp_path_factory.mktemp("pki")

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=btnode test CA")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth")):
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        (d / f"{name}.ext").write_text(ext + "\n")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "rogue.key", "-out", "rogue.pem", "-days", "2",
        "-subj", "/CN=rogue")
    return d


def test_tls_server_talks_only_to_tls_clients_that_trust_its_ca(node, pki):
    address, _ = node(Security(cert=pki / "server.pem", key=pki / "server.key"))
    client = SwarmClient(address, timeout_s=10, security=Security(ca=pki / "ca.pem"))
    assert client.status().fingerprint == CFG.fingerprint()
    client.close()
    for sec in (Security(), Security(ca=pki / "rogue.pem")):  # plaintext; a CA that did not sign the server
        bad = SwarmClient(address, timeout_s=5, security=sec)
        with pytest.raises(PeerUnavailable):
            bad.status()
        bad.close()


def test_mutual_tls_requires_a_client_certificate_from_the_swarm_ca(node, pki):
    address, _ = node(Security(cert=pki / "server.pem", key=pki / "server.key", ca=pki / "ca.pem", client_auth=True,
                               token="t"))
    ok = SwarmClient(address, timeout_s=10, security=Security(ca=pki / "ca.pem", cert=pki / "client.pem",
                                                              key=pki / "client.key", token="t"))
    assert ok.status().fingerprint == CFG.fingerprint()
    ok.close()
    for sec in (Security(ca=pki / "ca.pem", token="t"),  # no client certificate
                Security(ca=pki / "ca.pem", cert=pki / "rogue.pem", key=pki / "rogue.key", token="t")):  # self-signed
        bad = SwarmClient(address, timeout_s=5, security=sec)
        with pytest.raises(PeerUnavailable):
            bad.status()
        bad.close()


def test_half_a_tls_configuration_is_refused():
    with pytest.raises(ConfigError, match="both a certificate and its key"):
        Security(cert=Path("x.pem"))
    with pytest.raises(ConfigError, match="mutual TLS"):
        Security(client_auth=True)


def test_the_cli_reads_the_token_and_tls_settings(pki, tmp_path):
    """Real processes: an aggregator with mTLS and a token; `btnode status` with and without them."""
    btnode = str(Path(sys.executable).with_name("btnode"))
    (tmp_path / "token").write_text("s3cret\n")
    tls = ["--tls-ca", str(pki / "ca.pem")]
    server_tls = [*tls, "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"), "--tls-client-auth"]
    client_tls = [*tls, "--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key")]
    port_file = tmp_path / "port"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agg = subprocess.Popen([btnode, "--token-file", str(tmp_path / "token"), *server_tls, "join", "--role", "aggregator",
                            "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"), "--port-file", str(port_file),
                            "--d-model", "32", "--heads", "2", "--layers", "1", "--context", "32", "--segments", "1,8"],
                           env=env, stdout=open(tmp_path / "agg.log", "wb"), stderr=subprocess.STDOUT)
    try:
        from procs import wait_port

        address = f"127.0.0.1:{wait_port(port_file, agg)}"
        ok = subprocess.run([btnode, *client_tls, "status", "--peer", address], capture_output=True, text=True,
                            env=dict(env, BTNODE_TOKEN="s3cret"))
        assert ok.returncode == 0 and "block 0: version 0" in ok.stdout, ok.stderr
        no_token = subprocess.run([btnode, *client_tls, "status", "--peer", address], capture_output=True, text=True,
                                  env=env)
        assert no_token.returncode == 8 and "swarm token" in no_token.stderr, no_token.stderr
        no_cert = subprocess.run([btnode, *tls, "status", "--peer", address], capture_output=True, text=True,
                                 env=dict(env, BTNODE_TOKEN="s3cret"))
        assert no_cert.returncode == 7 and "Traceback" not in no_cert.stderr, no_cert.stderr
    finally:
        agg.terminate()
        agg.wait(timeout=30)
