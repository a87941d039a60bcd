"""`RelayReview`: the root's relay audits (docs/security.md, "Relay audits"): a relay's combined push
drawn for one is held out of its round until the relay's evidence (its children's frames, as they
came) recombines to it bit for bit (aggregate/trust/evidence.py); a failed or missing one revokes the relay."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace

import torch

from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.trust.evidence import RelayAuditConfig, RelayAuditJob, RelayAudits, check_evidence
from btnode.aggregate.trust.identities import Identities, Identity
from btnode.aggregate.trust.manifests import Relays
from btnode.codec.frames import ChunkData
from btnode.errors import MalformedInput, PeerInputError
from btnode.protocol import INCOMPLETE, EvidenceChild, Judgement, Meter, Outcome, PushHeader

log = logging.getLogger(__name__)
Tensors = Mapping[str, torch.Tensor]


class RelayReview:
    """The relay audits of one aggregator, with what they act on: the blocks (`block`), the identities
    a failure revokes, the relays' records, the metered ingress, the swarm's event counts (`count`), and
    `drop`, which takes a revoked relay's updates out of the open rounds."""

    def __init__(self, cfg: RelayAuditConfig, secret: bytes, clock: Callable[[], float], *,
                 block: Callable[[int], BlockAggregator], identities: Identities, relays: Relays, meter: Meter,
                 count: Callable[[str, str], None], drop: Callable[[str, str], None]):
        self.audits = RelayAudits(cfg, secret, clock)
        self._block, self.identities, self.relays, self.meter = block, identities, relays, meter
        self._count, self._drop = count, drop
        # evidence is summed again one relay at a time: each recombination holds an exact int64 sum (2 ×
        # the unit) and a child's update, and several at once grow a root's memory (bench/scale.py)
        self._recombining = threading.BoundedSemaphore(1)

    def hold(self, block: BlockAggregator, header: PushHeader, delta: Tensors, raw: dict[str, bytes],
             amends: frozenset[str]) -> Judgement:
        """A combined push drawn for a relay audit: judged in full, then held out of the round (PROBATION)
        until the relay's evidence recombines to it; the answer asks the relay for that evidence.
        `amends`: the child updates of the relay's combined update it replaces once it passes."""
        judged = block.submit(header, delta, raw=raw, hold=True, amends=amends)
        if judged.outcome is not Outcome.PROBATION:
            return judged
        self.audits.open(header, raw, amends)
        self._count("relay_audits", "drawn")
        log.info("relay %s: combined push %s (%d children) drawn for audit; held until its evidence checks", header.worker_id,
                 header.update_id[:8], len(header.manifest))
        return replace(judged, audit=True)

    def submit_evidence(self, header: PushHeader, unit: float, parts: Iterable[EvidenceChild | ChunkData],
                        who: Identity | None = None) -> None:
        """A relay's evidence for its held combined push `header`: a pass lets the push into its round;
        a failure from the relay's proven identity (mutual TLS) revokes it at once. Without mutual TLS
        a failing stream is refused and the audit keeps waiting (anyone who saw the update id could
        send one), and fails at its timeout with the refusal's reason (`expire_relay_audits`)."""
        job = self.audits.waiting_for(header.update_id)
        if job is None or job.header.worker_id != header.worker_id or job.header.block != header.block:
            raise MalformedInput("no_audit", f"no relay audit waits for the evidence of {header.update_id[:16]!r} of "
                                             f"{header.worker_id!r}")
        def metered() -> Iterator[EvidenceChild | ChunkData]:  # evidence is ingress too (bench/scale.py reads it)
            for part in parts:
                if isinstance(part, ChunkData):
                    self.meter.count(("received", "wire"), len(part.data))
                yield part

        try:
            with self._recombining:  # one at a time; the others' streams wait unread (flow control)
                check_evidence(job, unit, metered(), self._block(header.block).spec)
        except PeerInputError as exc:
            if exc.reason in INCOMPLETE:  # the stream broke: the relay may send it again
                raise
            job.refused = f"{exc.reason}: {exc}"
            if who is not None and who.name == header.worker_id:
                self._relay_verdict(job, exc.reason, str(exc))
            raise
        self._relay_verdict(job, "", "its children's frames recombine to its push bit for bit")

    def expire(self) -> None:
        """Fail the relay audits whose evidence did not come (or did not hold) in time."""
        for job in self.audits.expired():
            reason, _, detail = job.refused.partition(": ")
            self._relay_verdict(job, reason or "timeout", detail or f"no evidence within "
                                                                     f"{self.audits.cfg.timeout_s:g} s")

    def _relay_verdict(self, job: RelayAuditJob, failed: str, detail: str) -> None:
        """Pass (`failed` empty): the held push goes into its round, if that is still open. Fail: the
        relay is revoked and its push stays out (its children's updates miss this round)."""
        if self.audits.close(job.header.update_id) is None:
            return  # another stream, or the expiry, judged it first
        h = job.header
        self._count("relay_audits", failed or "passed")
        if not failed:
            admitted = self._block(h.block).admit_held(h.update_id, amends=job.amends)
            if admitted:  # one that missed its round (or whose round changed) is neither counted nor refused
                self.relays.pushed(h, True, replaced=job.amends)
            log.info("relay audit of %s's combined push %s passed (%s)%s", h.worker_id, h.update_id[:8], detail,
                     "" if admitted else "; its round had closed: its children's updates missed it")
            return
        self.relays.pushed(h, False)
        if not self.identities.is_revoked(h.worker_id):  # (another of its pushes, an amendment, may fail too)
            self.identities.revoke(h.worker_id, seen_only=False)
            self._count("revoked", f"relay_{failed}")
        log.warning("relay %s revoked after a failed relay audit of combined push %s (%s): %s; the updates of its %d "
                    "children miss this round", h.worker_id, h.update_id[:8], failed, detail, len(h.manifest))
        self._drop(h.worker_id, f"relay_audit_{failed}")
