"""Relay audits (docs/swarm.md, "Relays"): a parent draws a share of its relays' combined pushes
(HMAC of its secret and the update id, so a relay cannot tell which), holds each drawn one out of the
round, and asks the relay for its evidence: the frames of every update it combined, exactly as it
received them. Each direct child's frames must hash to its manifest entry; the updates are summed
again with the same Accumulator, weights and unit, and the mean must equal the pushed fp32 values
bit for bit (the sum is exact, so any honest relay passes whatever the order). A pass lets the held
push into the round; a mismatch, or no evidence in time, revokes the relay (its push stays out, and
its children's updates miss that round)."""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from btnode.aggregate.sums.accumulate import Accumulator, scaled
from btnode.aggregate.trust.audit import secret_draw
from btnode.codec.codecs import Codec, decode, encode
from btnode.codec.bundles import BundleHeader, frames_digest
from btnode.codec.frames import ChunkData, FrameAssembler
from btnode.errors import ConfigError, MalformedInput, PeerInputError
from btnode.protocol import EvidenceChild, PushHeader
from btnode.settings import flag

DENSE = (Codec.FP32, Codec.BF16, Codec.INT8)  # what a relay combines (aggregate/relay/forward.py)


@dataclass(frozen=True)
class RelayAuditConfig:
    rate: float = flag("--relay-audit-rate", "Share of relays' combined pushes checked bit for bit against their "
                                             "children's frames (0: none).", default=0.1)
    timeout_s: float = flag("--relay-audit-timeout", "Seconds a relay has to send the evidence of a combined push "
                                                     "drawn for audit, before it is revoked.", default=120.0)

    def __post_init__(self) -> None:
        if not 0 <= self.rate <= 1 or self.timeout_s <= 0:
            raise ConfigError(f"--relay-audit-rate must be in [0, 1] and --relay-audit-timeout positive: {self}")


def noting_digest(chunks: Iterable[ChunkData], then: Callable[[str], None]) -> Iterator[ChunkData]:
    """`chunks` as they come; once they end, `then(frames_digest)` of their frames (or the one their bundle
    declares, which the assembler checks), before whoever reads them goes on (it checks a signed receipt,
    or commits the update, before the update is judged)."""
    frames: dict[str, bytes] = {}
    declared = None
    for c in chunks:
        if isinstance(c.header, BundleHeader):
            declared = c.header.digest.hex()
        elif c.header is not None:
            frames[c.header.name] = c.header.sha256
        yield c
    then(declared if declared is not None else frames_digest(frames))


@dataclass
class RelayAuditJob:
    header: PushHeader  # the combined push, held out of its round
    pushed: dict[str, bytes]  # its codec bytes, as they arrived
    arrived: float
    amends: frozenset[str] = frozenset()  # the child updates of the relay's accepted combined update it replaces
    refused: str = ""  # why the last evidence for it was refused (kept waiting: it may be an impostor's)


class RelayAudits:
    """Drawn combined pushes waiting for their evidence."""

    def __init__(self, cfg: RelayAuditConfig, secret: bytes, clock: Callable[[], float]):
        self.cfg, self.secret, self.clock = cfg, secret, clock
        self._waiting: dict[str, RelayAuditJob] = {}
        self._lock = threading.Lock()

    def drawn(self, update_id: str) -> bool:
        return secret_draw(self.secret, "relay-audit\0" + update_id) < self.cfg.rate

    def open(self, header: PushHeader, pushed: Mapping[str, bytes], amends: frozenset[str] = frozenset()) -> None:
        with self._lock:
            self._waiting[header.update_id] = RelayAuditJob(header, dict(pushed), self.clock(), amends)

    def waiting_for(self, update_id: str) -> RelayAuditJob | None:
        with self._lock:
            return self._waiting.get(update_id)

    def close(self, update_id: str) -> RelayAuditJob | None:
        with self._lock:
            return self._waiting.pop(update_id, None)

    def expired(self) -> list[RelayAuditJob]:
        """Jobs whose evidence did not come within the timeout (still waiting: `close` takes each out)."""
        now = self.clock()
        with self._lock:
            return [j for j in self._waiting.values() if now - j.arrived > self.cfg.timeout_s]


