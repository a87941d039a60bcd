"""The swarm's certificates (docs/security.md, "Identities"): `init_ca` makes the swarm CA,
`admit` signs a peer's certificate, and `peer_identity` reads the identity of the client
certificate gRPC verified on a call. A certificate names its peer twice: CN = the name, and a
URI subject alternative name `btnode:<role>/<name>`, which carries the role. EC P-256 keys: small,
fast to verify, and supported by gRPC's TLS stack. Uses the `cryptography` package, so that no
openssl binary is needed on the operator's host.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from btnode.aggregate.trust.identities import Identity, Role
from btnode.errors import ConfigError, Forbidden, InputError, Unauthenticated
from btnode.protocol import MAX_NAME, PushHeader, receipt_statement

CA_KEY, CA_CERT = "ca.key", "ca.pem"
URI_PREFIX = "btnode:"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a worker id that is also a safe file name


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path | None  # None when the peer sent a CSR and keeps its key


def _write(path: Path, data: bytes, private: bool) -> None:
    """Write a new file (never over an existing one: a CA or key overwritten by mistake is lost)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    except FileExistsError:
        raise ConfigError(f"{path} exists already; remove it first if you mean to replace it") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _validity(builder: x509.CertificateBuilder, days: int, now: dt.datetime | None) -> x509.CertificateBuilder:
    if days < 1:
        raise InputError(f"a certificate must be valid for at least 1 day, not {days}")
    start = (now or dt.datetime.now(dt.timezone.utc)) - dt.timedelta(minutes=5)  # a little clock skew
    return builder.not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))


def init_ca(out: Path, *, name: str = "btnode swarm CA", days: int = 3650) -> Issued:
    """A new swarm CA in `out` (ca.key readable by its owner only, ca.pem to give every node)."""
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True))
    cert = _validity(builder, days, None).sign(key, hashes.SHA256())
    _write(out / CA_KEY, pem_key(key), private=True)
    _write(out / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return Issued(cert=out / CA_CERT, key=out / CA_KEY)


def _load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
    except OSError as exc:
        raise ConfigError(f"cannot read the swarm CA in {ca_dir} ({exc.strerror or exc}); make one with "
                          f"`btnode ca init --out {ca_dir}`") from None
    except ValueError as exc:
        raise ConfigError(f"{ca_dir} does not hold a swarm CA certificate and key in PEM: {exc}") from None
    return cert, key


def _public_key(csr: bytes | None) -> tuple[object, ec.EllipticCurvePrivateKey | None]:
    """The key to certify: a new one, or the one in the peer's CSR (checked: it must be signed by that key)."""
    if csr is None:
        key = ec.generate_private_key(ec.SECP256R1())
        return key.public_key(), key
    try:
        request = x509.load_pem_x509_csr(csr)
    except ValueError as exc:
        raise InputError(f"the certificate request is not a PEM CSR: {exc}") from None
    if not request.is_signature_valid:
        raise InputError("the certificate request's signature does not match its public key")
    return request.public_key(), None


def admit(ca_dir: Path, name: str, *, role: Role = Role.WORKER, out: Path, days: int = 365, hosts: tuple[str, ...] = (),
          csr: bytes | None = None, now: dt.datetime | None = None) -> Issued:
    """Sign a certificate for `name` with the swarm CA: out/NAME.pem, and out/NAME.key unless the
    peer sent its own CSR. `hosts` (DNS names or IP addresses) make it a server certificate too,
    for an aggregator or a stage that others dial. `now` exists for tests of expired certificates."""
    if not NAME.fullmatch(name) or len(name) > MAX_NAME:
        raise InputError(f"identity name {name!r}: use letters, digits, '.', '_' and '-' (at most {MAX_NAME})")
    ca_cert, ca_key = _load_ca(ca_dir)
    public, key = _public_key(csr)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if hosts else [])
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(ca_cert.subject).public_key(public).serial_number(x509.random_serial_number())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"{URI_PREFIX}{role.value}/{name}"),
                                                           *map(_host_name, hosts)]), critical=False))
    cert = _validity(builder, days, now).sign(ca_key, hashes.SHA256())
    out.mkdir(parents=True, exist_ok=True)
    if key is not None:
        _write(out / f"{name}.key", pem_key(key), private=True)
    _write(out / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)
    return Issued(cert=out / f"{name}.pem", key=out / f"{name}.key" if key is not None else None)


def _host_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


@dataclass(frozen=True)
class PeerCert:
    identity: Identity
    not_after: dt.datetime


