"""The root's side of what relays pass up for checking (docs/security.md, "Relay audits" and "Replay
audits through relays"): the commits of child updates under replay audits (`draw`, aggregate/commits.py)
and the evidence of combined pushes drawn for a relay audit (aggregate/evidence.py). A part of
`SwarmAggregator` (service.py), kept apart as the seam where relays meet the root's audits."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace

import torch

from btnode.aggregate.audit import Audits
from btnode.aggregate.block import INCOMPLETE, BlockAggregator
from btnode.aggregate.commits import Commits
from btnode.aggregate.evidence import RelayAuditJob, RelayAudits, check_evidence
from btnode.aggregate.identities import Identities, Identity
from btnode.aggregate.manifests import Relays
from btnode.codec.frames import ChunkData
from btnode.errors import Forbidden, MalformedInput, PeerInputError, Refused
from btnode.protocol import Drawn, EvidenceChild, Judgement, Meter, Outcome, PushHeader

log = logging.getLogger(__name__)
Tensors = Mapping[str, torch.Tensor]


class RelayChecks:
    """Mixed into SwarmAggregator, whose state and checks it uses (declared here for readers and tools)."""

    audits: Audits | None
    commits: Commits | None
    relay_audits: RelayAudits | None
    _recombining: threading.BoundedSemaphore  # relay audits' evidence summed one at a time
    blocks: dict[int, BlockAggregator]
    identities: Identities
    relays: Relays
    meter: Meter

    # -- replay audits through relays (aggregate/commits.py) ------------------------------------
    def draw(self, header: PushHeader, digest: str, relay: str = "") -> Drawn:
        """A relay commits a child's update before it counts it: `header` is the child's own push
        header, `digest` its frames' digest. Its claim is checked as a direct push's; then, drawn (always
        on probation, never when it could not be replayed), the relay pushes it as it came and it is judged
        and replayed here as a direct push, its chain advanced then; not drawn, its chain advances now and
        the answer carries the token its manifest entry must bring. Refusals are a direct push's, except
        that a broken chain does not revoke the worker: a relay could replay an old claim the worker
        signed, so the claim's order is not the worker's word here. `relay`: the caller's name under
        mutual TLS (its uncounted commits are counted by it: `settle_commits`)."""
        audits, commits, block = self.audits, self.commits, self.block(header.block)
        if audits is None or commits is None:
            raise Refused("no_audit", "this aggregator replays no audits: a relay counts its children without Draw")
        if header.manifest:
            raise MalformedInput("manifest", "a combined update is not drawn: its relay commits each child update")
        if self.identities.is_revoked(header.worker_id):
            raise Forbidden("revoked", f"worker {header.worker_id!r} was revoked")
        if (token := commits.known(header.update_id)) is not None:
            return Drawn(False, token)  # committed before (the relay failed over, or the child re-pushed)
        if block.answered(header.update_id) is not None:
            return Drawn(True)  # drawn and pushed here before: pushed again, it gets the same answer
        try:
            audits.check_chain(header)
            self._check_claim(block, header)
            self._check_key(header)
        except PeerInputError as exc:
            self.count("draws_refused", exc.reason)
            raise
        probation = audits.on_probation(header.worker_id) and self.training(header.worker_id) is not None
        if probation or (audits.drawn(header.update_id) and self.training(header.worker_id) is not None
                         and header.base_version == block.current()[0].version):
            self.count("draws", "drawn")
            commits.drew(header.update_id)
            return Drawn(True)
        audits.advance(header)
        self.count("draws", "committed")
        return Drawn(False, commits.commit(header, digest, relay))

    def check_passed_on(self, header: PushHeader) -> None:
        """Refused (`not_drawn`) unless a child's update that a relay pushes here in the child's name is
        one this root drew (Draw) and has not judged yet, or a re-push of one it judged: a relay cannot
        push a committed child update directly (its chain has moved on: the root would take it for a
        cheat), nor replay an old one."""
        if self.commits is None or not (self.commits.was_drawn(header.update_id)
                                        or self.block(header.block).answered(header.update_id) is not None):
            raise Refused("not_drawn", f"a relay pushes {header.worker_id}'s update {header.update_id[:16]!r} in its "
                                       f"name, which this aggregator did not draw for an audit")

    def settle_commits(self) -> None:
        """Count (`relay_uncounted`, by relay; logged) the committed child updates that their round's
        published version does not include: a relay that dropped one is seen here (aggregate/commits.py)."""
        if self.commits is None:
            return
        for b, block in self.blocks.items():
            current = block.current()[0].version
            published = {s.info.base_version: s.info for s in list(block.recent)}
            for v in self.commits.rounds(b):
                if v >= current:
                    continue
                info = published.get(v)
                for relay, n in self.commits.settle(b, info, v).items():
                    self.count("relay_uncounted", relay)
                    log.warning("%s round %d: %d child updates committed by relay %s are not in version %d (dropped "
                                "by the relay, refused there after their commit, or late)", block.name, v, n,
                                relay or "(unnamed: no mutual TLS)", info.version if info else -1)

    # -- relay audits (aggregate/evidence.py) --------------------------------------------------
    def _hold_for_evidence(self, block: BlockAggregator, header: PushHeader, delta: Tensors, raw: dict[str, bytes],
                           amends: frozenset[str]) -> Judgement:
        """A combined push drawn for a relay audit: judged in full, then held out of the round (PROBATION)
        until the relay's evidence recombines to it; the answer asks the relay for that evidence.
        `amends`: the child updates of the relay's combined update it replaces once it passes."""
        assert self.relay_audits is not None
        judged = block.submit(header, delta, raw=raw, hold=True, amends=amends)
        if judged.outcome is not Outcome.PROBATION:
            return judged
        self.relay_audits.open(header, raw, amends)
        self.count("relay_audits", "drawn")
        log.info("relay %s: combined push %s (%d children) drawn for audit; held until its evidence checks", header.worker_id,
                 header.update_id[:8], len(header.manifest))
        return replace(judged, audit=True)

    def submit_evidence(self, header: PushHeader, unit: float, parts: Iterable[EvidenceChild | ChunkData],
                        who: Identity | None = None) -> None:
        """A relay's evidence for its held combined push `header`: a pass lets the push into its round;
        a failure from the relay's proven identity (mutual TLS) revokes it at once. Without mutual TLS
        a failing stream is refused and the audit keeps waiting (anyone who saw the update id could
        send one), and fails at its timeout with the refusal's reason (`expire_relay_audits`)."""
        job = self.relay_audits.waiting_for(header.update_id) if self.relay_audits is not None else None
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
                check_evidence(job, unit, metered(), self.block(header.block).spec)
        except PeerInputError as exc:
            if exc.reason in INCOMPLETE:  # the stream broke: the relay may send it again
                raise
            job.refused = f"{exc.reason}: {exc}"
            if who is not None and who.name == header.worker_id:
                self._relay_verdict(job, exc.reason, str(exc))
            raise
        self._relay_verdict(job, "", "its children's frames recombine to its push bit for bit")

    def expire_relay_audits(self) -> None:
        """Fail the relay audits whose evidence did not come (or did not hold) in time."""
        if self.relay_audits is None:
            return
        for job in self.relay_audits.expired():
            reason, _, detail = job.refused.partition(": ")
            self._relay_verdict(job, reason or "timeout", detail or f"no evidence within "
                                                                     f"{self.acfg.relay_audit.timeout_s:g} s")

    def _relay_verdict(self, job: RelayAuditJob, failed: str, detail: str) -> None:
        """Pass (`failed` empty): the held push goes into its round, if that is still open. Fail: the
        relay is revoked and its push stays out (its children's updates miss this round)."""
        assert self.relay_audits is not None
        if self.relay_audits.close(job.header.update_id) is None:
            return  # another stream, or the expiry, judged it first
        h = job.header
        self.count("relay_audits", failed or "passed")
        if not failed:
            admitted = self.block(h.block).admit_held(h.update_id, amends=job.amends)
            if admitted:  # one that missed its round (or whose round changed) is neither counted nor refused
                self.relays.pushed(h, True, replaced=job.amends)
            log.info("relay audit of %s's combined push %s passed (%s)%s", h.worker_id, h.update_id[:8], detail,
                     "" if admitted else "; its round had closed: its children's updates missed it")
            return
        self.relays.pushed(h, False)
        if not self.identities.is_revoked(h.worker_id):  # (another of its pushes, an amendment, may fail too)
            self.identities.revoke(h.worker_id, seen_only=False)
            self.count("revoked", f"relay_{failed}")
        log.warning("relay %s revoked after a failed relay audit of combined push %s (%s): %s; the updates of its %d "
                    "children miss this round", h.worker_id, h.update_id[:8], failed, detail, len(h.manifest))
        self._drop(h.worker_id, f"relay_audit_{failed}")
