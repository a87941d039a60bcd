"""`Signatures`: what a relay passes on under mutual TLS must carry its workers' own signatures
(docs/security.md, "Relays"): a child's join, each manifest entry's push receipt, a child's update
passed on for a replay audit. The crypto is rpc/'s (`Verify`, rpc/certs.verify_signed); here, which
statement each must sign and what a refusal counts."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from btnode.aggregate.trust.evidence import noting_digest
from btnode.aggregate.trust.identities import Identities, Identity, Role, Verify
from btnode.codec.frames import ChunkData
from btnode.errors import Forbidden, PeerInputError
from btnode.protocol import PushHeader, push_statement, receipt_statement


class Signatures:
    """Refusals are counted (`identity_refused/<reason>`, through `count`) and raised."""

    def __init__(self, identities: Identities, count: Callable[[str, str], None]):
        self.identities, self._count = identities, count

    def admit(self, who: Identity, method: str, claimed: str = "") -> None:
        """Let a call of `who` through (trust/identities.py), or count its refusal and raise it."""
        try:
            self.identities.admit(who, method, claimed)
        except PeerInputError as exc:
            self._count("identity_refused", exc.reason)
            raise

    def proven(self, relay: Identity, worker_id: str, proof: tuple[bytes, bytes], statement: bytes,
               verify: Verify | None) -> Identity:
        """The worker's identity behind a join or push receipt that the relay `relay` passes on, once
        its certificate and signature prove it (`verify`); refused (Forbidden) otherwise."""
        if relay.role is not Role.RELAY:
            self.admit(relay, "Join", worker_id)  # refused (and recorded): one speaks only for its own name
        try:
            if not proof[0] or verify is None:
                raise Forbidden("signature", f"relay {relay.name} passes on {worker_id!r} without its signature "
                                             f"(under mutual TLS a worker signs what a relay passes on)")
            child = verify(proof[0], proof[1], statement, worker_id)
            self.identities.admit(child, "Join", worker_id)
        except PeerInputError as exc:
            self._count("identity_refused", exc.reason)
            raise
        return child

    def check_manifest(self, relay: Identity, header: PushHeader, verify: Verify | None) -> None:
        """Under mutual TLS each child update a relay lists must carry its worker's signed receipt,
        naming this block and the entry's base version, update id, samples, frames digest and claim
        digest; the relay may only weigh it down (staleness), never up."""
        for e in header.manifest:
            self.proven(relay, e.worker_id, (e.cert, e.signature), push_statement(
                e.worker_id, header.block, e.base_version, e.update_id, e.samples, e.sha256, e.claim_sha256), verify)
            if e.weight > e.samples * (1 + 1e-12):
                self._count("identity_refused", "signature")
                raise Forbidden("signature", f"relay {relay.name} weighs {e.worker_id}'s update {e.weight:g}; its "
                                             f"signed claim is {e.samples:g}")

    def receipted(self, header: PushHeader, chunks: Iterable[ChunkData], verify: Verify | None) -> Iterator[ChunkData]:
        """The chunks of a child's update a relay passes on, its worker's signed receipt checked
        against their frames once they are in (before the update is judged): Forbidden otherwise."""
        def proven(digest: str) -> None:
            try:
                if verify is None:
                    raise Forbidden("signature", "no swarm CA to check a passed-on update's receipt by")
                verify(header.cert, header.signature, receipt_statement(header, digest), header.worker_id)
            except PeerInputError as exc:
                self._count("identity_refused", exc.reason)
                raise
        return noting_digest(chunks, proven)
