"""`LocalLink`: an Upstream that calls a SwarmAggregator in the same process.

Pushes still go through the wire format (frames compressed by the worker, then chunked and
validated by the aggregator's own FrameAssembler), so the only thing replaced is the network.
Pulls hand over the tensors directly; their Transfer counts fp32 bytes (nothing is compressed
in-process). A link built with `who` carries that proven identity, as mutual TLS would: its joins
and pushes are bound to it, and a push under another worker id is refused as the RPC layer refuses it.

Relays in process (sim/relays.py): a `ChildLink` is a worker's link to its relay, which signs the
worker's joins and push receipts as a worker's client does under mutual TLS; a `ParentLink` is a
relay's link to the root under the relay's identity, which checks what rpc/server.py checks of a
relay's calls (a child's join, commit or update passed on is proven by the child's signature). The
signatures are a `LocalCA`'s: keyed hashes, standing in for the swarm CA's certificates."""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace

import torch

from btnode.aggregate.service import SwarmAggregator
from btnode.aggregate.trust.identities import Identity, Role
from btnode.codec.codecs import Codec, decode
from btnode.codec.frames import Bundle, ChunkData, Frame, FrameAssembler, iter_chunks, stream_digest
from btnode.errors import Forbidden
from btnode.protocol import (Attestation, Drawn, Duties, EvidenceChild, JoinInfo, Judgement, Pulled, PushHeader,
                             RoundReceipt, Transfer, VersionInfo, join_statement, receipt_statement)

Spec = Mapping[str, tuple[int, ...]]
Tensors = dict[str, torch.Tensor]


class LocalLink:
    def __init__(self, agg: SwarmAggregator, who: Identity | None = None):
        self.agg = agg
        self.who = who
        self._ended: set[str] = set()  # workers whose watch streams were cancelled

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str = "", *,
             training_json: str = "") -> JoinInfo:
        if self.who is not None:
            self.agg.admit(self.who, "Join", worker_id)
        return self.agg.join(worker_id, block, fingerprint, config_json, data_id, self.who, training_json=training_json)

    def leave(self, worker_id: str, block: int) -> None:
        self.agg.leave(worker_id, block)

    def pull(self, block: int, worker_id: str, spec: Spec) -> Pulled:
        info, params = self.agg.block(block).current()
        size = sum(4 * math.prod(s) for s in spec.values())
        return Pulled(info=info, tensors={n: params[n].clone() for n in spec}, transfer=Transfer(raw=size, wire=size))

    def fetch_delta(self, block: int, version: int, spec: Spec) -> Pulled:
        info, codec, raw = self.agg.block(block).delta(version)
        size = sum(len(b) for b in raw.values())
        return Pulled(info=info, tensors={n: decode(codec, raw[n], spec[n]) for n in spec},
                      transfer=Transfer(raw=size, wire=size))

    def push(self, header: PushHeader, frames: Iterable[Frame]) -> Judgement:
        if self.who is not None and header.worker_id != self.who.name:  # (a revoked name: push refuses it itself)
            self.agg.admit(self.who, "Push", header.worker_id)
        return self.agg.push(header, iter_chunks(frames), who=self.who)

    def submit_state(self, header: PushHeader, frames: Iterable[Frame]) -> None:
        self.agg.submit_state(header, iter_chunks(frames))

    def watch(self, block: int, worker_id: str) -> Iterator[VersionInfo]:
        agg = self.agg.block(block)
        seen = -1
        self._ended.discard(worker_id)
        while worker_id not in self._ended:
            info = agg.wait_for(seen, timeout=1.0)
            if info is not None:
                seen = info.version
                yield info

    def receipt(self, block: int, worker_id: str, update_id: str) -> RoundReceipt | None:
        return self.agg.block(block).receipt(worker_id, update_id)

    def states_wanted(self, block: int, worker_id: str) -> tuple[str, ...]:
        return self.agg.replays.wanted(worker_id)

    def duties_waiting(self, block: int, worker_id: str) -> bool:
        return self.agg.delegated is not None and bool(self.agg.delegated.duties.get(self._me(worker_id)))

    def duties(self, block: int, worker_id: str) -> Duties:
        return self.agg.duties(self._me(worker_id))

    def verify_inputs(self, block: int, task_id: str, worker_id: str) -> tuple[Mapping[str, torch.Tensor], Tensors]:
        base, start = self.agg.verify_inputs(block, task_id, self._me(worker_id))
        return dict(base), {n: t.clone() for n, t in start.items()}

    def attest(self, block: int, attestation: Attestation) -> None:
        self.agg.attest(block, replace(attestation, verifier=self._me(attestation.verifier)))

    def submit_trace(self, block: int, task_id: str, worker_id: str, trace: tuple[str, ...], *,
                     proof: tuple[bytes, bytes] | None = None) -> None:
        self.agg.submit_trace(block, task_id, self._me(worker_id), trace)

    def submit_dispute_state(self, block: int, task_id: str, worker_id: str, k: int,
                             state: Mapping[str, torch.Tensor] | Iterable[ChunkData]) -> None:
        if not isinstance(state, Mapping):  # a relay passing a child's on, as it came
            asm = FrameAssembler.for_spec(self.agg.replayers[block].replay.state_spec(), [Codec.FP32])
            for chunk in state:
                asm.add(chunk)
            state = asm.finish()  # type: ignore[assignment] - fp32 frames: dense tensors
        self.agg.submit_dispute_state(task_id, self._me(worker_id), k, state)

    def _me(self, worker_id: str) -> str:
        """The caller's name: its proven identity's when it has one (as under mutual TLS), else what it says;
        a relay's child's when a relay calls for a child that pushes through it (as rpc/verification.py admits)."""
        if self.who is None:
            return worker_id
        if self.who.role is Role.RELAY and self.agg.relays_for(worker_id) == self.who.name:
            return worker_id
        return self.who.name

    def cancel_watches(self, worker_id: str) -> None:
        self._ended.add(worker_id)  # its watch loop returns within a second

    def close(self) -> None:
        pass


