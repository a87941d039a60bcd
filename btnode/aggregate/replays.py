"""`ReplayDesk`: the root's replay audits (docs/security.md, "Work claims and replay audits"): updates
drawn for one (held out of their round until the verdict), their start states, the verdicts of its
`Verifier`, the punishment of a failed one and the repair of the rounds it pushed to
(round/repairs.py); and the commits of child updates relays pass up under them (`draw`,
aggregate/trust/commits.py).

Later audits (`review`, `_later`): an update is also replayed after its push was answered, from the
round's kept spill and base, when the screen dropped it at close (a cheat the screen caught is still a
cheat: its sender is revoked, not just outvoted), and when a failed audit finds its round attacked
(every update of every kept round the cheat pushed to, and of the round open then, once it closes:
the cheat's other identities are among their senders, and what they added is taken back by the
repair). Its sender hears of it with the next version (states_wanted) and sends the start state it
kept (swarm/worker.py STATES_KEPT); one that never does is not judged, only put on probation again
(it may have left: `Audits.unanswered`)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import torch

from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.round.intake import Intake
from btnode.aggregate.round.repairs import ClosedRound
from btnode.aggregate.round.rounds import Update
from btnode.aggregate.trust.audit import AuditConfig, AuditJob, Audits, Verdict, Verifier
from btnode.aggregate.trust.commits import Commits
from btnode.aggregate.trust.identities import Identities
from btnode.codec.codecs import Codec
from btnode.codec.frames import ChunkData
from btnode.errors import Forbidden, MalformedInput, PeerInputError, Refused
from btnode.protocol import Drawn, Judgement, Outcome, PushHeader
from btnode.train.terms import TrainingTerms

log = logging.getLogger(__name__)
Tensors = Mapping[str, torch.Tensor]
HEADERS_KEPT = 8192  # headers of unaudited updates kept for later audits: a few rounds of a large swarm's pushes


class ReplayDesk:
    """The audits of one aggregator (`audits`, `commits`, `verifier`: None with audits off), with what
    they act on: its blocks, the identities a failure revokes, the workers' training terms (`training`),
    the data keys' swarm data id (`data_id`), the key check of a direct push (`check_key`) and the
    swarm's event counts (`count`). The round sees only held updates admitted or dropped; who decides
    them is the `Verifier` (aggregate/trust/audit.py)."""

    def __init__(self, cfg: AuditConfig, audits: Audits | None, commits: Commits | None, verifier: Verifier | None,
                 *, clock: Callable[[], float], blocks: Mapping[int, BlockAggregator],
                 block: Callable[[int], BlockAggregator], identities: Identities, intake: Intake,
                 training: Callable[[str], TrainingTerms | None], data_id: Callable[[], str | None],
                 check_key: Callable[[PushHeader], None], count: Callable[..., None]):
        self.cfg, self.audits, self.commits, self.verifier, self.clock = cfg, audits, commits, verifier, clock
        self.blocks, self._block, self.identities, self.intake = blocks, block, identities, intake
        self._training, self._data_id, self._check_key, self._count = training, data_id, check_key, count
        self.headers: OrderedDict[str, PushHeader] = OrderedDict()  # update id → header, of unaudited direct pushes
        self.reviewed: dict[int, int] = {}  # block → the last closed round `review` looked at
        self.attacked: dict[int, set[int]] = {}  # block → rounds open when an audit failed: verified in full at close

    # -- replay audits through relays (aggregate/trust/commits.py) ------------------------------------
    def draw(self, header: PushHeader, digest: str, relay: str = "", *, refused: bool = False) -> Drawn:
        """A relay commits a child's update before it counts it: `header` is the child's own push
        header, `digest` its frames' digest. Its claim is checked as a direct push's; then, drawn (always
        on probation, never when it could not be replayed), the relay pushes it as it came and it is judged
        and replayed here as a direct push, its chain advanced then; not drawn, its chain advances now and
        the answer carries the token its manifest entry must bring. Refusals are a direct push's, except
        that a broken chain does not revoke the worker: a relay could replay an old claim the worker
        signed, so the claim's order is not the worker's word here. `relay`: the caller's name under
        mutual TLS (its uncounted commits are counted by it: `settle_commits`). `refused`: the relay
        answered the update LATE or STALE without counting it: its claim is checked and the chain moves on,
        as for a direct push answered so (else the worker's next claim would read as a broken chain)."""
        audits, commits, block = self.audits, self.commits, self._block(header.block)
        if audits is None or commits is None:
            raise Refused("no_audit", "this aggregator replays no audits: a relay counts its children without Draw")
        if header.manifest:
            raise MalformedInput("manifest", "a combined update is not drawn: its relay commits each child update")
        if self.identities.is_revoked(header.worker_id):
            raise Forbidden("revoked", f"worker {header.worker_id!r} was revoked")
        if (token := commits.known(header.update_id)) is not None:
            return Drawn(False, token)  # committed before (the relay failed over, or the child re-pushed)
        if refused:
            try:
                audits.check_chain(header)
                self.check_claim(block, header)
            except PeerInputError as exc:
                self._count("draws_refused", exc.reason)
                raise
            audits.advance(header)
            self._count("draws", "refused_at_relay")
            return Drawn(False)
        if block.answered(header.update_id) is not None:
            return Drawn(True)  # drawn and pushed here before: pushed again, it gets the same answer
        try:
            audits.check_chain(header)
            self.check_claim(block, header)
            self._check_key(header)
        except PeerInputError as exc:
            self._count("draws_refused", exc.reason)
            raise
        probation = audits.on_probation(header.worker_id) and self._training(header.worker_id) is not None
        if probation or (self._training(header.worker_id) is not None and header.base_version ==
                         block.current()[0].version and audits.drawn(header.update_id, header.worker_id)):
            self._count("draws", "drawn")
            commits.drew(header.update_id)
            return Drawn(True)
        audits.advance(header)
        self._count("draws", "committed")
        return Drawn(False, commits.commit(header, digest, relay))

    def check_passed_on(self, header: PushHeader) -> None:
        """Refused (`not_drawn`) unless a child's update that a relay pushes here in the child's name is
        one this root drew (Draw) and has not judged yet, or a re-push of one it judged: a relay cannot
        push a committed child update directly (its chain has moved on: the root would take it for a
        cheat), nor replay an old one."""
        if self.commits is None or not (self.commits.was_drawn(header.update_id)
                                        or self._block(header.block).answered(header.update_id) is not None):
            raise Refused("not_drawn", f"a relay pushes {header.worker_id}'s update {header.update_id[:16]!r} in its "
                                       f"name, which this aggregator did not draw for an audit")

    def settle_commits(self) -> None:
        """Count (`relay_uncounted`, by relay; logged) the committed child updates that their round's
        published version does not include: a relay that dropped one is seen here (aggregate/trust/commits.py)."""
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
                    self._count("relay_uncounted", relay)
                    log.warning("%s round %d: %d child updates committed by relay %s are not in version %d (dropped "
                                "by the relay, refused there after their commit, or late)", block.name, v, n,
                                relay or "(unnamed: no mutual TLS)", info.version if info else -1)

    def punish(self, worker_id: str, reason: str, detail: str) -> None:
        """A failed audit, a late or wrong start state, a broken chain, or a call in another's name: revoke
        the worker (its certificate's name, or its worker id without mutual TLS), drop its pending updates
        and take back what it added in the kept rounds (`repair`)."""
        self.identities.revoke(worker_id, seen_only=False)
        self._count("revoked", reason)
        log.warning("worker %s revoked (%s): %s", worker_id, reason, detail)
        self.drop(worker_id, f"audit_{reason}")
        self.repair(reason)

    def repair(self, reason: str) -> None:
        """Evidence of an attack on the kept rounds of some block (a failed audit, or a revocation):
        each block takes every revoked sender out of them (BlockAggregator.repair; counted `repairs`),
        and every other sender of a repaired round becomes a suspect, its next updates all audited
        (Audits.suspect): the cheat's other ids are among them."""
        for agg in self.blocks.values():
            fix = agg.repair(self.identities.is_revoked)
            if fix is None:
                continue
            self._count("repairs", reason)
            if self.audits is not None:
                new = self.audits.suspect(w for w in fix.others if not self.identities.is_revoked(w))
                if new:
                    log.warning("%s: after the repair of rounds %s, the next %d updates of %s are all audited",
                                agg.name, fix.rounds, self.cfg.window, ", ".join(sorted(new)))

    def abandoned(self, worker_id: str, over: int) -> None:
        """It rejoined while an audit waited for its start state (aggregate/trust/audit.py Audits.joined):
        its update still in an open round is dropped (it cannot be audited now), and once it has
        abandoned more than it is forgiven (`over` > 0) it is revoked and refused (Forbidden)."""
        for agg in self.blocks.values():
            agg.drop(worker_id, "audit_abandoned")
        log.warning("worker %s rejoined without sending the start state of an update drawn for audit (%s): on "
                    "probation again", worker_id, "forgiven" if over <= 0 else "over its allowance")
        if over > 0:
            self.punish(worker_id, "abandoned", "more audits abandoned by rejoining than it is forgiven")
            raise Forbidden("revoked", f"worker {worker_id!r} was revoked: it left audits without its state once too "
                                       f"often")

    def drop(self, worker_id: str, reason: str) -> None:
        for agg in self.blocks.values():
            agg.drop(worker_id, reason)
        if self.audits is not None:
            self.audits.forget(worker_id)
        if self.verifier is not None:
            self.verifier.forget(worker_id)

    # -- audits -------------------------------------------------------------------------------
    def submit_state(self, header: PushHeader, chunks: Iterable[ChunkData]) -> None:
        """The start state of an update drawn for audit (Upstream.submit_state). Refused
        (MalformedInput) when no audit waits for it, or when it is not the state the claim committed
        to; the audit then keeps waiting, and fails only if no right state comes in time. A wrong state
        does not fail it at once: without mutual TLS anyone who saw the update id could send one."""
        job = self.audits.waiting_for(header.update_id) if self.audits is not None else None
        if job is None or job.header.worker_id != header.worker_id or job.header.block != header.block:
            raise MalformedInput("no_audit", f"no audit waits for the state of update {header.update_id[:16]!r} "
                                             f"of {header.worker_id!r}")
        assert self.verifier is not None
        block = job.header.block
        state, _ = self.intake.assemble(self.verifier.start_spec(block, job.claim), Codec.FP32, chunks)
        self.verifier.check_start(block, job.claim, state)
        self.audits.received(header.update_id, state)

    def run_audits(self) -> list[Verdict]:
        """Hand the verifier every audit whose start state is in, fail those whose state is late, and act
        on the verdicts reached; returns them."""
        if self.audits is None or self.verifier is None:
            return []
        self.settle_commits()
        self.review()
        ready, late = self.audits.due()
        verdicts = [Verdict(j.header, False, "late_state", f"no start state within {self.cfg.state_timeout_s:g} s",
                            0.0, j.probation, self.clock() - j.arrived) for j in late if not j.later]
        for j in late:
            if j.later and not self.identities.is_revoked(j.header.worker_id):
                self._unanswered(j)
        for job in ready:
            if not self.identities.is_revoked(job.header.worker_id):
                self.verifier.submit(job)
        verdicts += [v for v in self.verifier.verdicts() if not self.identities.is_revoked(v.header.worker_id)]
        for v in verdicts:
            self._verdict(v)
        for b in {v.header.block for v in verdicts if v.passed}:
            self._block(b).tick()  # the batch is in: a round due to close closes now, with all of it
        offenders, credits = self.verifier.outcomes()
        for name, n in credits.items():
            self.audits.credit(name, n)
        for name, reason, detail in offenders:  # delegated verification: a verifier that lied (trust/delegate.py)
            if not self.identities.is_revoked(name):
                self.punish(name, reason, detail)
        return verdicts

    def _verdict(self, v: Verdict) -> None:
        assert self.audits is not None
        self.audits.record(v)
        self.identities.audited(v.header.worker_id, v.passed)
        if v.passed:
            log.info("audit of %s's update on version %d passed (%s%s)", v.header.worker_id, v.header.base_version,
                     v.detail, ", probation" if v.probation else "")
            self._block(v.header.block).admit_held(v.header.update_id, close=False)  # held until now (probation, drawn)
        else:
            rounds = self._attacked(v.header.block, v.header.worker_id)
            self.punish(v.header.worker_id, v.reason, v.detail)
            self._verify(v.header.block, rounds)

    def _unanswered(self, job: AuditJob) -> None:
        over = self.audits.unanswered(job) if self.audits is not None else 0
        log.warning("worker %s sent no start state for the later audit of its update on version %d: on probation "
                    "again (%s)", job.header.worker_id, job.header.base_version,
                    "forgiven" if over <= 0 else "over its allowance")
        if over > 0:
            self.punish(job.header.worker_id, "abandoned", "more audits left without their state than it is forgiven")

    # -- later audits ----------------------------------------------------------------------------
    def remember(self, header: PushHeader) -> None:
        """A direct push taken into its round unaudited, on the current version: kept, so that a later
        audit can replay it (its codec bytes are in the round's spill)."""
        self.headers[header.update_id] = header
        while len(self.headers) > HEADERS_KEPT:
            self.headers.popitem(last=False)

    def wanted(self, worker_id: str) -> tuple[str, ...]:
        """The start states `worker_id` is asked for with the next version (its later audits waiting)."""
        return self.audits.wanted(worker_id) if self.audits is not None else ()

    def review(self) -> None:
        """Open the later audits of rounds closed since the last look: the updates the screen dropped, and
        every update of a round that was open when an audit failed."""
        if self.audits is None:
            return
        for b, agg in self.blocks.items():
            with agg.lock:
                if agg.repairs is None:
                    continue
                for r in [r for r in agg.repairs.rounds if r.version > self.reviewed.get(b, -1)]:
                    attacked = r.version in self.attacked.get(b, set())
                    self.attacked.get(b, set()).discard(r.version)
                    for u in (*r.kept, *r.dropped) if attacked else r.dropped:
                        self._later(agg.name, r, u, "attacked" if attacked else "dropped")
                    self.reviewed[b] = r.version

    def _attacked(self, block: int, worker_id: str) -> list[ClosedRound]:
        """A failed audit of `worker_id`: the kept rounds it pushed to (found before the repair takes it out
        of them), and the open round marked, to be verified in full once it closes (`review`)."""
        agg = self._block(block)
        with agg.lock:
            self.attacked.setdefault(block, set()).add(agg.round.version)
            return [r for r in agg.repairs.rounds if worker_id in r.senders()] if agg.repairs is not None else []

    def _verify(self, block: int, rounds: list[ClosedRound]) -> None:
        agg = self._block(block)
        with agg.lock:
            for r in rounds:
                for u in (*r.kept, *r.dropped):
                    self._later(agg.name, r, u, "attacked")

    def _later(self, name: str, r: ClosedRound, u: Update, why: str) -> None:
        """A later audit of `u`, of closed round `r` (the block's lock held: the spill stays open). Only an
        update pushed here directly and not audited yet, on the round's base, with its bytes as pushed."""
        assert self.audits is not None
        header = self.headers.pop(u.update_id, None)
        terms = self._training(u.worker_id)
        if (header is None or header.claim is None or header.base_version != r.version or terms is None
                or r.base is None or r.tally.holds_updates or u.spilled is None or u.manifest
                or self.identities.is_revoked(u.worker_id)):
            return
        job = AuditJob(header=header, claim=header.claim, train=terms.train, raw=r.tally.spill.get(u.spilled),
                       base=r.base, arrived=self.clock(), probation=False, later=True)
        self.audits.open(job)
        self._count("later_audits", why)
        log.info("%s round %d: audits the update of %s after its close (%s)", name, r.version,
                 u.worker_id, "dropped by the screen" if why == "dropped" else "its round was attacked")

    def holds(self, block: BlockAggregator, header: PushHeader, probation: bool) -> bool:
        """Whether a direct push is audited, and so held out of its round until the verdict: always on
        probation; else drawn at p (for sure while its sender is a suspect), when it can be replayed (its
        sender's terms are known and it is based on the current version). Call once per update."""
        assert self.audits is not None
        return probation or (self._training(header.worker_id) is not None
                             and header.base_version == block.current()[0].version
                             and self.audits.drawn(header.update_id, header.worker_id))

    def open_audit(self, block: BlockAggregator, header: PushHeader, raw: dict[str, bytes], base: Tensors,
                   judged: Judgement, probation: bool, held: bool) -> Judgement:
        """An update `holds` chose for audit: keep what the verifier needs, and ask for its start state."""
        assert self.audits is not None and header.claim is not None
        if judged.outcome not in (Outcome.PENDING, Outcome.PROBATION) or not held:
            return judged
        terms = self._training(header.worker_id)
        if terms is None:  # it joined before this aggregator restarted: its settings are unknown until it rejoins
            return judged
        job = AuditJob(header=header, claim=header.claim, train=terms.train, raw=raw, base=base, arrived=self.clock(),
                       probation=probation)
        return replace(judged, audit=self.audits.open(job))

    def check_claim(self, block: BlockAggregator, header: PushHeader) -> None:
        """A work claim must name the swarm's data and, for the current version, its hash: a replay
        could not start from anything else."""
        claim = header.claim
        assert claim is not None  # check_chain refused a push without one
        data_id = self._data_id()
        if data_id and claim.data_id != data_id:
            raise MalformedInput("claim", f"{header.worker_id} claims data {claim.data_id[:24]!r}, the swarm trains on "
                                          f"{data_id[:24]!r}")
        info = block.current()[0]
        if header.base_version == info.version and claim.base_sha256 != info.sha256:
            raise MalformedInput("claim", f"{header.worker_id} claims version {info.version} has hash "
                                          f"{claim.base_sha256[:12]}…; it is {info.sha256[:12]}…")