@functools.lru_cache(maxsize=4096)
def _parse(pem: bytes) -> PeerCert:
    """Parse a verified peer certificate once (every RPC of a connection presents the same one)."""
    cert = x509.load_pem_x509_certificate(pem)
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name, role = (str(cn[0].value) if cn else ""), Role.WORKER
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    for uri in uris:
        if uri.startswith(URI_PREFIX) and "/" in uri:
            kind, _, name = uri[len(URI_PREFIX):].partition("/")
            role = Role(kind) if kind in Role._value2member_map_ else Role.WORKER
            break
    fingerprint = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
    return PeerCert(Identity(name=name, role=role, fingerprint=fingerprint), cert.not_valid_after_utc)


def peer_identity(context: grpc.ServicerContext) -> Identity:
    """The identity of the verified client certificate of this call. gRPC checked the chain and the
    dates at the handshake; the date is checked again here, because a connection may outlive its
    certificate."""
    pems = context.auth_context().get("x509_pem_cert") or []
    if not pems:
        raise Unauthenticated("this aggregator binds identities to client certificates, and the call carried none")
    peer = _parse(bytes(pems[0]))
    if not peer.identity.name:
        raise Forbidden("name", "the client certificate names no identity (no CN, no btnode URI)")
    if peer.not_after < dt.datetime.now(dt.timezone.utc):
        raise Forbidden("expired", f"the certificate of {peer.identity.name!r} expired at {peer.not_after:%Y-%m-%d %H:%M} UTC")
    return peer.identity


def sign(key_pem: bytes, statement: bytes) -> bytes:
    """ECDSA-SHA256 signature of `statement` with this node's private key (a worker signing its join
    or push receipt under mutual TLS: protocol.join_statement, push_statement)."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError("signing joins and pushes needs an EC key (as `btnode admit` makes)")
    return key.sign(statement, ec.ECDSA(hashes.SHA256()))


def verify_signed(ca_pem: bytes, cert_pem: bytes, signature: bytes, statement: bytes, name: str) -> Identity:
    """The identity of `cert_pem` once it is proven: issued by the swarm CA, in date, a worker's,
    naming `name`, and `signature` is its key's over `statement`. Raises Forbidden("signature")
    otherwise (a relay passing on a join or push it cannot prove)."""
    def refuse(why: str) -> Forbidden:
        return Forbidden("signature", f"the proof for {name!r} fails: {why}")

    try:
        ca = _ca_cert(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise refuse("its certificate is not PEM") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise refuse("its certificate is not issued by this swarm's CA") from None
    now = dt.datetime.now(dt.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise refuse(f"its certificate is not valid now (until {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC)")
    who = _parse(cert_pem).identity
    if who.name != name or who.role is not Role.WORKER:
        raise refuse(f"its certificate names {who.role.value} {who.name!r}")
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise refuse("its certificate's key is not an EC key")
    try:
        key.verify(signature, statement, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise refuse("the signature is not its key's over this statement") from None
    return who


def check_receipt(ca_pem: bytes, header: PushHeader, digest: str) -> Identity | None:
    """A check of a worker's signed push receipt once its frames' `digest` is known: at a relay as a
    child's push arrives (so that one child with a bad signature cannot get its relay's whole combined
    push refused upstream), and at the root for a child's update a relay passes on for a replay audit.
    Returns the worker's proven identity (None for a child relay's combined push)."""
    if header.manifest:
        return None  # a child relay's combined push: its entries carry their own receipts
    return verify_signed(ca_pem, header.cert, header.signature, receipt_statement(header, digest), header.worker_id)


@dataclass(frozen=True)
class Described:
    name: str
    role: Role
    public_key: bytes  # DER SubjectPublicKeyInfo


def describe(cert_pem: bytes, *, ca_pem: bytes | None = None) -> Described:
    """What a certificate names (and, with `ca_pem`, a check that that CA issued it): a node reading
    the identity it was given at enrollment (rpc/enroll.py)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        if ca_pem is not None:
            cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise Forbidden("certificate", f"not a certificate of this swarm's CA: {exc or type(exc).__name__}") from None
    who = _parse(cert_pem).identity
    return Described(who.name, who.role, cert.public_key().public_bytes(serialization.Encoding.DER,
                                                                       serialization.PublicFormat.SubjectPublicKeyInfo))


@functools.lru_cache(maxsize=8)
def _ca_cert(ca_pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(ca_pem)
