"""Identities by default (docs/security.md, "Identities by default"): the swarm's own CA, made by
the aggregator at its first start, single-use join codes, and the enrollment that trades one code
for one certificate.

- `SwarmAuthority` lives in the aggregator's state folder (`swarm/`, mode 0700): the CA, the
  aggregator's certificate (a server certificate naming SWARM_NAME), an operator identity for
  `btnode status` and `btnode revoke` on that host, and the codes (`codes.json`, written durably
  under a file lock, so `btnode codes mint` and a running aggregator can share it).
- A join code is `btj1-ID-SECRET-PIN@HOST:PORT`: the code's id, a 128-bit secret, the first 96 bits
  of the CA certificate's SHA-256 (the pin), and the address of the aggregator's enrollment port.
  The node makes its own key and sends a certificate request with HMAC(secret, request): the secret
  never crosses the wire, so a request seen on the way can only be traded for a certificate of the
  sender's own key, and the CA in the answer must match the pin, so nobody on the way can pose as
  the swarm. The enrollment port is plaintext for that reason; every other call goes to the main
  port, which requires a client certificate from the CA (mutual TLS).
- An open swarm (`--open`) enrolls anyone with the open code `btj1-open-PIN@HOST:PORT`, as a fresh
  worker identity named `open-…`: what such an identity's updates weigh is the round's business.

A node keeps its identity in a folder (`--identity`): identity.key (0600), identity.pem, ca.pem. Why
not a bearer credential per identity: a relay sees its children's calls, and a credential it sees it
could replay at the root; a certificate's key never leaves its node, and the relay checks (and the
root re-checks) children's signatures with it (docs/relays.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from btnode.aggregate.trust.identities import Role
from btnode.durable import atomic_write
from btnode.errors import ConfigError, Forbidden, InputError, MalformedInput, PeerUnavailable
from btnode.rpc import certs
from btnode.rpc.security import Security, current
from btnode.rpc.status import code_for
from btnode.v2 import enroll_pb2 as pb
from btnode.v2 import enroll_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SWARM_NAME = "btnode-swarm"  # every swarm server certificate names it; an enrolled client expects it
PREFIX = "btj1"
OPEN = "open"  # the code id of an open swarm's code
CODE = re.compile(rf"{PREFIX}-(?P<id>{OPEN}|[0-9a-f]{{8}})-(?:(?P<secret>[0-9a-f]{{32}})-)?(?P<pin>[0-9a-f]{{24}})"
                  r"@(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})")
IDENTITY_KEY, IDENTITY_CERT, IDENTITY_CA = "identity.key", "identity.pem", "ca.pem"
MAX_CSR = 4096  # bytes: a P-256 request is about 400
DEFAULT_TTL_S = 7 * 24 * 3600.0  # a code not used within a week expires
SERVER_ROLES = frozenset({Role.RELAY, Role.STAGE})  # roles that others dial: their certificates serve too


@dataclass(frozen=True)
class JoinCode:
    code_id: str  # 8 hex digits, or OPEN
    secret: str  # 32 hex digits ("" for the open code)
    pin: str  # 24 hex digits of sha256(CA certificate, DER)
    host: str
    port: int

    def __str__(self) -> str:
        secret = f"{self.secret}-" if self.secret else ""
        return f"{PREFIX}-{self.code_id}-{secret}{self.pin}@{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> JoinCode:
        m = CODE.fullmatch(text.strip())
        if m is None or (m["id"] == OPEN) != (m["secret"] is None):
            raise ConfigError(f"{text.strip()[:24]!r}… is not a join code (btj1-ID-SECRET-PIN@HOST:PORT, from "
                              f"`btnode codes mint` on the aggregator's host)")
        return cls(m["id"], m["secret"] or "", m["pin"], m["host"], int(m["port"]))


def pin_of(ca_pem: bytes) -> str:
    der = x509.load_pem_x509_certificate(ca_pem).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()[:24]


def proof_of(secret: str, csr: bytes) -> bytes:
    return hmac.new(bytes.fromhex(secret), csr, hashlib.sha256).digest() if secret else b""


@dataclass(frozen=True)
class CodeRecord:
    code_id: str
    role: str
    name: str
    minted: float
    expires: float
    used_by: str = ""  # the fingerprint of the key it was traded for
    used_at: float = 0.0

    def state(self, now: float) -> str:
        return "used" if self.used_by else "expired" if now >= self.expires else "open"


def identity_security(folder: Path, token: str = "") -> Security:
    """The settings of a node enrolled into `folder`: mutual TLS with its own certificate, checking
    servers against the swarm CA by SWARM_NAME; as a server (a relay, a stage) it requires client
    certificates from that CA too."""
    return Security(token=token, cert=folder / IDENTITY_CERT, key=folder / IDENTITY_KEY, ca=folder / IDENTITY_CA,
                    client_auth=True, server_name=SWARM_NAME)


def enrolled(folder: Path) -> bool:
    return all((folder / f).is_file() for f in (IDENTITY_KEY, IDENTITY_CERT, IDENTITY_CA))


def identity_name(folder: Path) -> str:
    """The name the certificate in `folder` gives its node (a worker's id)."""
    return certs.describe((folder / IDENTITY_CERT).read_bytes()).name


def own_name() -> str:
    """The name this node's certificate gives it ("" without one): a worker's or relay's default id."""
    cert = current().cert
    return certs.describe(cert.read_bytes()).name if cert is not None else ""


def _save_identity(folder: Path, key_pem: bytes, cert_pem: bytes, ca_pem: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    atomic_write(folder / IDENTITY_KEY, key_pem)  # the folder is 0700, and the file is made 0600 at once
    os.chmod(folder / IDENTITY_KEY, 0o600)
    atomic_write(folder / IDENTITY_CA, ca_pem)
    atomic_write(folder / IDENTITY_CERT, cert_pem)  # last: its presence says the folder is complete


class SwarmAuthority:
    """The swarm's CA and join codes, in `state_dir/swarm`."""

    def __init__(self, state_dir: Path, *, clock: Callable[[], float] = time.time):
        self.dir = state_dir / "swarm"
        self.ca_dir = self.dir / "ca"
        self.codes_path = self.dir / "codes.json"
        self.clock = clock

    @classmethod
    def create(cls, state_dir: Path, *, hosts: tuple[str, ...] = ()) -> SwarmAuthority:
        """Open the swarm's authority, making it on the first start: the CA, the aggregator's certificate
        (SWARM_NAME, localhost and `hosts`) and an operator identity (folder `operator/`)."""
        auth = cls(state_dir)
        if not (auth.ca_dir / certs.CA_CERT).is_file():
            auth.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(auth.dir, 0o700)
            certs.init_ca(auth.ca_dir)
            log.info("made the swarm's CA in %s (pin %s): every identity of this swarm is a certificate it signs",
                     auth.ca_dir, auth.pin)
        if not (auth.dir / "aggregator.pem").is_file():
            certs.admit(auth.ca_dir, "aggregator", role=Role.AGGREGATOR, out=auth.dir, days=3650,
                        hosts=tuple(dict.fromkeys((SWARM_NAME, "localhost", "127.0.0.1", *hosts))))
        if not enrolled(auth.dir / "operator"):
            key = ec.generate_private_key(ec.SECP256R1())
            cert = auth._sign(_csr(key), "operator", Role.OPERATOR, days=3650)
            _save_identity(auth.dir / "operator", certs.pem_key(key), cert, auth.ca_pem)
        return auth

    @property
    def ca_pem(self) -> bytes:
        return (self.ca_dir / certs.CA_CERT).read_bytes()

    @property
    def pin(self) -> str:
        return pin_of(self.ca_pem)

    @property
    def operator(self) -> Path:
        """The identity folder of this host's operator (`btnode --identity DIR status ...`)."""
        return self.dir / "operator"

    def security(self, token: str = "") -> Security:
        """The aggregator's settings: its certificate, and client certificates from the CA required."""
        return Security(token=token, cert=self.dir / "aggregator.pem", key=self.dir / "aggregator.key",
                        ca=self.ca_dir / certs.CA_CERT, client_auth=True)

    # -- the enrollment port's address, for codes -----------------------------------------------
    def listening(self, host: str, port: int) -> None:
        atomic_write(self.dir / "enroll.json", json.dumps({"host": host, "port": port}).encode())

    def address(self, host: str | None = None) -> tuple[str, int]:
        try:
            where = json.loads((self.dir / "enroll.json").read_text())
        except (OSError, ValueError):
            raise ConfigError(f"no enrollment address in {self.dir}: start the aggregator once (it makes the swarm's "
                              f"CA and opens its enrollment port), then mint codes") from None
        listen = where["host"]
        return host or (listen if listen not in ("0.0.0.0", "::", "[::]", "") else _hostname()), int(where["port"])

    # -- codes --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _codes(self) -> Iterator[dict]:
        """The codes file, read and (if changed) written back durably under an exclusive lock."""
        if not (self.ca_dir / certs.CA_CERT).is_file():
            raise ConfigError(f"{self.dir} holds no swarm CA: start the aggregator with this --state-dir once")
        with open(self.dir / "codes.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                doc = json.loads(self.codes_path.read_text()) if self.codes_path.exists() else {"codes": {}, "open": {}}
            except ValueError as exc:
                raise ConfigError(f"{self.codes_path} is not valid JSON ({exc}); restore it from a backup") from None
            before = json.dumps(doc, sort_keys=True)
            yield doc
            after = json.dumps(doc, sort_keys=True, indent=1)
            if after != before:
                atomic_write(self.codes_path, after.encode())
                os.chmod(self.codes_path, 0o600)

    def mint(self, *, role: Role = Role.WORKER, name: str = "", ttl_s: float = DEFAULT_TTL_S,
             host: str | None = None) -> tuple[JoinCode, CodeRecord]:
        """A new single-use code for one identity of `role`, named `name` (default ROLE-ID)."""
        if role is Role.AGGREGATOR:
            raise InputError("an aggregator is not enrolled: it holds the CA")
        if ttl_s <= 0:
            raise InputError(f"a code's lifetime must be positive, got {ttl_s:g} s")
        enroll_host, enroll_port = self.address(host)
        with self._codes() as doc:
            code_id = secrets.token_hex(4)
            while code_id in doc["codes"]:
                code_id = secrets.token_hex(4)
            name = name or f"{role.value}-{code_id}"
            if not certs.NAME.fullmatch(name) or len(name) > certs.MAX_NAME or name.startswith(f"{OPEN}-"):
                raise InputError(f"identity name {name!r}: letters, digits, '.', '_' and '-', not starting 'open-'")
            if name in ("aggregator", "operator") or any(c["name"] == name for c in doc["codes"].values()):
                raise InputError(f"a code for the name {name!r} exists already: each code is one identity")
            now = self.clock()
            secret = secrets.token_hex(16)
            doc["codes"][code_id] = {"secret": secret, "role": role.value, "name": name, "minted": now,
                                     "expires": now + ttl_s, "used_by": "", "used_at": 0.0}
        code = JoinCode(code_id, secret, self.pin, enroll_host, enroll_port)
        return code, CodeRecord(code_id, role.value, name, now, now + ttl_s)

    def open_code(self, host: str | None = None) -> JoinCode:
        enroll_host, enroll_port = self.address(host)
        return JoinCode(OPEN, "", self.pin, enroll_host, enroll_port)

    def records(self) -> list[CodeRecord]:
        with self._codes() as doc:
            return [CodeRecord(code_id=k, **{f: v for f, v in c.items() if f != "secret"})
                    for k, c in sorted(doc["codes"].items(), key=lambda kv: kv[1]["minted"])]

    def redeem(self, code_id: str, csr: bytes, proof: bytes, *, open_swarm: bool = False) -> tuple[bytes, str, Role]:
        """Trade a code for a certificate of the request's key: (certificate PEM, name, role). A second
        request with the same key gets the same identity again (a retry whose answer was lost); any other
        key is refused: one code, one identity."""
        public = _request_key(csr)
        fingerprint = hashlib.sha256(public).hexdigest()
        with self._codes() as doc:
            if code_id == OPEN:
                if not open_swarm:
                    raise Forbidden("closed", "this swarm is not open: ask its operator for a join code")
                name = doc["open"].get(fingerprint) or f"{OPEN}-{secrets.token_hex(6)}"
                doc["open"][fingerprint] = name
                return self._sign(csr, name, Role.WORKER), name, Role.WORKER
            c = doc["codes"].get(code_id)
            if c is None or not hmac.compare_digest(proof, proof_of(c["secret"], csr)):
                raise Forbidden("code", "unknown join code, or a proof that does not match it")
            if c["used_by"] and c["used_by"] != fingerprint:
                raise Forbidden("used", f"join code {code_id} was used already (by another key, at "
                                        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(c['used_at']))} UTC)")
            if not c["used_by"] and self.clock() >= c["expires"]:
                raise Forbidden("expired", f"join code {code_id} expired; ask for a new one")
            c["used_by"], c["used_at"] = fingerprint, c["used_at"] or self.clock()
            role = Role(c["role"])
            return self._sign(csr, c["name"], role), c["name"], role

    def _sign(self, csr: bytes, name: str, role: Role, days: int = 365) -> bytes:
        out = self.dir / "issued"
        out.mkdir(exist_ok=True, mode=0o700)
        path = out / f"{name}.pem"
        path.unlink(missing_ok=True)  # a retry of the same key: issued again
        hosts = (SWARM_NAME,) if role in SERVER_ROLES else ()
        return certs.admit(self.ca_dir, name, role=role, out=out, days=days, hosts=hosts, csr=csr).cert.read_bytes()


def _hostname() -> str:
    import socket

    return socket.getfqdn()


def _csr(key: ec.EllipticCurvePrivateKey) -> bytes:
    req = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "btnode enrollee")]))
           .sign(key, hashes.SHA256()))
    return req.public_bytes(serialization.Encoding.PEM)