def _group(spec: Mapping[str, tuple[int, ...]], child: EvidenceChild) -> FrameAssembler:
    if not child.update_id or not (math.isfinite(child.weight) and child.weight > 0):
        raise MalformedInput("evidence", f"evidence child {child.update_id[:16]!r}: no id, or weight {child.weight}")
    if not (math.isfinite(child.scale) and 0 < child.scale <= 1) or child.entries < 1:
        raise MalformedInput("evidence", f"evidence child {child.update_id[:16]!r}: scale {child.scale} outside (0, 1] "
                                         f"or {child.entries} entries")
    return FrameAssembler.for_spec(spec, DENSE)


def recombine(header: PushHeader, unit: float, parts: Iterable[EvidenceChild | ChunkData],
              spec: Mapping[str, tuple[int, ...]]) -> Accumulator:
    """The relay's sum again, from its evidence: each child update's frames (checked as a push's
    are), their digest against its manifest entry, and its weight against the entry's. Raises
    MalformedInput("evidence") on any disagreement, and MalformedInput("nested") for a child relay's
    combined update: the frames of the children it stands for never reached this relay, so nothing
    here can check them (docs/swarm.md: relays of relays are not audited)."""
    entries = header.manifest
    if not (unit > 0 and math.frexp(unit)[0] == 0.5):
        raise MalformedInput("evidence", f"the relay's weight unit {unit} is not a power of two")
    acc = Accumulator(spec, "all", unit=unit)
    at = 0
    child: EvidenceChild | None = None
    asm: FrameAssembler | None = None

    def finish() -> None:
        nonlocal at
        assert child is not None and asm is not None
        delta = asm.finish()
        covered = entries[at:at + child.entries]
        if len(covered) != child.entries:
            raise MalformedInput("evidence", f"the evidence lists more updates than the manifest's {len(entries)}")
        if child.entries != 1 or covered[0].update_id != child.update_id:
            raise MalformedInput("nested", f"update {child.update_id[:16]} stands for {child.entries} entries (a child "
                                           f"relay's combined update): its children's frames are not here")
        digest = frames_digest({n: hashlib.sha256(b).digest() for n, b in asm.raw.items()})
        if digest != covered[0].sha256 or child.weight != covered[0].weight:
            raise MalformedInput("evidence", f"the frames of {covered[0].worker_id}'s update {child.update_id[:16]} "
                                             f"are not those its manifest entry names (digest or weight)")
        acc.add(scaled(delta, child.scale) if child.scale != 1 else delta, child.weight)
        at += child.entries

    for part in parts:
        if isinstance(part, EvidenceChild):
            if child is not None:
                finish()
            child, asm = part, _group(spec, part)
        elif asm is None:
            raise MalformedInput("evidence", "evidence chunks before any child")
        else:
            asm.add(part)
    if child is not None:
        finish()
    if at != len(entries):
        raise MalformedInput("evidence", f"the evidence covers {at} of the manifest's {len(entries)} entries")
    return acc


def check_evidence(job: RelayAuditJob, unit: float, parts: Iterable[EvidenceChild | ChunkData],
                   spec: Mapping[str, tuple[int, ...]]) -> None:
    """Raise MalformedInput("evidence") unless the evidence recombines to the pushed values bit for
    bit (or "nested", see `recombine`)."""
    try:
        acc = recombine(job.header, unit, parts, spec)
    except PeerInputError as exc:
        if exc.reason in ("evidence", "nested"):
            raise
        raise MalformedInput("evidence", f"the evidence does not hold: {exc}") from exc
    for n, shape in spec.items():
        pushed = job.pushed[n]
        if job.header.codec is not Codec.FP32:
            pushed = encode(Codec.FP32, decode(job.header.codec, pushed, shape))
        if encode(Codec.FP32, acc.mean_of(n, release=True)) != pushed:
            raise MalformedInput("evidence", f"tensor {n} of the combined push is not the mean of its children's "
                                             f"updates")