def identity(name: str, role: Role = Role.WORKER) -> Identity:
    """The identity a peer's certificate would prove: its name and role."""
    return Identity(name, role, hashlib.sha256(name.encode()).hexdigest())


class LocalCA:
    """The swarm CA in process: a peer's "certificate" is its name, its signature a keyed hash of the
    statement; `verify` is rpc/certs.verify_signed's counterpart (aggregate/trust/identities.Verify)."""

    def __init__(self, key: bytes):
        self.key = key

    def cert(self, name: str) -> bytes:
        return b"sim-cert\0" + name.encode()

    def sign(self, name: str, statement: bytes) -> bytes:
        return hmac.new(self.key, self.cert(name) + b"\0" + statement, hashlib.sha256).digest()

    def verify(self, cert: bytes, signature: bytes, statement: bytes, name: str) -> Identity:
        if cert != self.cert(name):
            raise Forbidden("signature", f"the certificate passed on does not name {name!r}")
        if not hmac.compare_digest(signature, self.sign(name, statement)):
            raise Forbidden("signature", f"{name!r}'s signature does not cover what was passed on")
        return identity(name)

    def check_receipt(self, header: PushHeader, digest: str) -> Identity:
        """A child's push receipt, as a relay checks it under mutual TLS (rpc/certs.check_receipt)."""
        return self.verify(header.cert, header.signature, receipt_statement(header, digest), header.worker_id)


class ChildLink(LocalLink):
    """A worker's link to its relay: a LocalLink whose calls are timed (`seconds`: the relay's work, and the
    root's when the relay calls it), and, given the `ca`, whose joins and push receipts are signed (a
    worker's client does so under mutual TLS), so that the relay can pass them on to the root."""

    def __init__(self, agg: SwarmAggregator, who: Identity | None, ca: LocalCA | None):
        super().__init__(agg, who)
        self.ca = ca
        self.seconds = 0.0

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str = "", *,
             training_json: str = "") -> JoinInfo:
        if self.who is None or self.ca is None:
            return super().join(worker_id, block, fingerprint, config_json, data_id, training_json=training_json)
        proof = (self.ca.cert(worker_id), self.ca.sign(worker_id, join_statement(worker_id, block, fingerprint, data_id,
                                                                                 training_json)))
        self.agg.admit(self.who, "Join", worker_id)
        return self.agg.join(worker_id, block, fingerprint, config_json, data_id, self.who, training_json=training_json,
                             proof=proof)

    def push(self, header: PushHeader, frames: Iterable[Frame | Bundle]) -> Judgement:
        frames = list(frames)  # the receipt signs the frames' digest, which the header carries before them
        if self.ca is not None and not header.signature:
            digest = stream_digest(frames)
            header = replace(header, cert=self.ca.cert(header.worker_id),
                             signature=self.ca.sign(header.worker_id, receipt_statement(header, digest)))
        t0 = time.perf_counter()  # (the worker's compression and signature above are its own work)
        try:
            return super().push(header, frames)
        finally:
            self.seconds += time.perf_counter() - t0

    def pull(self, block: int, worker_id: str, spec: Spec) -> Pulled:
        t0 = time.perf_counter()
        try:
            return super().pull(block, worker_id, spec)
        finally:
            self.seconds += time.perf_counter() - t0

    def fetch_delta(self, block: int, version: int, spec: Spec) -> Pulled:
        t0 = time.perf_counter()
        try:
            return super().fetch_delta(block, version, spec)
        finally:
            self.seconds += time.perf_counter() - t0

    def submit_state(self, header: PushHeader, frames: Iterable[Frame]) -> None:
        t0 = time.perf_counter()
        try:
            super().submit_state(header, frames)
        finally:
            self.seconds += time.perf_counter() - t0