def _request_key(csr: bytes) -> bytes:
    if len(csr) > MAX_CSR:
        raise MalformedInput("csr", f"a certificate request of {len(csr)} bytes (at most {MAX_CSR})")
    try:
        req = x509.load_pem_x509_csr(csr)
    except ValueError as exc:
        raise MalformedInput("csr", f"not a PEM certificate request: {exc}") from None
    if not req.is_signature_valid:
        raise MalformedInput("csr", "the certificate request's signature does not match its key")
    return req.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


class EnrollmentServicer(pb_grpc.EnrollmentServicer):
    def __init__(self, authority: SwarmAuthority, *, open_swarm: bool = False,
                 count: Callable[[str, str], None] = lambda event, reason: None):
        self.authority, self.open_swarm, self.count = authority, open_swarm, count

    def Enroll(self, request: pb.EnrollRequest, context: grpc.ServicerContext) -> pb.EnrollReply:
        try:
            if len(request.code_id) > 16 or len(request.proof) > 64:
                raise MalformedInput("request", "a code id or proof longer than any join code's")
            cert, name, role = self.authority.redeem(request.code_id, bytes(request.csr), bytes(request.proof),
                                                     open_swarm=self.open_swarm)
        except (Forbidden, MalformedInput) as exc:
            self.count("enroll_refused", exc.reason)
            log.warning("enrollment refused (%s): %s", exc.reason, exc)
            context.abort(code_for(exc), str(exc))
        self.count("enrolled", role.value)
        log.info("enrolled %s %s (code %s)", role.value, name, request.code_id)
        return pb.EnrollReply(certificate=cert, ca=self.authority.ca_pem, name=name, role=role.value)


