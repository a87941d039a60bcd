"""`SwarmAggregator`: the aggregator role's domain object. It owns a set of blocks (all of them,
or a disjoint share when several aggregators split the model), admits workers whose run
fingerprint (and data) matches, hands each its data key (aggregate/trust/datakeys.py), and answers
status. rpc/server.py is a thin layer over it.

In a DiLoCo run (ModelConfig.kind "ar") it owns one unit, block 0, which is the whole AR model:
the same BlockAggregator, rounds, outer step and version store, only another init (init_unit)."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from btnode.aggregate.relay.admission import ParentKeys, UpstreamAdmission
from btnode.aggregate.relay.review import RelayReview
from btnode.aggregate.joins import JoinDesk
from btnode.aggregate.replays import ReplayDesk
from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.round.config import AggregatorConfig, BlockStatus
from btnode.aggregate.round.intake import Intake
from btnode.aggregate.statedir import check_run, secret_of
from btnode.aggregate.trust.audit import Audits, LocalReplays, Replayer, Verdict
from btnode.aggregate.trust.commits import Commits
from btnode.aggregate.trust.delegate import DelegatedReplays, compatible
from btnode.aggregate.trust.datakeys import DataKeys
from btnode.aggregate.trust.identities import Identities, Identity, IdentityRecord, Verify
from btnode.aggregate.trust.manifests import Relays
from btnode.aggregate.trust.signatures import Signatures
from btnode.aggregate.trust.standing import Standing
from btnode.aggregate.trust.terms import TrainingRecords
from btnode.codec.frames import ChunkData
from btnode.data.source import ByteSource
from btnode.errors import ConfigError, Forbidden, JoinPending, MalformedInput, PeerInputError, Refused, UnknownBlock
from btnode.model.config import ModelConfig
from btnode.protocol import (INCOMPLETE, Attestation, Drawn, Duties, EvidenceChild, JoinInfo, Judgement, Meter,
                             Outcome, PushHeader, RoundReceipt, Upstream, VersionInfo, format_steps)
from btnode.store.models import init_unit, unit_stem
from btnode.store.versions import VersionStore
from btnode.train.recipe import Recipe
from btnode.train.terms import TrainingTerms

log = logging.getLogger(__name__)
Tensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class SwarmStatus:
    """What `SwarmAggregator.status` answers: each owned block's `BlockStatus` (each read under its
    own lock, one after the other) and the swarm-wide event counts."""

    fingerprint: str
    config: ModelConfig
    blocks: tuple[BlockStatus, ...]  # by block number
    events: Mapping[tuple[str, str], int]  # (event, reason) → count, for events outside one block
    data_id: str | None = None  # what every worker trains on (None: no worker stated one yet)
    identities: tuple[IdentityRecord, ...] = ()  # under mutual TLS: each certificate's record, by name


@functools.lru_cache(maxsize=256)
def recipe_of(text: str) -> Recipe:
    """A claim's recipe, parsed once per distinct text (a swarm has few)."""
    return Recipe.from_json(text)