class ParentLink(LocalLink):
    """A relay's link to the root (the Upstream of its UpstreamAdmission), under the relay's identity `who`
    (Role.RELAY; None: no mutual TLS). What rpc/server.py checks of a relay's calls is checked here: a
    child's join or commit passed on must carry the child's signature (`verify`, the CA's), and so must
    each entry of a combined push and a child's update passed on for a replay audit. `seconds`: the time
    spent in the root's code, which a relay's meter takes out of its own."""

    def __init__(self, agg: SwarmAggregator, who: Identity | None, verify: LocalCA | None):
        super().__init__(agg, who)
        self.verify = verify.verify if verify is not None else None
        self.seconds = 0.0

    def _timed(self, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str = "", *,
             training_json: str = "", relay: bool = False, proof: tuple[bytes, bytes] | None = None) -> JoinInfo:
        return self._timed(self._join, worker_id, block, fingerprint, config_json, data_id, training_json, relay, proof)

    def _join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str, training_json: str,
              relay: bool, proof: tuple[bytes, bytes] | None) -> JoinInfo:
        who = self.who
        if who is not None:
            self.agg.admit(who, "Join", "" if proof is not None and not relay else worker_id)
            if who.name != worker_id:  # a relay passing on a worker's join
                who = self.agg.proven(who, worker_id, proof or (b"", b""),
                                      join_statement(worker_id, block, fingerprint, data_id, training_json), self.verify)
        return self.agg.join(worker_id, block, fingerprint, config_json, data_id, who, training_json=training_json,
                             relay=relay, proof=proof)

    def leave(self, worker_id: str, block: int) -> None:
        if self.who is not None:
            self.agg.admit(self.who, "Leave")  # a relay tells the root that a child's stream ended
        self._timed(self.agg.leave, worker_id, block)

    def pull(self, block: int, worker_id: str, spec: Spec) -> Pulled:
        return self._timed(super().pull, block, worker_id, spec)

    def fetch_delta(self, block: int, version: int, spec: Spec) -> Pulled:
        """As LocalLink's, with the delta's codec bytes, which the relay stores and serves to its children."""
        def fetch() -> Pulled:
            info, codec, raw = self.agg.block(block).delta(version)
            size = sum(len(b) for b in raw.values())
            return Pulled(info=info, tensors={n: decode(codec, raw[n], spec[n]) for n in spec},
                          transfer=Transfer(raw=size, wire=size), raw=dict(raw))
        return self._timed(fetch)

    def _admitted(self, method: str, header: PushHeader) -> None:
        if self.who is not None:  # a relay passes a child's update (or its state) on in the child's name
            self.agg.admit(self.who, method)
            self.agg.admit(self.who, method, "" if self.who.passes_on(header) else header.worker_id, counted=False)

    def push(self, header: PushHeader, frames: Iterable[Frame]) -> Judgement:
        self._admitted("Push", header)
        return self._timed(self.agg.push, header, iter_chunks(frames), who=self.who, verify=self.verify)

    def draw(self, header: PushHeader, digest: str, relay: str = "", *, refused: bool = False) -> Drawn:
        def drawn() -> Drawn:
            if self.who is not None:
                self.agg.admit(self.who, "Draw")
                if self.who.name != header.worker_id:
                    self.agg.proven(self.who, header.worker_id, (header.cert, header.signature),
                                    receipt_statement(header, digest), self.verify)
            return self.agg.draw(header, digest, relay=self.who.name if self.who is not None else relay, refused=refused)
        return self._timed(drawn)

    # the children's verification calls, passed on in their names (LocalLink's `_me` admits a relay's child)
    def duties(self, block: int, worker_id: str) -> Duties:
        return self._timed(super().duties, block, worker_id)

    def verify_inputs(self, block: int, task_id: str, worker_id: str) -> tuple[Mapping[str, torch.Tensor], Tensors]:
        return self._timed(super().verify_inputs, block, task_id, worker_id)

    def attest(self, block: int, attestation: Attestation) -> None:
        self._timed(super().attest, block, attestation)

    def submit_trace(self, block: int, task_id: str, worker_id: str, trace: tuple[str, ...], *,
                     proof: tuple[bytes, bytes] | None = None) -> None:
        self._timed(super().submit_trace, block, task_id, worker_id, trace)

    def submit_dispute_state(self, block: int, task_id: str, worker_id: str, k: int,
                             state: Mapping[str, torch.Tensor] | Iterable[ChunkData]) -> None:
        self._timed(super().submit_dispute_state, block, task_id, worker_id, k, state)

    def submit_state(self, header: PushHeader, frames: Iterable[Frame | ChunkData]) -> None:
        self._admitted("SubmitState", header)
        chunks = (c for f in frames for c in ([f] if isinstance(f, ChunkData) else iter_chunks([f])))
        self._timed(self.agg.submit_state, header, chunks)

    def submit_evidence(self, header: PushHeader, unit: float, parts: Iterable[EvidenceChild | Frame]) -> None:
        if self.who is not None:
            self.agg.admit(self.who, "SubmitEvidence")
            self.agg.identities.admit(self.who, "SubmitEvidence", header.worker_id)
        chunked = (c for p in parts for c in ([p] if isinstance(p, EvidenceChild) else iter_chunks([p])))
        self._timed(self.agg.submit_evidence, header, unit, chunked, who=self.who)