def serve_enrollment(authority: SwarmAuthority, address: str, *, open_swarm: bool = False,
                     count: Callable[[str, str], None] = lambda event, reason: None) -> tuple[grpc.Server, int]:
    """The enrollment port: a small plaintext server with the Enrollment service only."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="enroll"),
                         options=[("grpc.max_receive_message_length", 16 << 10)])
    pb_grpc.add_EnrollmentServicer_to_server(EnrollmentServicer(authority, open_swarm=open_swarm, count=count), server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise ConfigError(f"cannot listen for enrollments on {address}: the address is in use or not local "
                          f"(--enroll-listen)")
    server.start()
    authority.listening(address.rsplit(":", 1)[0], port)
    return server, port


def enroll(code: JoinCode, folder: Path, *, timeout_s: float = 120.0) -> str:
    """Trade `code` for an identity kept in `folder`; returns its name. The CA that answers must be
    the one the code pins."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = _csr(key)
    channel = grpc.insecure_channel(code.address)
    try:  # wait_for_ready: a node started before its aggregator waits for it, as its other calls do
        reply = pb_grpc.EnrollmentStub(channel).Enroll(
            pb.EnrollRequest(code_id=code.code_id, csr=csr, proof=proof_of(code.secret, csr)), timeout=timeout_s,
            wait_for_ready=True)
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise PeerUnavailable(f"cannot reach the enrollment port {code.address} within {timeout_s:g} s: "
                                  f"{exc.details()}") from None
        raise Forbidden("enroll", f"the swarm refused join code {code.code_id}: {exc.details()}") from None
    finally:
        channel.close()
    if pin_of(reply.ca) != code.pin:
        raise Forbidden("pin", f"the CA at {code.address} is not the one the join code pins ({code.pin}): "
                               f"not your swarm, or someone in between")
    issued = certs.describe(reply.certificate, ca_pem=reply.ca)
    ours = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if issued.public_key != ours:
        raise Forbidden("pin", "the certificate the swarm sent is not for this node's key")
    _save_identity(folder, certs.pem_key(key), reply.certificate, reply.ca)
    log.info("enrolled as %s %s (identity in %s)", reply.role, reply.name, folder)
    return reply.name
