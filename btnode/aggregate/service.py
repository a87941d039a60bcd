"""`SwarmAggregator`: the aggregator role's domain object. It owns a set of blocks (all of them,
or a disjoint share when several aggregators split the model), admits workers whose run
fingerprint (and data) matches, hands each its data key (aggregate/datakeys.py), and answers
status. rpc/server.py is a thin layer over it.

In a DiLoCo run (ModelConfig.kind "ar") it owns one unit, block 0, which is the whole AR model:
the same BlockAggregator, rounds, outer step and version store, only another init (init_unit)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from btnode.aggregate.audit import AuditJob, Audits, Replayer, Verdict
from btnode.aggregate.commits import Commits
from btnode.aggregate.block import INCOMPLETE, AggregatorConfig, BlockAggregator, BlockStatus
from btnode.aggregate.datakeys import DataKeys
from btnode.aggregate.evidence import RelayAudits
from btnode.aggregate.identities import Identities, Identity, IdentityRecord
from btnode.aggregate.manifests import Relays
from btnode.aggregate.relayed import RelayChecks
from btnode.codec.frames import ChunkData, FrameAssembler
from btnode.codec.codecs import Codec
from btnode.data.source import ByteSource
from btnode.errors import CheckpointError, ConfigError, ConfigMismatchError, Forbidden, MalformedInput, PeerInputError, Refused, UnknownBlock
from btnode.model.config import ModelConfig
from btnode.protocol import MAX_NAME, JoinInfo, Judgement, Meter, Outcome, PushHeader, VersionInfo, format_steps
from btnode.durable import Journal, atomic_write
from btnode.store.models import RUN_FILE, init_unit, unit_stem
from btnode.store.versions import VersionStore
from btnode.train.terms import TrainingTerms

log = logging.getLogger(__name__)
SECRET_FILE = "audit.secret"
TRAINING_FILE = "training.jsonl"  # worker id → the training terms it joined with (a durable.Journal)
LEGACY_TRAINING_FILE = "training.json"  # the same map, rewritten whole on each join by earlier versions
# A push of a unit larger than this in fp32 is judged from its raw codec bytes, decoded a tensor at a time
# (each read decodes again: CPU for memory); a smaller one is decoded whole once, as the cheaper way.
LAZY_DECODE_BYTES = 64 << 20
# Such a push holds its raw bytes and a tensor's temporaries while it is judged, about half its unit in
# fp32: one at a time (whatever --decode-slots), a large unit's aggregator stays under 3 × the unit
# (issue #25; bench/fixed_memory.py: 2.85 × with one, 3.30 × with two; accepts ~10 % further apart on 2 cores).
LAZY_DECODE_SLOTS = 1
Tensors = Mapping[str, torch.Tensor]


def _secret(state_dir: Path) -> bytes:
    """The key of the audit draws: 32 random bytes made once per state folder, readable by its owner only."""
    path = state_dir / SECRET_FILE
    if not path.exists():
        atomic_write(path, os.urandom(32))
        path.chmod(0o600)
    secret = path.read_bytes()
    if len(secret) != 32:
        raise ConfigError(f"{path} is not a 32-byte audit key; delete it to make a new one")
    return secret


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


class SwarmAggregator(RelayChecks):
    block_class: type[BlockAggregator] = BlockAggregator  # a relay's blocks combine and forward (aggregate/relay.py)

    def __init__(self, cfg: ModelConfig, acfg: AggregatorConfig, state_dir: Path, *, blocks: Iterable[int] | None = None,
                 seed: int = 0, clock: Callable[[], float] = time.time, data_id: str | None = None,
                 corpus: ByteSource | bytes | None = None, audit_secret: bytes | None = None):
        """`data_id`: the data every worker must train on (btnode.data.identity); None: the first
        one a worker states. `corpus`: that data's training split, which replay audits need
        (acfg.audit); `audit_secret`: the key of their draws (default: made once, kept in the state folder)."""
        self.cfg = cfg
        self.acfg = acfg
        self.fingerprint = cfg.fingerprint()
        owned = sorted(set(range(cfg.total_blocks) if blocks is None else blocks))
        if not owned or any(not 0 <= b < cfg.total_blocks for b in owned):
            raise ConfigError(f"blocks {owned} out of range for {cfg.total_blocks} blocks")
        state_dir.mkdir(parents=True, exist_ok=True)
        self._check_state_dir(state_dir)
        self.keys = DataKeys(state_dir, fixed=data_id)
        self.identities = Identities(state_dir)
        self.relays = Relays()  # relays that joined, and their combined pushes (aggregate/manifests.py)
        secret = audit_secret or _secret(state_dir)  # also keys the screen's sketches (aggregate/accumulate.py)
        self.blocks = {b: self.block_class(b, init_unit(cfg, b, seed).state_dict(),
                                          VersionStore(state_dir, b, keep=acfg.keep, stem=unit_stem(cfg, b)), acfg,
                                          clock=clock, name=cfg.unit_name(b), sketch_key=secret)
                       for b in owned}
        self.counters: Counter = Counter()  # (name, reason) for events outside one block
        self._training_file = state_dir / TRAINING_FILE
        self._training = self._read_training(state_dir)  # worker id → the terms of its last admitted join (durable)
        self._training_lock = threading.Lock()
        self.meter = Meter()  # bytes by (direction, form) and call durations, for metrics
        self._decoding = threading.BoundedSemaphore(acfg.decode_slots)  # pushes decoded and judged at once
        self._decoding_lazy = threading.BoundedSemaphore(LAZY_DECODE_SLOTS)  # of those, a large unit's
        self.clock = clock
        self.audits: Audits | None = None
        self.replayers: dict[int, Replayer] = {}
        self.commits: Commits | None = None  # relays' child updates, committed before they are counted (Draw)
        if acfg.audit.on:
            if corpus is None:
                raise ConfigError("replay audits re-train updates on the workers' data: give the aggregator --data "
                                  "(the same as the workers')")
            self.audits = Audits(acfg.audit, secret, clock)
            self.replayers = {b: Replayer(cfg, b, corpus, tolerance=acfg.audit.tolerance) for b in owned}
            self.commits = Commits(secret)
        # relays' combined pushes drawn for a bit-for-bit check against their children's frames
        self.relay_audits = RelayAudits(acfg.relay_audit, secret, clock) if acfg.relay_audit.rate > 0 else None
        # their evidence is summed again one relay at a time: each recombination holds an exact int64 sum
        # (2 × the unit) and a child's update, and six drawn at once cost a root 86 MB at N = 1,024
        self._recombining = threading.BoundedSemaphore(1)

    def admit(self, who: Identity, method: str, claimed: str = "") -> None:
        """Let a call of `who` through (aggregate/identities.py), or count its refusal
        (`identity_refused/<reason>`, so that operators see them in metrics) and raise it."""
        try:
            self.identities.admit(who, method, claimed)
        except PeerInputError as exc:
            self.count("identity_refused", exc.reason)
            raise

    def count(self, event: str, reason: str = "") -> None:
        """Count an event outside any one block (a refused join, an unauthenticated or limited call)."""
        self.counters[(event, reason)] += 1

    def status(self) -> SwarmStatus:
        blocks = tuple(replace(self.blocks[b].status(), data_keys=self.keys.of(b), relays=self.relays.records(b))
                       for b in sorted(self.blocks))
        return SwarmStatus(fingerprint=self.fingerprint, config=self.cfg, blocks=blocks, events=dict(self.counters),
                           data_id=self.keys.data_id, identities=self.identities.records())

    def _check_state_dir(self, state_dir: Path) -> None:
        """A state folder belongs to one run: refuse to mix versions of different configurations."""
        marker = state_dir / RUN_FILE
        if marker.exists():
            theirs = ModelConfig.from_dict(json.loads(marker.read_text())["model"])
            self.cfg.require_same(theirs, f"state folder {state_dir}")
        else:
            atomic_write(marker, json.dumps({"model": self.cfg.to_dict(), "fingerprint": self.fingerprint},
                                            indent=1).encode())

    def block(self, b: int) -> BlockAggregator:
        agg = self.blocks.get(b)
        if agg is None:
            raise UnknownBlock("unknown_block", f"this aggregator owns blocks {sorted(self.blocks)}, not block {b}")
        return agg

    def join(self, worker_id: str, block: int, fingerprint: str, config_json: str, data_id: str = "",
             who: Identity | None = None, *, training_json: str = "", relay: bool = False,
             proof: tuple[bytes, bytes] | None = None) -> JoinInfo:
        """Admit a worker whose fingerprint, stated data id (empty: not stated) and training settings
        (`training_json`, TrainingTerms) match the swarm's, and hand it its data key. `who`: its proven
        identity, under mutual TLS (the RPC layer has checked that `worker_id` is its name, or the
        worker's signature on a join a relay passed on). `proof`: that certificate and signature, which
        a relay (RelaySwarm.join) passes on to its parent."""
        if not worker_id or len(worker_id) > MAX_NAME or len(data_id) > MAX_NAME:
            raise MalformedInput("join", f"a join needs a worker id, and ids of at most {MAX_NAME} characters")
        if self.identities.is_revoked(worker_id):
            self.count("join_refused", "revoked")
            raise Forbidden("revoked", f"worker {worker_id!r} was revoked (a failed audit or the operator): it may not "
                                       f"join again under this name")
        if fingerprint != self.fingerprint:
            self.count("join_refused", "fingerprint")
            try:
                theirs = ModelConfig.from_dict(json.loads(config_json))
            except (ValueError, TypeError, ConfigError):
                raise ConfigMismatchError(f"worker {worker_id!r} has run fingerprint {fingerprint[:12]}…, this swarm "
                                          f"runs {self.fingerprint[:12]}… (its settings could not be read)", []) from None
            fields = self.cfg.diff(theirs)
            raise ConfigMismatchError(f"worker {worker_id!r} runs different swarm-wide settings "
                                      f"({_named(fields) or 'fingerprint format'})", fields)
        agg = self.block(block)
        if relay:
            return self._join_relay(agg, worker_id, who)
        terms = self._check_training(worker_id, training_json)
        try:
            key = self.keys.assign(block, worker_id, data_id)
        except ConfigMismatchError:
            self.count("join_refused", "data")
            raise
        if self.audits is not None and (over := self.audits.joined(block, worker_id)) is not None:
            self._abandoned(worker_id, over)
        agg.register(worker_id)
        if terms is not None:
            with self._training_lock:  # one line appended per changed worker: O(1) bytes a join, not O(N)
                if self._training.get(worker_id) != terms:
                    terms, text = self._canonical_terms(terms)
                    self._training[worker_id] = terms
                    self._terms_journal.put(worker_id, text)
        if who is not None:
            self.identities.joined(who, block)
        self.count("joins")
        log.info("worker %s joined %s with data key %s", worker_id, self.cfg.unit_name(block), key)
        return JoinInfo(current=agg.current()[0], deadline_s=self.acfg.round.deadline_s, codecs=self.acfg.update_codecs,
                        max_staleness=self.acfg.round.max_staleness, data_key=key, audits=self.audits is not None)

    def _join_relay(self, agg: BlockAggregator, name: str, who: Identity | None) -> JoinInfo:
        """A relay joins a block to push its children's combined updates: it trains nothing, so it has
        no data key and no training terms; its children join through it, one by one. Under replay
        audits it commits each child update here before it counts it (`draw`)."""
        self.relays.joined(agg.block, name)  # not a replica: the round waits on the workers it reports for
        if who is not None:
            self.identities.joined(who, agg.block)
        self.count("joins", "relay")
        log.info("relay %s joined %s", name, agg.name)
        return JoinInfo(current=agg.current()[0], deadline_s=self.acfg.round.deadline_s, codecs=self.acfg.update_codecs,
                        max_staleness=self.acfg.round.max_staleness, audits=self.audits is not None,
                        relay_audits=self.relay_audits is not None)

    def _check_training(self, worker_id: str, training_json: str) -> TrainingTerms | None:
        """The worker's training terms, once their swarm-wide settings match the claims this
        aggregator judges by; under --believe-claims they are only read, to be recorded."""
        claims = self.acfg.claims
        try:
            if not training_json:
                if claims.enforce:
                    raise ConfigMismatchError(f"worker {worker_id!r} states no training settings (an older worker): "
                                              f"its claims cannot be checked against this swarm's batch, lr and H "
                                              f"(an aggregator started with --believe-claims admits it)", [])
                return None
            terms = TrainingTerms.from_json(training_json)
            fields = claims.differences(terms) if claims.enforce else []
            if fields:
                raise ConfigMismatchError(f"worker {worker_id!r} trains with different swarm-wide settings "
                                          f"({_named(fields)})", fields)
        except (ConfigMismatchError, MalformedInput):
            self.count("join_refused", "training")
            raise
        return terms

    def training(self, worker_id: str) -> TrainingTerms | None:
        """The training terms `worker_id` stated at its last admitted Join (None: none stated): what
        a replay of its updates trains with. Kept in the state folder, so a restart keeps them."""
        return self._training.get(worker_id)

    def _canonical_terms(self, terms: TrainingTerms) -> tuple[TrainingTerms, str]:
        """One object and one JSON text for each distinct set of terms, whoever states it: the
        workers of a swarm mostly state the same terms, and a copy per worker cost the root about
        0.94 KB a worker (bench/join_memory.py: 1,431 → 487 bytes a join), kept while the worker is known."""
        form = self._terms_forms.get(terms)
        if form is None:
            form = self._terms_forms[terms] = (terms, terms.to_json())
        return form

    def _read_training(self, state_dir: Path) -> dict[str, TrainingTerms]:
        self._terms_forms: dict[TrainingTerms, tuple[TrainingTerms, str]] = {}
        try:
            self._terms_journal = Journal(self._training_file, legacy=state_dir / LEGACY_TRAINING_FILE)
            training = {}
            for worker, text in self._terms_journal.values.items():
                training[worker], self._terms_journal.values[worker] = self._canonical_terms(TrainingTerms.from_json(text))  # type: ignore[arg-type]
            return training
        except (OSError, ValueError, TypeError, AttributeError, MalformedInput) as exc:
            raise CheckpointError(f"{self._training_file} cannot be read as the workers' training settings: {exc}") from exc

    def leave(self, worker_id: str, block: int) -> None:
        self.block(block).unregister(worker_id)
        log.info("worker %s left %s", worker_id, self.cfg.unit_name(block))

    def push(self, header: PushHeader, chunks: Iterable[ChunkData], who: Identity | None = None) -> Judgement:
        """Judge one pushed update: its header first (re-push, late, stale answered before any
        payload), then every frame validated against the block's spec, then the round's rules.
        A refused push is counted with its reason and raised; nothing of it is applied.
        `who`: the sender's proven identity (mutual TLS): it must have joined the block and may push
        one update per round; the outcome goes on its record."""
        try:
            block = self.block(header.block)
        except PeerInputError as exc:  # no block to charge it to: count it swarm-wide
            self.count("rejected", exc.reason)
            raise
        if self.identities.is_revoked(header.worker_id):
            block.reject(header, exc := Forbidden("revoked", f"worker {header.worker_id!r} was revoked"))
            raise exc
        if who is not None:
            joined = who.name in self.keys.of(header.block) or self.relays.known(header.block, who.name)
            self.identities.check_push(who, header, ever_joined=joined)
        amends = block.amends(header)  # a relay's amendment: the child updates of the push it replaces
        try:
            judged = self._judge(block, header, chunks, amends)
        except PeerInputError as exc:
            if who is not None:
                self.identities.judged(who, header, False, exc.reason)
            if header.manifest:
                self.relays.pushed(header, False)
            raise
        if who is not None:
            self.identities.judged(who, header, judged.outcome is Outcome.ACCEPTED, judged.outcome.value)
        if header.manifest and judged.outcome is not Outcome.PROBATION:  # a held one is recorded at its verdict
            self.relays.pushed(header, judged.outcome is Outcome.ACCEPTED, replaced=amends)
        if header.manifest and judged.outcome in (Outcome.ACCEPTED, Outcome.PROBATION):
            judged = replace(judged, closes_in_s=block.closes_in(header.base_version))
        return judged

    def revoke(self, name: str) -> float:
        """Refuse the identity `name` from now on; returns the time of its revocation. Its updates
        accepted in open rounds are dropped from them."""
        at = self.identities.revoke(name)
        log.warning("identity %s revoked by the operator", name)
        self._drop(name, "revoked")
        return at

    def _punish(self, worker_id: str, reason: str, detail: str) -> None:
        """A failed audit, a late or wrong start state, or a broken chain: revoke the worker (its
        certificate's name, or its worker id without mutual TLS) and drop its pending updates."""
        self.identities.revoke(worker_id, seen_only=False)
        self.count("revoked", reason)
        log.warning("worker %s revoked after a failed audit (%s): %s", worker_id, reason, detail)
        self._drop(worker_id, f"audit_{reason}")

    def _abandoned(self, worker_id: str, over: int) -> None:
        """It rejoined while an audit waited for its start state (aggregate/audit.py Audits.joined):
        its update still in an open round is dropped (it cannot be audited now), and once it has
        abandoned more than it is forgiven (`over` > 0) it is revoked and refused (Forbidden)."""
        for agg in self.blocks.values():
            agg.drop(worker_id, "audit_abandoned")
        log.warning("worker %s rejoined without sending the start state of an update drawn for audit (%s): on "
                    "probation again", worker_id, "forgiven" if over <= 0 else "over its allowance")
        if over > 0:
            self._punish(worker_id, "abandoned", "more audits abandoned by rejoining than it is forgiven")
            raise Forbidden("revoked", f"worker {worker_id!r} was revoked: it left audits without its state once too "
                                       f"often")

    def _drop(self, worker_id: str, reason: str) -> None:
        for agg in self.blocks.values():
            agg.drop(worker_id, reason)
        if self.audits is not None:
            self.audits.forget(worker_id)

    # -- audits -------------------------------------------------------------------------------
    def submit_state(self, header: PushHeader, chunks: Iterable[ChunkData]) -> None:
        """The start state of an update drawn for audit (AggregatorLink.submit_state). Refused
        (MalformedInput) when no audit waits for it, or when it is not the state the claim committed
        to; the audit then keeps waiting, and fails only if no right state comes in time. A wrong state
        does not fail it at once: without mutual TLS anyone who saw the update id could send one."""
        job = self.audits.waiting_for(header.update_id) if self.audits is not None else None
        if job is None or job.header.worker_id != header.worker_id or job.header.block != header.block:
            raise MalformedInput("no_audit", f"no audit waits for the state of update {header.update_id[:16]!r} "
                                             f"of {header.worker_id!r}")
        replayer = self.replayers[job.header.block]
        state, _ = self._assemble(replayer.start_spec(job.claim), Codec.FP32, chunks)
        replayer.check_start(job.claim, state)
        self.audits.received(header.update_id, state)

    def run_audits(self) -> list[Verdict]:
        """Replay every audit whose start state is in, fail those whose state is late; returns the verdicts."""
        if self.audits is None:
            return []
        self.settle_commits()
        ready, late = self.audits.due()
        verdicts = [Verdict(j.header, False, "late_state", f"no start state within {self.acfg.audit.state_timeout_s:g} s",
                            0.0, j.probation, self.clock() - j.arrived) for j in late]
        for job in ready:
            if self.identities.is_revoked(job.header.worker_id):
                continue
            try:
                verdicts.append(self.replayers[job.header.block](job, self.clock))
            except Exception:  # noqa: BLE001 - a fault of the replay, not of the worker: never a verdict
                log.exception("the replay of %s's update %s failed; the update is not judged", job.header.worker_id,
                              job.header.update_id[:8])
                self.count("audit_errors")
        for v in verdicts:
            self._verdict(v)
        return verdicts

    def _verdict(self, v: Verdict) -> None:
        assert self.audits is not None
        self.audits.record(v)
        self.identities.audited(v.header.worker_id, v.passed)
        if v.passed:
            log.info("audit of %s's update on version %d passed (%s%s)", v.header.worker_id, v.header.base_version,
                     v.detail, ", probation" if v.probation else "")
            if v.probation:
                self.block(v.header.block).admit_held(v.header.update_id)
        else:
            self._punish(v.header.worker_id, v.reason, v.detail)

    def _open_audit(self, block: BlockAggregator, header: PushHeader, raw: dict[str, bytes], base: Tensors,
                    judged: Judgement, probation: bool) -> Judgement:
        """Draw the update for audit (always on probation) and, if drawn, keep what the replay needs."""
        assert self.audits is not None and header.claim is not None
        if judged.outcome not in (Outcome.ACCEPTED, Outcome.PROBATION) or not (probation or
                                                                              self.audits.drawn(header.update_id)):
            return judged
        terms = self.training(header.worker_id)
        if terms is None:  # it joined before this aggregator restarted: its settings are unknown until it rejoins
            return judged
        job = AuditJob(header=header, claim=header.claim, train=terms.train, raw=raw, base=base, arrived=self.clock(),
                       probation=probation)
        return replace(judged, audit=self.audits.open(job))

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
        try:
            if audits is not None:
                audits.check_chain(header)
                self._check_claim(block, header)
            early = block.precheck(header)
            if early is not None:
                if audits is not None:
                    audits.advance(header)
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
            delta, raw = self._assemble(block.spec, header.codec, chunks, gate=decoding, defer_dir=block.store.folder)
        except PeerInputError as exc:
            block.reject(header, exc)
            if audits is not None and exc.reason == "chain":
                self._punish(header.worker_id, "chain", str(exc))
            elif audits is not None and exc.reason not in (*INCOMPLETE, "signature"):  # the worker moves on from it
                audits.advance(header)  # (not from one a relay passed on that its receipt does not prove: a forgery)
            raise
        if (routed := self._routed(block, header, raw)) is not None:
            return routed
        if audits is None:
            if header.manifest and self.relay_audits is not None and self.relay_audits.drawn(header.update_id):
                return self._hold_for_evidence(block, header, delta, raw, amends)
            return block.submit(header, delta, raw=raw, amends=amends if header.manifest else None)
        base = block.current()
        probation = audits.on_probation(header.worker_id) and self.training(header.worker_id) is not None
        try:
            judged = block.submit(header, delta, raw=raw, hold=probation, amends=amends if header.manifest else None)
        except PeerInputError:
            audits.advance(header)
            raise
        audits.advance(header)
        if base[0].version != header.base_version:
            return judged  # a stale-weighted update: its base is not at hand to replay against (docs/security.md)
        return self._open_audit(block, header, raw, base[1], judged, probation)

    def _routed(self, block: BlockAggregator, header: PushHeader, raw: dict[str, bytes]) -> Judgement | None:
        """An update judged elsewhere: a relay passes a child's update its parent drew for a replay audit
        on as it came (aggregate/relay.py). None here: it is judged here."""
        return None

    def _check_claim(self, block: BlockAggregator, header: PushHeader) -> None:
        """A work claim must name the swarm's data and, for the current version, its hash: a replay
        could not start from anything else."""
        claim = header.claim
        assert claim is not None  # check_chain refused a push without one
        if self.keys.data_id and claim.data_id != self.keys.data_id:
            raise MalformedInput("claim", f"{header.worker_id} claims data {claim.data_id[:24]!r}, the swarm trains on "
                                          f"{self.keys.data_id[:24]!r}")
        info = block.current()[0]
        if header.base_version == info.version and claim.base_sha256 != info.sha256:
            raise MalformedInput("claim", f"{header.worker_id} claims version {info.version} has hash "
                                          f"{claim.base_sha256[:12]}…; it is {info.sha256[:12]}…")

    def _assemble(self, spec: Mapping[str, tuple[int, ...]], codec: Codec, chunks: Iterable[ChunkData], *,
                  gate: contextlib.ExitStack | None = None,
                  defer_dir: Path | None = None) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
        """The tensors of a chunk stream, each frame checked against `spec` and `codec`, and their raw
        codec bytes; its bytes are counted as far as it got. With a `gate`, the upload is received
        compressed (frame headers checked as they come), and decoded only once one of the
        `--decode-slots` is free, which `gate` then holds: however many pushes arrive at once, only a
        few are ever decoded (4 bytes a parameter, plus their raw bytes) at the same time. With a
        `defer_dir`, the compressed frames wait in a file there, not in memory (issue #25). A push of a
        unit over LAZY_DECODE_BYTES in fp32 is checked frame by frame and kept as its raw codec bytes
        (codec/frames.LazyDelta): judging and summing it decodes one tensor at a time, a decode per read;
        LAZY_DECODE_SLOTS of those at once (taken before a decode slot, so a large push waiting for its
        turn holds no slot a small one could use)."""
        lazy = gate is not None and 4 * sum(math.prod(s) for s in spec.values()) > LAZY_DECODE_BYTES
        asm = FrameAssembler.for_spec(spec, [codec], keep_sparse=True, defer=gate is not None,  # sparse stays sparse
                                      defer_dir=defer_dir, lazy=lazy)
        try:
            for chunk in chunks:
                asm.add(chunk)
            if gate is not None:
                if lazy:
                    gate.enter_context(self._decoding_lazy)
                gate.enter_context(self._decoding)
            return asm.finish(), asm.raw
        finally:
            asm.close()
            self._received(asm)

    def _received(self, asm: FrameAssembler) -> None:
        """Count the tensor bytes a push or a state upload brought in (as far as it got)."""
        self.meter.count(("received", "wire"), asm.wire_bytes)
        self.meter.count(("received", "raw"), sum(len(b) for b in asm.raw.values()))

    def _check_key(self, header: PushHeader) -> None:
        """A worker id that never joined the block (it has no data key for it, and keys survive a
        restart) may not push to it: Join is where its settings are checked. An update trained on
        windows of another key than the one Join handed out is refused: which windows a worker
        trains is the swarm's choice (a worker that states none is older)."""
        ours = self.keys.of(header.block).get(header.worker_id)
        if ours is None:
            raise Refused("not_joined", f"{header.worker_id!r} pushed to {self.cfg.unit_name(header.block)} without "
                                        f"joining it: a worker joins before it pushes")
        if header.data_key and header.data_key != ours:
            raise MalformedInput("data_key", f"{header.worker_id} trained steps {format_steps(header.steps)} with data "
                                             f"key {header.data_key!r}, but its key here is {ours!r}")

    def drain(self) -> list[VersionInfo]:
        """Publish every open round that accepted updates (see BlockAggregator.drain)."""
        return [info for agg in self.blocks.values() if (info := agg.drain()) is not None]

    def tick(self) -> None:
        for agg in self.blocks.values():
            agg.tick()


def _named(fields: list[tuple[str, object, object]]) -> str:
    """Differing settings for a refusal: "batch: swarm has 16, worker has 8, ..."."""
    return ", ".join(f"{k}: swarm has {ours!r}, worker has {theirs!r}" for k, ours, theirs in fields)