class SwarmAggregator:
    """The root, or (built with an `UpstreamAdmission`) a relay: the same admission, judging and rounds;
    a relay's joins go to its parent first and its blocks' rounds close into combined updates
    (relay/forward.py Forwarder) rather than into published versions (round/publish.py Publisher)."""

    def __init__(self, cfg: ModelConfig, acfg: AggregatorConfig, state_dir: Path, *, blocks: Iterable[int] | None = None,
                 seed: int = 0, clock: Callable[[], float] = time.time, data_id: str | None = None,
                 corpus: ByteSource | bytes | None = None, audit_secret: bytes | None = None,
                 upstream: UpstreamAdmission | None = None):
        """`data_id`: the data every worker must train on (btnode.data.identity); None: the first
        one a worker states. `corpus`: that data's training split, which replay audits need
        (acfg.audit); `audit_secret`: the key of their draws (default: made once, kept in the state folder).
        `upstream`: this aggregator is a relay under that parent (relay/admission.py)."""
        self.upstream = upstream
        acfg = upstream.config(acfg) if upstream is not None else acfg
        self.cfg = cfg
        self.acfg = acfg
        self.fingerprint = cfg.fingerprint()
        owned = sorted(set(range(cfg.total_blocks) if blocks is None else blocks))
        if not owned or any(not 0 <= b < cfg.total_blocks for b in owned):
            raise ConfigError(f"blocks {owned} out of range for {cfg.total_blocks} blocks")
        state_dir.mkdir(parents=True, exist_ok=True)
        check_run(state_dir, cfg, self.fingerprint)
        # a relay checks pushes against the root's keys, never its own
        self.keys: DataKeys | ParentKeys = DataKeys(state_dir, fixed=data_id) if upstream is None else upstream.keys
        self.identities = Identities(state_dir)
        self.signatures = Signatures(self.identities, self.count)  # of what relays pass on, under mutual TLS
        self.relays = Relays()  # relays that joined, and their combined pushes (aggregate/trust/manifests.py)
        self.counters: Counter = Counter()  # (name, reason) for events outside one block
        secret = audit_secret or secret_of(state_dir)  # also keys the screen's sketches (aggregate/sums/accumulate.py)
        self.audits: Audits | None = None
        self.replayers: dict[int, Replayer] = {}
        self.delegated: DelegatedReplays | None = None
        self.recipes: dict[str, str] = {}  # worker id → the recipe its last claim named (who may verify whom)
        # a relay's child → that relay's name (from its commits, `draw`), and back: its duties go through the relay
        self.behind: dict[str, str] = {}
        self._children: dict[str, set[str]] = {}
        self._duty_lock = threading.Lock()
        self.commits: Commits | None = None  # relays' child updates, committed before they are counted (Draw)
        verifier = None
        if acfg.audit.on and corpus is None and upstream is None:
            # audits are on by default; an in-process aggregator given no data cannot replay: it starts
            # without them, and says so (a node always has data: --data, else the bundled corpus)
            log.warning("replay audits are off: this aggregator was given no data to replay updates on")
            self.count("audits_off", "no_data")
        elif acfg.audit.on and corpus is not None:
            self.audits = Audits(acfg.audit, secret, clock)
            self.replayers = {b: Replayer(cfg, b, corpus, tolerance=acfg.audit.tolerance) for b in owned}
            local = LocalReplays(self.replayers, clock, error=functools.partial(self.count, "audit_errors"))
            # the block's other workers replay drawn updates, the aggregator referees (aggregate/trust/delegate.py)
            self.delegated = (DelegatedReplays(acfg.delegation, local, {b: r.replay for b, r in self.replayers.items()},
                                               secret, clock, self._verifiers, self._replicas,
                                               lambda b: self.blocks[b].wake(), near=self.behind.get)
                              if acfg.delegation.on else None)
            verifier = self.delegated or local
            self.commits = Commits(secret)
        # the root weighs each identity's updates by its verified work and recent drops (aggregate/trust/standing.py)
        self.standing = Standing(acfg.standing, self.audits, probation=acfg.audit.probation) if upstream is None else None
        self.blocks: dict[int, BlockAggregator] = {
            b: (BlockAggregator(*unit, **named, standing=self.standing) if upstream is None else
                upstream.unit(*unit, child_relay=functools.partial(self.relays.known, b), **named))
            for b in owned
            for unit, named in [((b, init_unit(cfg, b, seed).state_dict(),
                                  VersionStore(state_dir, b, keep=acfg.keep, stem=unit_stem(cfg, b)), acfg),
                                 dict(clock=clock, name=cfg.unit_name(b), sketch_key=secret,
                                      on_settled=self._settled))]}
        self.terms = TrainingRecords(state_dir)  # worker id → the terms of its last admitted join (durable)
        self._terms_journal = self.terms.journal
        self.meter = Meter()  # bytes by (direction, form) and call durations, for metrics
        self.intake = Intake(acfg.decode_slots, self.meter)  # pushes' frames, decoded a few at a time
        self._decoding, self._decoding_lazy = self.intake.slots, self.intake.lazy_slots
        self.clock = clock
        self.replays = ReplayDesk(acfg.audit, self.audits, self.commits, verifier, clock=clock, blocks=self.blocks,
                                  block=self.block, identities=self.identities, intake=self.intake,
                                  training=self.training, data_id=lambda: self.keys.data_id,
                                  check_key=self._check_key, count=self.count)
        # relays' combined pushes drawn for a bit-for-bit check against their children's frames
        self.review = (RelayReview(acfg.relay_audit, secret, clock, block=self.block, identities=self.identities,
                                   relays=self.relays, meter=self.meter, count=self.count, drop=self.replays.drop)
                       if acfg.relay_audit.rate > 0 else None)
        self.relay_audits = self.review.audits if self.review is not None else None
        self.joins = JoinDesk(cfg, acfg, block=self.block, identities=self.identities, keys=self.keys, terms=self.terms,
                              relays=self.relays, audits=self.audits, abandoned=self.replays.abandoned,
                              relay_audits=self.review is not None, upstream=upstream, count=self.count)

    def admit(self, who: Identity, method: str, claimed: str = "", *, counted: bool = True) -> None:
        """Let a call of `who` through (aggregate/trust/identities.py), or count its refusal
        (`identity_refused/<reason>`, so that operators see them in metrics; `counted` False: the caller
        counts it) and raise it. A joined identity calling in another's name is revoked (`impersonates`)."""
        try:
            (self.signatures.admit if counted else self.identities.admit)(who, method, claimed)
        except Forbidden as exc:
            if exc.reason == "name" and self.identities.impersonates(who, method, claimed):
                self.replays.punish(who.name, "impersonation", f"{method} under worker id {claimed!r}")
            raise

    def proven(self, relay: Identity, worker_id: str, proof: tuple[bytes, bytes], statement: bytes,
               verify: Verify | None) -> Identity:
        """The worker behind a join or push receipt a relay passes on (Signatures.proven)."""
        return self.signatures.proven(relay, worker_id, proof, statement, verify)

    def _settled(self, worker_id: str, receipt: RoundReceipt) -> None:
        """An update's round receipt (round/receipts.py) goes on its sender's record: applied, or
        dropped with the reason (Identities.drops reads the screen's)."""
        self.identities.settled(worker_id, receipt.outcome is Outcome.APPLIED, receipt.reason)

    def count(self, event: str, reason: str = "") -> None:
        """Count an event outside any one block (a refused join, an unauthenticated or limited call)."""
        self.counters[(event, reason)] += 1

    def status(self) -> SwarmStatus:
        blocks = tuple(replace(self.blocks[b].status(), data_keys=self.keys.of(b), relays=self.relays.records(b))
                       for b in sorted(self.blocks))
        records = self.identities.records()
        if (d := self.delegated) is not None:  # each identity's verifier work (delegated verification)
            records = tuple(replace(r, verified=d.upheld.get(r.name, 0), verify_s=d.work.get(r.name, 0.0))
                            for r in records)
        return SwarmStatus(fingerprint=self.fingerprint, config=self.cfg, blocks=blocks, events=dict(self.counters),
                           data_id=self.keys.data_id, identities=records)

    def block(self, b: int) -> BlockAggregator:
        agg = self.blocks.get(b)
        if agg is None:
            raise UnknownBlock("unknown_block", f"this aggregator owns blocks {sorted(self.blocks)}, not block {b}")
        return agg

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str = "",
             who: Identity | None = None, *, training_json: str = "", relay: bool = False,
             proof: tuple[bytes, bytes] | None = None, via: str = "") -> JoinInfo:
        """Admit a worker or a relay (JoinDesk.join)."""
        return self.joins.join(worker_id, block, fingerprint, config_json, data_id, who, training_json=training_json,
                               relay=relay, proof=proof, via=via)

    # -- delegated verification (aggregate/trust/delegate.py) ----------------------------------------
    def _verifiers(self, block: int, author: str) -> list[str]:
        """Who may replay `author`'s update of `block`: the block's other live replicas whose recipe gives
        the same bytes as the author's (known from their pushes), with training terms, not revoked."""
        agg, theirs = self.blocks.get(block), self.recipes.get(author)
        if agg is None or theirs is None:
            return []
        with agg.lock:
            names = sorted(agg.registered)
        mine = recipe_of(theirs)
        return [n for n in names if n != author and n in self.recipes and not self.identities.is_revoked(n)
                and self.training(n) is not None and compatible(recipe_of(self.recipes[n]), mine)]

    def _replicas(self, block: int) -> int:
        agg = self.blocks.get(block)
        if agg is None:
            return 0
        with agg.lock:
            names = list(agg.registered)
        return sum(not self.identities.is_revoked(n) for n in names)

    def _delegation(self) -> DelegatedReplays:
        if self.delegated is None:
            raise Refused("no_delegation", "this aggregator does not delegate its replay audits")
        return self.delegated

    def duties_handed(self, worker_id: str) -> int:
        """How many verification duties `worker_id` was ever handed (its Watch says when this grows); a
        relay's: its children's, whose duties it fetches for them. At a relay: what it fetched for its child."""
        if self.upstream is not None:
            return self.upstream.duties.handed(worker_id)
        if self.delegated is None:
            return 0
        children = self._children.get(worker_id, ())
        return self.delegated.handed(worker_id) + sum(self.delegated.handed(c) for c in list(children))

    def duties(self, worker_id: str) -> Duties:
        """`worker_id`'s verification duties since it last asked (none without delegation, or once revoked);
        a relay's children's, when a relay asks under its own name (`Duties.children`). At a relay: the
        child's, fetched from the parent (aggregate/relay/duties.py)."""
        if self.upstream is not None:
            return self.upstream.duties.take(worker_id)
        if self.delegated is None or self.identities.is_revoked(worker_id):
            return Duties()
        own = self.delegated.duties_of(worker_id)
        for child in sorted(self._children.get(worker_id, ())):
            if (theirs := self.duties(child)):
                own.children[child] = theirs
        return own

    def relays_for(self, worker_id: str) -> str | None:
        """The relay `worker_id`'s verification calls come through (None: it pushes here directly)."""
        return self.behind.get(worker_id)

    def verify_inputs(self, block: int, task_id: str, worker_id: str) -> tuple[Mapping[str, torch.Tensor],
                                                                                 Mapping[str, torch.Tensor]]:
        if self.upstream is not None:  # a relay passes its child's call on
            return self.upstream.upstream.verify_inputs(block, task_id, worker_id)
        return self._delegation().inputs(task_id, worker_id)

    def attest(self, block: int, attestation: Attestation) -> None:
        if self.upstream is not None:
            self.upstream.upstream.attest(block, attestation)  # signed by the child: the relay cannot change it
        else:
            self._delegation().attest(attestation)

    def submit_trace(self, block: int, task_id: str, worker_id: str, trace: tuple[str, ...], *,
                     proof: tuple[bytes, bytes] | None = None) -> None:
        if self.upstream is not None:
            self.upstream.upstream.submit_trace(block, task_id, worker_id, trace, proof=proof)
        else:
            self._delegation().submit_trace(task_id, worker_id, trace)

    def submit_dispute_state(self, task_id: str, worker_id: str, k: int, state: Mapping[str, torch.Tensor]) -> None:
        self._delegation().submit_state(task_id, worker_id, k, state)

    def pass_dispute_state(self, block: int, task_id: str, worker_id: str, k: int, chunks: Iterable[ChunkData]) -> None:
        """At a relay: a child's dispute state, passed on to the parent as it came (the root checks it
        against the child's signed trace)."""
        if self.upstream is None:
            raise Refused("no_delegation", "only a relay passes a dispute state on")
        self.upstream.upstream.submit_dispute_state(block, task_id, worker_id, k, chunks)

    def training(self, worker_id: str) -> TrainingTerms | None:
        """The training terms `worker_id` stated at its last admitted Join (None: none stated): what
        a replay of its updates trains with. Kept in the state folder, so a restart keeps them."""
        return self.terms.get(worker_id)

    def leave(self, worker_id: str, block: int) -> None:
        self.block(block).unregister(worker_id)  # at a relay, the block tells the parent (Forwarder.member)
        if self.delegated is not None:
            self.delegated.released(worker_id)  # its unattested verification tasks go to the aggregator
        if self.upstream is not None:
            self.upstream.left(worker_id, block)
        log.info("worker %s left %s", worker_id, self.cfg.unit_name(block))

    def push(self, header: PushHeader, chunks: Iterable[ChunkData], who: Identity | None = None, *,
             verify: Verify | None = None) -> Judgement:
        """Judge one pushed update (the Push call, whole): its header first (re-push, late, stale
        answered before any payload), then every frame validated against the block's spec, then the
        round's rules. A refused push is counted with its reason and raised; nothing of it is applied.
        `who`: the sender's proven identity (mutual TLS): it must have joined the block and may push
        one update per round; the outcome goes on its record. `verify`: the swarm CA's check of the
        workers' signatures a relay passes on (rpc/certs.verify_signed): each entry of a combined push
        carries its worker's signed receipt, and a child's update a relay passes on for a replay audit
        (drawn here: `check_passed_on`) is judged under its worker's receipt, not the relay's identity."""
        passed_on = who is not None and who.passes_on(header)
        if passed_on:
            try:
                self.check_passed_on(header)
            except PeerInputError as exc:
                self.block(header.block).reject(None, exc)
                raise
            chunks, who = self.signatures.receipted(header, chunks, verify), None
        if who is not None and header.manifest:
            try:
                self.signatures.check_manifest(who, header, verify)
            except PeerInputError as exc:
                self.block(header.block).reject(header, exc)
                self.relays.pushed(header, False)
                raise
        try:
            judged = self._push(header, chunks, who)
        except PeerInputError as exc:
            if passed_on and exc.reason not in INCOMPLETE and self.commits is not None:
                self.commits.judged(header.update_id)  # refused: its chain moved on (or it never was its worker's)
            if exc.reason == "bound" and not header.manifest and self.audits is not None:
                # over the bound AdamW's steps allow (trust/claims.py): no honest worker's update is, so in
                # an accountable swarm (audits on) it is evidence, like a failed replay
                self.replays.punish(header.worker_id, "bound", str(exc))
            raise
        if passed_on and self.commits is not None:
            self.commits.judged(header.update_id)
        return judged

    def _push(self, header: PushHeader, chunks: Iterable[ChunkData], who: Identity | None) -> Judgement:
        try:
            block = self.block(header.block)
        except PeerInputError as exc:  # no block to charge it to: count it swarm-wide
            self.count("rejected", exc.reason)
            raise
        if self.identities.is_revoked(header.worker_id):
            block.reject(header, exc := Forbidden("revoked", f"worker {header.worker_id!r} was revoked"))
            raise exc
        if who is not None:
            self.identities.check_push(who, header, ever_joined=self.has_joined(header.block, who.name))
        amends = block.amends(header)  # a relay's amendment: the child updates of the push it replaces
        if self.upstream is not None:  # at a relay: its frames' digest noted for the manifest (and committed upstream)
            chunks = self.upstream.noting(header, chunks)
        try:
            judged = self._judge(block, header, chunks, amends)
        except PeerInputError as exc:
            if who is not None:
                self.identities.judged(who, header, False, exc.reason)
            if header.manifest:
                self.relays.pushed(header, False)
            raise
        taken = judged.outcome in (Outcome.PENDING, Outcome.APPLIED)  # into a round (a re-push: its receipt)
        if who is not None:
            self.identities.judged(who, header, taken, judged.outcome.value)
        if header.manifest and judged.outcome is not Outcome.PROBATION:  # a held one is recorded at its verdict
            self.relays.pushed(header, taken, replaced=amends)
        if header.manifest and judged.outcome in (Outcome.PENDING, Outcome.PROBATION):
            judged = replace(judged, closes_in_s=_closes_in(block, header.base_version))
        return judged

    def has_joined(self, block: int, name: str) -> bool:
        """Whether `name` ever joined `block` here (its data key persists, so a join survives a restart),
        itself or as a relay's child."""
        return name in self.keys.of(block) or self.relays.known(block, name)

    def revoke(self, name: str) -> float:
        """Refuse the identity `name` from now on; returns the time of its revocation. Its updates
        accepted in open rounds are dropped from them."""
        at = self.identities.revoke(name)
        log.warning("identity %s revoked by the operator", name)
        for b in self.blocks.values():
            b.wake()  # its version streams end now
        self.replays.drop(name, "revoked")
        self.replays.repair("operator")  # what it added in the kept rounds is taken back (round/repairs.py)
        return at

    def _judge(self, block: BlockAggregator, header: PushHeader, chunks: Iterable[ChunkData],
               amends: frozenset[str] = frozenset()) -> Judgement:
        with contextlib.ExitStack() as decoding:  # held from the end of the upload to the judgement
            return self._judged(block, header, chunks, decoding, amends)

    def _judged(self, block: BlockAggregator, header: PushHeader, chunks: Iterable[ChunkData],
                decoding: contextlib.ExitStack, amends: frozenset[str]) -> Judgement:
        answered = block.answered(header.update_id)
        if answered is not None:  # a re-push: the same answer, and the same request for its state (or evidence)
            waiting = any(a is not None and a.waiting_for(header.update_id) is not None
                          for a in (self.audits, self.relay_audits))
            return replace(answered, audit=waiting)
        audits = None if header.manifest else self.audits  # a relay's children were committed one by one (`draw`)
        if audits is not None:
            self._note_recipe(header)
        try:
            if audits is not None:
                audits.check_chain(header)
                self.replays.check_claim(block, header)
            early = block.precheck(header)
            if early is not None:
                if audits is not None:
                    audits.advance(header)
                elif self.upstream is not None and not header.manifest:
                    self.upstream.refused(header, chunks)  # the root's chain of the child's claims moves on too
                return early
            if header.codec not in self.acfg.update_codecs:
                raise MalformedInput("codec", f"codec {header.codec.name} is not accepted here")
            if header.manifest:
                self.relays.check(header, self.keys.of(header.block), self.identities.is_revoked,
                                  lambda u: block.answered(u) is not None, own=amends)
                if self.commits is not None:
                    self.commits.check(header)
            else:
                self._check_key(header)
            delta, raw = self.intake.assemble(block.spec, header.codec, chunks, gate=decoding, defer_dir=block.store.folder)
        except PeerInputError as exc:
            block.reject(header, exc)
            if audits is not None and exc.reason == "chain":
                self.replays.punish(header.worker_id, "chain", str(exc))
            elif audits is not None and exc.reason not in (*INCOMPLETE, "signature"):  # the worker moves on from it
                audits.advance(header)  # (not from one a relay passed on that its receipt does not prove: a forgery)
            raise
        if self.upstream is not None and (routed := self.upstream.routed(header, raw, self.count)) is not None:
            return routed
        if audits is None:
            if header.manifest and self.review is not None and self.review.audits.drawn(header.update_id):
                return self.review.hold(block, header, delta, raw, amends)
            return block.submit(header, delta, raw=raw, amends=amends if header.manifest else None)
        base = block.current()
        probation = audits.on_probation(header.worker_id) and self.training(header.worker_id) is not None
        held = self.replays.holds(block, header, probation)  # drawn or on probation: held until its verdict
        try:
            judged = block.submit(header, delta, raw=raw, hold=held, drawn=held and not probation,
                                  amends=amends if header.manifest else None)
        except PeerInputError:
            audits.advance(header)
            raise
        audits.advance(header)
        if base[0].version != header.base_version:
            return judged  # a stale-weighted update: its base is not at hand to replay against (docs/security.md)
        if judged.outcome is Outcome.PENDING and not held:
            self.replays.remember(header)  # for a later audit (dropped at close, or its round found attacked)
        return self.replays.open_audit(block, header, raw, base[1], judged, probation, held)

    def _check_key(self, header: PushHeader) -> None:
        """A worker id that never joined the block (it has no data key for it, and keys survive a
        restart) may not push to it: Join is where its settings are checked. An update trained on
        windows of another key than the one Join handed out is refused: which windows a worker
        trains is the swarm's choice (a worker that states none is older)."""
        pending = self.joins.pending(header.block, header.worker_id)  # read first: a join that lands between has a key
        ours = self.keys.of(header.block).get(header.worker_id)
        if ours is None and pending:
            self.count("join_pending")  # its join is on its way (at a relay: at the parent): refused for now
            raise JoinPending(f"{header.worker_id!r} pushed to {self.cfg.unit_name(header.block)} while its join "
                              f"here is still under way: push again once it has landed")
        if ours is None:
            if self.upstream is not None:  # refused for good here: the parent stops waiting for it (until it joins)
                self.upstream.refused_child(header.block, header.worker_id)
            raise Refused("not_joined", f"{header.worker_id!r} pushed to {self.cfg.unit_name(header.block)} without "
                                        f"joining it: a worker joins before it pushes")
        if header.data_key and header.data_key != ours:
            raise MalformedInput("data_key", f"{header.worker_id} trained steps {format_steps(header.steps)} with data "
                                             f"key {header.data_key!r}, but its key here is {ours!r}")

    # -- replay audits (replays.py) -------------------------------------------------------------
    def draw(self, header: PushHeader, digest: str, relay: str = "", *, refused: bool = False) -> Drawn:
        """A relay commits a child's update before it counts it (ReplayDesk.draw). `relay`: its name
        (under mutual TLS its certificate's), to which the child's verification duties go from now on;
        `refused`: one it answered LATE or STALE, whose claim only moves the worker's chain on."""
        drawn = self.replays.draw(header, digest, relay, refused=refused)
        self._note_recipe(header)
        if relay:
            with self._duty_lock:
                if (before := self.behind.get(header.worker_id)) != relay:
                    if before is not None:
                        self._children[before].discard(header.worker_id)
                    self.behind[header.worker_id] = relay
                    self._children.setdefault(relay, set()).add(header.worker_id)
        return drawn

    def _note_recipe(self, header: PushHeader) -> None:
        """Who may verify whom (`_verifiers`): the recipe of `header`'s claim, once it reads."""
        if header.claim is not None and not header.manifest:
            with contextlib.suppress(MalformedInput):  # (an unreadable one fails the claims check)
                recipe_of(header.claim.recipe)
                self.recipes[header.worker_id] = header.claim.recipe

    def came_direct(self, worker_id: str) -> None:
        """`worker_id` watches this aggregator itself (no relay between): its duties are its own to ask for."""
        if worker_id in self.behind:
            with self._duty_lock:
                if (relay := self.behind.pop(worker_id, None)) is not None:
                    self._children[relay].discard(worker_id)

    def check_passed_on(self, header: PushHeader) -> None:
        """Refused unless a relay pushes a child's update this root drew (ReplayDesk.check_passed_on)."""
        self.replays.check_passed_on(header)

    def settle_commits(self) -> None:
        self.replays.settle_commits()

    def submit_state(self, header: PushHeader, chunks: Iterable[ChunkData]) -> None:
        """The start state of an update drawn for audit (ReplayDesk.submit_state); at a relay, the state
        of a child's update it passed on, passed on to the parent as it came."""
        if self.upstream is not None:
            self.upstream.submit_state(header, chunks)
        else:
            self.replays.submit_state(header, chunks)

    def run_audits(self) -> list[Verdict]:
        """Replay every audit whose start state is in, fail those whose state is late; returns the verdicts."""
        return self.replays.run_audits()

    # -- relay audits (relay/review.py) ----------------------------------------------------------
    def submit_evidence(self, header: PushHeader, unit: float, parts: Iterable[EvidenceChild | ChunkData],
                        who: Identity | None = None) -> None:
        """A relay's evidence for its held combined push (RelayReview.submit_evidence)."""
        if self.review is None:
            raise MalformedInput("no_audit", f"no relay audit waits for the evidence of {header.update_id[:16]!r} of "
                                             f"{header.worker_id!r}")
        self.review.submit_evidence(header, unit, parts, who)

    def expire_relay_audits(self) -> None:
        """Fail the relay audits whose evidence did not come (or did not hold) in time."""
        if self.review is not None:
            self.review.expire()

    def drain(self) -> list[VersionInfo]:
        """Publish every open round that accepted updates (see BlockAggregator.drain)."""
        return [info for agg in self.blocks.values() if (info := agg.drain()) is not None]

    def tick(self) -> None:
        for agg in self.blocks.values():
            agg.tick()


def _closes_in(block: BlockAggregator, version: int) -> float:
    """Seconds until the deadline of the block's open round, if it is `version`'s (0 otherwise): told to
    a relay whose combined push it took, so that the relay knows how long it may still amend it."""
    with block.lock:
        return max(0.0, block.round.deadline() - block.clock()) if block.round.version == version else 0.0


def relay_swarm(cfg: ModelConfig, acfg: AggregatorConfig, state_dir: Path, *, upstream: Upstream, name: str,
                blocks: Iterable[int] | None = None, seed: int = 0, parent_audits: bool = False,
                parent_replays: bool = False, check_receipt: Callable[[PushHeader, str], object] | None = None,
                clock: Callable[[], float] = time.time) -> SwarmAggregator:
    """A relay named `name` under the parent `upstream`: an aggregator built with an UpstreamAdmission
    (relay/admission.py says what each setting means); its closed rounds wait in `.upstream.outbox`."""
    return SwarmAggregator(cfg, acfg, state_dir, blocks=blocks, seed=seed, clock=clock, upstream=UpstreamAdmission(
        upstream, name, parent_audits=parent_audits, parent_replays=parent_replays, check_receipt=check_receipt))
