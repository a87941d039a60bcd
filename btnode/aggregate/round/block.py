"""`BlockAggregator` owns one block: its current version, the open round, the outer optimizer and
the version store. Pushes, the deadline ticker and watchers meet here under one lock.
Memory does not grow with the number of updates: the round keeps them as its `Tally` (round/tally.py).

What a closed round becomes is its `RoundSink` (round/sink.py): a published version at the root
(round/publish.py), one combined update forwarded upstream at a relay (relay/forward.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping

import torch

from btnode.aggregate.round.config import AggregatorConfig, BlockStatus, RoundSummary, info_from_meta
from btnode.aggregate.round.deltas import DeltaFrames
from btnode.aggregate.round.replicas import Replicas
from btnode.aggregate.round.publish import Publisher, resume
from btnode.aggregate.round.receipts import Receipts
from btnode.aggregate.round.repairs import ClosedRound, Repair, Repairs
from btnode.aggregate.round.rounds import Round, Update
from btnode.aggregate.round.screen import screen
from btnode.aggregate.round.sink import RoundSink
from btnode.aggregate.round.tally import Tally
from btnode.aggregate.sums.accumulate import Accumulator, norm, scaled, weight_unit
from btnode.aggregate.sums.norms import NormHistory
from btnode.aggregate.sums.spill import Spill
from btnode.aggregate.sums.averaging import OuterOptimizer
from btnode.aggregate.trust.claims import Range, theta_ranges
from btnode.aggregate.trust.standing import Standing
from btnode.codec.codecs import Codec, encode
from btnode.codec.frames import Frame, frame_from_raw
from btnode.errors import PeerInputError
from btnode.protocol import INCOMPLETE, Judgement, Outcome, PushHeader, RoundReceipt, VersionInfo, format_steps
from btnode.store.versions import VersionStore

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]

class BlockAggregator:
    def __init__(self, block: int, initial: Tensors, store: VersionStore, cfg: AggregatorConfig, *,
                 clock: Callable[[], float] = time.time, name: str = "", sketch_key: bytes = b"",
                 sink: RoundSink | None = None, standing: Standing | None = None,
                 on_settled: Callable[[str, RoundReceipt], None] | None = None):
        """`sketch_key`: a secret the screen's sketches are drawn from (one per round from it), so that
        no worker can shape an update to look aligned in the sketch but not in fact. `sink`: what a
        closed round becomes (default `Publisher`: a published version). `standing`: the identities' weight
        factors (aggregate/trust/standing.py), told of each close; None: every identity weighs 1.
        `on_settled(worker id, receipt)`: each update's round receipt, once made (round/receipts.py),
        under the block's lock."""
        self.standing = standing
        self.sink: RoundSink = sink if sink is not None else Publisher()
        self.block = block
        self.name = name or f"block {block}"  # in logs: "block 2", or "ar" for a DiLoCo run's whole model
        self.cfg, self.store, self.clock = cfg, store, clock
        self.lock = threading.Condition()
        self.outer = OuterOptimizer(cfg.outer)
        self.residual: Tensors = {}
        self.replicas = Replicas()  # the workers the round waits for (round/replicas.py); its sets, by name:
        self.registered, self.streams = self.replicas.registered, self.replicas.streams
        self.forgotten, self.missed = self.replicas.forgotten, self.replicas.missed
        self.counters: Counter = Counter()  # (outcome, reason) → count
        self.rounds_closed: Counter = Counter()  # closed_by → count
        self.recent: deque[RoundSummary] = deque(maxlen=cfg.history)
        self._answers: OrderedDict[str, Judgement] = OrderedDict()  # update id → answer (idempotent re-push)
        self.receipts = Receipts(on_settled)  # update id → APPLIED or DROPPED, once its round closed
        self.held: dict[str, Update] = {}  # update id → an update awaiting its audit's verdict (probation or drawn)
        self.norms = NormHistory(cfg.max_norm_ratio, cfg.clip)  # of recent accepted updates (sums/norms.py)
        self._norms = self.norms.recent
        # θ held in memory, or (a unit over theta_in_file_bytes) read from its version file as needed: issue #25
        self.theta_in_file = 4 * sum(t.numel() for t in initial.values()) > cfg.theta_in_file_bytes
        self.info, self.params, self.residual, self.spec = resume(store, initial, self.outer, in_file=self.theta_in_file,
                                                                  name=self.name)
        # weights are len(steps) × batch × 0.5^staleness, at most 2H × batch (aggregate/trust/claims.py)
        self.unit = weight_unit(2 * cfg.claims.steps_per_round * cfg.claims.batch)
        self._sketch_key, self._ranges = sketch_key, None  # _ranges: (version, hash) → θ's ranges (`_theta_ranges`)
        # the root keeps its last closed rounds while audits are on, to take back a revoked sender's updates
        self.repairs = (Repairs(cfg.audit.window, self.spec, cfg, self.name)
                        if cfg.audit.on and cfg.audit.window and isinstance(self.sink, Publisher) else None)
        self.correction: Tensors = {}  # what a repair adds to the next published step (`repair`)
        self._open(self.clock())

    def _theta_ranges(self) -> dict[str, Range]:
        """θ's per-tensor ranges for the claims check, taken once per version (aggregate/trust/claims.py
        theta_ranges), not on every push. Keyed by the version's hash: a relay adopts its parent's."""
        key = (self.info.version, self.info.sha256)
        if self._ranges is None or self._ranges[0] != key:
            self._ranges = (key, theta_ranges(self.params))
        return self._ranges[1]

    def _open(self, now: float) -> None:
        """A new round on the current version: its clock, and its tally (running sum, spill, sketch key)."""
        self.round = Round(version=self.info.version, opened_at=now, cfg=self.cfg.round)
        old = getattr(self, "tally", None)
        if old is not None and not old.spill_taken:
            old.spill.close()
        key = hashlib.sha256(b"btnode-sketch\0" + self._sketch_key + self.info.sha256.encode()).digest()
        self.tally = Tally(self.spec, self.cfg, self.unit, self.sink.spill(self, now), key)

    @property
    def _sum(self) -> Accumulator:  # the open round's running sum (tests read it)
        return self.tally.sum

    @property
    def _spill(self) -> Spill:  # the open round's spill (tests read it)
        return self.tally.spill

    # -- membership -------------------------------------------------------------------------
    def register(self, worker_id: str, via: str = "") -> None:
        """`worker_id` joined or watches here; `via`: the child relay that passed its join on ("": itself)."""
        with self.lock:
            if not self.registered and not self.round.accepted and not self.round.reported:
                # nobody was training this block: the round's clock starts with its first replica,
                # so a swarm that takes a while to start does not lose its first round to τ
                self.round.opened_at = self.clock()
            self.registered.add(worker_id)
            self.forgotten.discard(worker_id)
            self.replicas.joined(worker_id, via)
        self.sink.member(self, worker_id, True)

    def unregister(self, worker_id: str) -> None:
        with self.lock:
            self.registered.discard(worker_id)
            self._maybe_close()
        self.sink.member(self, worker_id, False)

    def stream_opened(self, worker_id: str) -> None:
        """A replica's version stream: it is registered while one is open here."""
        with self.lock:
            self.replicas.stream_opened(worker_id)
        self.register(worker_id)

    def stream_closed(self, worker_id: str) -> None:
        with self.lock:
            self.replicas.stream_closed(worker_id)
        self.unregister(worker_id)

    def relay_stream_opened(self, relay: str) -> None:
        """A child relay's version stream (Replicas.relay_opened)."""
        with self.lock:
            self.replicas.relay_opened(relay)

    def relay_stream_closed(self, relay: str) -> None:
        """A child relay's version stream ended. Its last, at a relay (`RoundSink.amends`): the round stops
        waiting for the children that came through it, which report through another relay if they live
        (its parent waits for them, and this round amends its push if they come here); not told upstream."""
        with self.lock:
            aside = self.replicas.relay_closed(relay, set_aside=self.sink.amends)
            if aside:
                log.info("%s round %d: relay %s has no version stream here: not waiting for the %d children that "
                         "came through it until they report or join again (%s)", self.name, self.round.version, relay,
                         len(aside), ", ".join(aside[:5]))
                self._maybe_close()

    def _forget_silent(self) -> None:
        """At a deadline close: stop waiting for replicas silent too long (Replicas.forget_silent)."""
        silent = self.replicas.forget_silent(self.round.reported)
        if silent:
            log.warning("%s round %d: not waiting any more for %d replicas that missed it without a version stream "
                        "here (%s)", self.name, self.round.version, len(silent), ", ".join(silent[:5]))

    # -- updates ----------------------------------------------------------------------------
    def precheck(self, header: PushHeader) -> Judgement | None:
        """Answer a push from its header alone when possible (re-push, late, stale), before any payload."""
        with self.lock:
            if header.update_id in self._answers:
                return self._answers[header.update_id]
            if refused := self.sink.refuses(self, header):
                return self._answer(header, self.round.judgement(Outcome.LATE, refused))
            outcome, _, reason = self.round.judge(header.worker_id, header.base_version,
                                                  replacing=self._replaces(header) is not None)
            if outcome is Outcome.LATE:
                return self._answer(header, self.round.judgement(outcome, reason))
            return None

    def answered(self, update_id: str) -> Judgement | None:
        """The answer already given to this update id (a re-push gets it again), if any."""
        with self.lock:
            return self._answers.get(update_id)

    def submit(self, header: PushHeader, delta: Tensors, *, raw: Mapping[str, bytes] | None = None,
               hold: bool = False, drawn: bool = False, amends: frozenset[str] | None = None) -> Judgement:
        """Judge and (if accepted) record a decoded, frame-validated update. `raw`: its codec bytes
        (header.codec), which the round spills so that it need not hold the update (without them, as
        in-process callers pass, the update is held). `hold`: it awaits an audit's verdict (its sender is
        on probation, or it was `drawn` after probation: aggregate/trust/audit.py): judge it in full, answer
        PROBATION (counted with reason "drawn" when drawn), and hold it out of the round until its audit passes (`admit_held`); the round
        does not count its sender as reported meanwhile, so it does not close on "all reported" before
        the verdict (it may close at its deadline without it). `amends`: for a relay's combined update, the child
        updates of the one it was checked to replace (`amends()`); if the round moved on since, it is LATE."""
        with self.lock:
            if header.update_id in self._answers:
                return self._answers[header.update_id]
            if refused := self.sink.refuses(self, header):
                return self._answer(header, self.round.judgement(Outcome.LATE, refused))
            old = self._replaces(header)
            if amends is not None and amends != frozenset(old.included if old is not None else ()):
                return self._answer(header, self.round.judgement(
                    Outcome.LATE, "the round changed while this combined update was checked; amend it again"))
            try:
                outcome, factor, reason = self.round.judge(header.worker_id, header.base_version,
                                                           replacing=old is not None)
                if outcome is Outcome.PENDING:
                    samples = self.cfg.claims.check(header, delta, self.params, drift=2 + self.cfg.round.max_staleness,
                                                    ranges=self._theta_ranges())
                    size = norm(delta)
                    self.norms.check(size)
                    scale = self.norms.clip_factor(size)
                    self.tally.sum.check(scaled(delta, scale) if scale != 1 else delta, samples * factor)
            except PeerInputError as exc:
                self.reject(header, exc)
                raise
            if outcome is not Outcome.PENDING:
                return self._answer(header, self.round.judgement(outcome, reason))
            update = Update(worker_id=header.worker_id, update_id=header.update_id, base_version=header.base_version,
                            samples=samples, loss=header.loss, delta=delta, weight=samples * factor, norm=size,
                            scale=scale, codec=header.codec, raw=dict(raw) if raw is not None else None,
                            manifest=header.manifest)
            if hold:
                self.held[header.update_id] = update
                self.counters[(Outcome.PROBATION.value, "drawn" if drawn else "")] += 1
                return self._remember(header.update_id, self.round.judgement(
                    Outcome.PROBATION, f"{'drawn for audit' if drawn else 'on probation'}: applied only once its "
                                       f"audit passes"))
            if old is not None:
                self._amend(old, update)
            self._take(update)
            self.counters[(Outcome.PENDING.value, "")] += 1
            log.info("%s round %d: took the update of %s into the round (data key %s, steps %s, CE %.4f)", self.name,
                     self.round.version, header.worker_id, header.data_key or "not stated", format_steps(header.steps),
                     header.loss)
            answer = self._remember(header.update_id, self.round.judgement(
                Outcome.PENDING, "in the round; applied or dropped when it closes (its receipt comes with the next "
                                 "version)"))
            self._maybe_close()
            return answer

    def reject(self, header: PushHeader | None, exc: PeerInputError) -> None:
        """Count a refused push (called by the RPC layer for frame errors too)."""
        outcome = Outcome.STALE if exc.reason == "stale" else Outcome.REJECTED
        with self.lock:
            self.counters[(outcome.value, exc.reason)] += 1
            if header is not None and exc.reason not in INCOMPLETE:
                self.round.note(header.worker_id, outcome, header.base_version)
                self._maybe_close()
        log.warning("%s: %s update from %s: %s", self.name, outcome.value,
                    header.worker_id if header else "?", exc)

    def admit_held(self, update_id: str, *, amends: frozenset[str] = frozenset(), close: bool = True) -> bool:
        """A held update passed its audit: into the round, if the round it was based on is still open.
        A relay's combined update held while it amends one already accepted (`amends`: that one's child
        updates, as when it was judged) takes its place, unless the round changed meanwhile. True if it got in.
        `close` False: the caller admits a batch of verdicts and closes the round after (`tick`), so that a
        round past its deadline takes every verdict of the batch, not only the first."""
        with self.lock:
            update = self.held.pop(update_id, None)
            if update is None:
                return False
            old = self.round.accepted.get(update.worker_id)
            replaced = old is not None and bool(old.manifest) and bool(update.manifest)
            if (update.base_version != self.round.version or (old is not None and not replaced)
                    or frozenset(old.included if replaced else ()) != amends):
                self.counters[(Outcome.LATE.value, "audited_after_close")] += 1
                self._settle_dropped(update, "audited_after_close", update.base_version + 1)
                return False
            if replaced:
                self._amend(old, update)
            self._take(update, verified=True)
            self.counters[(Outcome.PENDING.value, "admitted")] += 1
            log.info("%s round %d: took the audited update of %s into the round", self.name, self.round.version,
                     update.worker_id)
            if close:
                self._maybe_close()
            return True

    def drop(self, worker_id: str, reason: str) -> bool:
        """Take a worker's update out of the open round, or out of those held for a verdict (its sender
        failed an audit, or was revoked): each is DROPPED with `reason` (its receipt). True if there was one."""
        with self.lock:
            held = [u for u in self.held.values() if u.worker_id == worker_id]
            for u in held:  # held for its verdict: it never entered the round
                del self.held[u.update_id]
                self._settle_dropped(u, reason, self.round.version + 1)
            update = self.round.accepted.get(worker_id)
            if update is None:
                return bool(held)
            self._withdraw(update)
            self._settle_dropped(update, reason, self.round.version + 1)
            log.warning("%s round %d: dropped the update of %s (%s)", self.name, self.round.version, worker_id, reason)
            return True

    def _replaces(self, header: PushHeader) -> Update | None:
        """The relay's combined update accepted in this round that `header`, its amendment (a new
        update id and manifest: children that moved to it from a failed relay, or fewer children once
        the parent named some as counted already; aggregate/relay/forward.py), takes the place of."""
        old = self.round.accepted.get(header.worker_id) if header.manifest else None
        return old if old is not None and old.manifest else None

    def amends(self, header: PushHeader) -> frozenset[str]:
        """The child update ids of the combined update `header` would take the place of (none if
        it is no relay's amendment)."""
        with self.lock:
            old = self._replaces(header)
            return frozenset(old.included) if old is not None else frozenset()

    def _amend(self, old: Update, update: Update) -> None:
        """A relay's combined update `old` out of the round, for its amendment `update` to take its place."""
        self._withdraw(old)
        self.counters[("replaced", "")] += 1
        log.info("%s round %d: %s amended its combined update (%d → %d child updates)", self.name,
                 self.round.version, old.worker_id, len(old.manifest), len(update.manifest))

    def _withdraw(self, update: Update) -> None:
        """An update out of the open round again: its sum (exactly) and its count."""
        del self.round.accepted[update.worker_id]
        self.tally.leave(update)
        self.round.counts[Outcome.PENDING] -= 1

    def _settle_dropped(self, update: Update, reason: str, version: int) -> None:
        """`update` is DROPPED from `version` with `reason`: its receipt, and the count."""
        if self.receipts.settle(update.worker_id, update.update_id, version, reason) is not None:
            self.counters[(Outcome.DROPPED.value, reason)] += 1
            self._remember(update.update_id, Judgement(Outcome.DROPPED, reason, version - 1))

    def settled(self, applied: list[Update], version: int) -> None:
        """The round that made `version` closed: its kept updates `applied` are APPLIED in it (a sink
        that publishes calls this; a relay's kept updates are not applied yet), and the updates still
        held for an audit can no longer get in (admit_held needs their round open): DROPPED."""
        for u in applied:
            if self.receipts.settle(u.worker_id, u.update_id, version) is not None:
                self.counters[(Outcome.APPLIED.value, "")] += 1
                self._remember(u.update_id, Judgement(Outcome.APPLIED, "", version - 1))
        for u in self.held.values():
            self._settle_dropped(u, "audited_after_close", version)

    def receipt(self, worker_id: str, update_id: str) -> RoundReceipt | None:
        """`worker_id`'s round receipt for `update_id` (None: pending, forgotten, or another's)."""
        with self.lock:
            return self.receipts.of(worker_id, update_id)

    def receipts_for(self, worker_id: str, version: int) -> tuple[RoundReceipt, ...]:
        """The round receipts of `worker_id`'s updates decided by the round that made `version`."""
        with self.lock:
            return self.receipts.for_version(worker_id, version)

    def _answer(self, header: PushHeader, j: Judgement) -> Judgement:
        self.replicas.recall(header.worker_id)
        self.counters[(j.outcome.value, "")] += 1
        self.round.note(header.worker_id, j.outcome, header.base_version)
        self._maybe_close()
        return self._remember(header.update_id, j)

    def _remember(self, update_id: str, j: Judgement) -> Judgement:
        self._answers[update_id] = j
        while len(self._answers) > 4096:
            self._answers.popitem(last=False)
        return j

    def _take(self, update: Update, *, verified: bool = False) -> None:
        """Into the open round: into its tally (Tally.add), its senders waited for again. Its weight is its
        work times its sender's standing, or (`verified`: its own replay audit passed) its work. A durable
        sink's round keeps an update handed in without its codec bytes (in process) as fp32 bytes."""
        if self.sink.durable and update.raw is None and update.delta is not None and not self.tally.holds_updates:
            update.raw = {n: t.contiguous().view(-1).numpy().tobytes() for n, t in update.delta.items()}
            update.codec = Codec.FP32
        if self.standing is not None and not update.manifest and not verified:  # a relay's children were committed
            update.standing = self.standing.factor(update.worker_id)
            update.weight = update.work * update.standing
        self.tally.add(update)
        self.replicas.recall(update.worker_id, *(e.worker_id for e in update.manifest))
        if update.manifest:
            self.replicas.listed(update.worker_id, (e.worker_id for e in update.manifest))
        self.round.add(update)
        self.sink.took(self, update)

    # -- closing ----------------------------------------------------------------------------
    def tick(self) -> VersionInfo | None:
        """Close the round if it is due; returns the newly published version, if any. A round whose
        deadline passed with nothing accepted starts its clock again, so that replicas which come
        back together all get a full τ, rather than the first arrival closing the round alone."""
        with self.lock:
            now = self.clock()
            if not self.round.accepted and now >= self.round.deadline():
                self.round.opened_at = now
            return self._maybe_close()

    def drain(self) -> VersionInfo | None:
        """Before a shutdown: publish the open round now if it took anything in, so that no update a
        worker was told is pending is lost with the process."""
        with self.lock:
            return self._close("drain") if self.round.accepted and self.sink.due(self) else None

    def _maybe_close(self) -> VersionInfo | None:
        if not self.sink.due(self):
            return None
        reason = self.round.close_reason(self.clock(), self.registered)
        return self._close(reason) if reason else None

    def _screen(self, ups: list[Update]) -> tuple[list[Update], list[tuple[Update, str]]]:
        """The robust screen at close (round/screen.py `screen`): the updates it drops are taken out
        of the round's sum and DROPPED with the reason (their receipts; their senders were told PENDING
        on arrival: the round could not judge them alone); those it keeps weigh their vote in the sum
        (near-copies share one). Returns the updates kept and (update, reason) of those dropped."""
        out = screen(ups, self.cfg, f"{self.name} round {self.round.version}")
        for u, why in out.dropped:
            self.tally.leave(u)
            self._settle_dropped(u, why, self.round.version + 1)
        for u in out.kept:
            self.tally.reweight(u, out.weights[u.update_id])
        return out.kept, list(out.dropped)

    def _close(self, reason: str) -> VersionInfo | None:
        tally, version, keep, base = self.tally, self.round.version, self.repairs is not None, self.params
        try:
            ups, dropped = self._screen(sorted(self.round.accepted.values(), key=lambda u: u.worker_id))
            before = self.outer.state_dict() if keep else {}
            if keep:
                tally.take_spill()  # the round's bytes outlive it, for a repair (round/repairs.py)
            info = self.sink.close(self, reason, ups, [(u.worker_id, why) for u, why in dropped])
        except BaseException:
            tally.spill_taken = False
            # the close read (and freed) part of the running sum: build it again from what the round
            # holds (its spill), exactly as it was, so that a retry publishes the same version
            self.tally.rebuild(sorted(self.round.accepted.values(), key=lambda u: u.worker_id))
            raise
        if self.standing is not None:
            self.standing.closed([u.worker_id for u in ups if not u.manifest], [(u.worker_id, why) for u, why in dropped])
        if keep and self.repairs is not None:
            if info is None:
                tally.spill.close()
            else:
                self.repairs.keep(ClosedRound(version, tally, ups, [u for u, _ in dropped], before,
                                              None if self.theta_in_file else base))
        return info

    def repair(self, revoked: Callable[[str], bool]) -> Repair | None:
        """Take the updates of revoked senders back out of the kept closed rounds (round/repairs.py):
        the next published version adds the correction. None when none of them is in any kept round."""
        with self.lock:
            if self.repairs is None:
                return None
            fix = self.repairs.repair(revoked, self.outer.buffers)
            if fix is None:
                return None
            self.correction = {n: self.correction.get(n, 0) + c for n, c in fix.correction.items()}
            if self.cfg.outer.momentum:
                self.outer.load_state_dict(fix.buffers)
            self.counters[("repaired", "")] += 1
            log.warning("%s: repaired rounds %s: took out the updates of %s, put back %s; version %d+1 carries "
                        "the correction", self.name, fix.rounds, ", ".join(sorted(set(fix.removed))),
                        ", ".join(sorted(set(fix.restored))) or "none", self.info.version)
            return fix

    def published(self, info: VersionInfo, params: Mapping[str, torch.Tensor], residual: Tensors, ups: list[Update],
                  dropped: list[tuple[str, str]]) -> None:
        """Version `info` (θ `params`, the publish codec's error feedback `residual`), made of the kept
        updates `ups` and written durably (round/publish.py), becomes current and a new round opens."""
        self.norms.recent.extend(u.norm for u in ups)
        self.params, self.info, self.residual = params, info, residual
        self.correction = {}  # carried by this version (Publisher.close)
        now = self.clock()
        self.recent.append(RoundSummary(info=info, closed_at=now, dropped=tuple(dropped)))
        self.settled(ups, info.version)
        self.rounds_closed[info.closed_by] += 1
        if info.closed_by == "deadline":
            self._forget_silent()
        self._open(now)
        log.info("%s: version %d published (%s; %d accepted, %d late, %d stale, %d rejected; loss %.4f)",
                 self.name, info.version, info.closed_by, info.accepted, info.late, info.stale, info.rejected,
                 info.mean_loss)
        self.lock.notify_all()

    # -- reading ----------------------------------------------------------------------------
    def current(self) -> tuple[VersionInfo, Mapping[str, torch.Tensor]]:
        """The current version and its θ: a dict, or (θ in its file) a mapping that reads a tensor when
        asked; either way, never changed afterwards (a close makes a new one)."""
        with self.lock:
            return self.info, self.params

    def status(self) -> BlockStatus:
        with self.lock:
            return BlockStatus(block=self.block, current=self.info, replicas=tuple(sorted(self.registered)),
                               round_age_s=self.clock() - self.round.opened_at,
                               accepted_in_round=len(self.round.accepted), recent=tuple(self.recent),
                               updates=dict(self.counters), rounds_closed=dict(self.rounds_closed))

    def wait_for(self, after: int, timeout: float, *, cancelled: Callable[[], bool] = lambda: False) -> VersionInfo | None:
        """The current version once it is newer than `after`, or None after `timeout` seconds or once
        `cancelled()` (checked when the block is woken: `wake`)."""
        with self.lock:
            self.lock.wait_for(lambda: self.info.version > after or cancelled(), timeout=timeout)
            return self.info if self.info.version > after else None

    def wake(self) -> None:
        """Wake every waiter (a revocation: its streams end at once, not at their next poll)."""
        with self.lock:
            self.lock.notify_all()

    def delta(self, version: int) -> tuple[VersionInfo, Codec, dict[str, bytes]]:
        codec, raw, meta = self.store.delta(version)
        return info_from_meta(meta), codec, raw

    def theta_frames(self) -> DeltaFrames:
        """The current version's θ as fp32 frames compressed in a file (aggregate/round/deltas.py), made a tensor
        at a time: what a Pull sends, built once per version rather than once per Pull (issue #25)."""
        info, theta = self.current()
        return DeltaFrames(info, Codec.FP32, ((n, encode(Codec.FP32, theta[n])) for n in self.spec), self.spec,
                           self.store.folder)

    def delta_pieces(self, version: int) -> tuple[VersionInfo, Iterator[Frame]]:
        """The delta that produced `version` as a frame a tensor, read from the store one at a time: what a
        reader older than bundles fetches (codec/bundles.py)."""
        codec, meta, pieces = self.store.delta_pieces(version)
        return info_from_meta(meta), (frame_from_raw(n, self.spec[n], codec, raw) for n, raw in pieces)

    def delta_frames(self, version: int) -> DeltaFrames:
        """The delta that produced `version` as compressed frames in a file (aggregate/round/deltas.py)."""
        codec, meta, pieces = self.store.delta_pieces(version)
        return DeltaFrames(info_from_meta(meta), codec, pieces, self.spec, self.store.folder)

