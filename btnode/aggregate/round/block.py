"""`BlockAggregator` owns one block: its current version, the open round, the outer optimizer and
the version store. Pushes, the deadline ticker and watchers meet here under one lock.

Memory does not grow with the number of updates (issue #25): an accepted update is summed on
arrival into the round's exact running sum (aggregate/sums/accumulate.py; the same sum in any arrival
order) and then dropped; the round keeps of it its norm, its weight, a 4,096-value sketch for the
screen, and where its raw codec bytes lie in the round's spill file (aggregate/sums/spill.py), from which
it is re-decoded and subtracted if an audit or the screen takes it out. Only the trimmed and median
rules, which need every value of every update, hold the updates (4 bytes a parameter each).

What a closed round becomes is its `RoundSink` (round/sink.py): a published version at the root
(round/publish.py), one combined update forwarded upstream at a relay (relay/forward.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import statistics
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping

import torch

from btnode.aggregate.round.config import AggregatorConfig, BlockStatus, RoundSummary, info_from_meta, version_meta
from btnode.aggregate.round.deltas import DeltaFrames
from btnode.aggregate.round.replicas import Replicas
from btnode.aggregate.round.publish import EF_PREFIX, Publisher
from btnode.aggregate.round.rounds import Round, Update
from btnode.aggregate.round.screen import screen, spilled_rule
from btnode.aggregate.round.sink import RoundSink
from btnode.aggregate.sums.accumulate import Accumulator, Sketcher, dense, norm, scaled, weight_unit
from btnode.aggregate.sums.spill import Spill
from btnode.aggregate.sums.averaging import OuterOptimizer, combine
from btnode.aggregate.trust.claims import Range, theta_ranges
from btnode.codec.codecs import Codec, decode, encode
from btnode.codec.sparse import SparseTensor
from btnode.errors import MalformedInput, PeerInputError
from btnode.protocol import INCOMPLETE, Judgement, Outcome, PushHeader, VersionInfo, format_steps
from btnode.store.files import state_sha256
from btnode.store.theta import FileTheta
from btnode.store.versions import VersionStore

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]

class BlockAggregator:
    def __init__(self, block: int, initial: Tensors, store: VersionStore, cfg: AggregatorConfig, *,
                 clock: Callable[[], float] = time.time, name: str = "", sketch_key: bytes = b"",
                 sink: RoundSink | None = None):
        """`sketch_key`: a secret the screen's sketches are drawn from (one per round from it), so that
        no worker can shape an update to look aligned in the sketch but not in fact. `sink`: what a
        closed round becomes (default `Publisher`: a published version)."""
        self.sink: RoundSink = sink if sink is not None else Publisher()
        self.block = block
        self.name = name or f"block {block}"  # in logs: "block 2", or "ar" for a DiLoCo run's whole model
        self.cfg = cfg
        self.store = store
        self.clock = clock
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
        self.held: dict[str, Update] = {}  # update id → an update of a worker on probation, awaiting its audit
        self._norms: deque[float] = deque(maxlen=50)
        # θ held in memory, or (a unit over theta_in_file_bytes) read from its version file as needed: issue #25
        self.theta_in_file = 4 * sum(t.numel() for t in initial.values()) > cfg.theta_in_file_bytes
        stored = store.latest(in_file=self.theta_in_file)
        params: Mapping[str, torch.Tensor]
        if stored is None:
            params = {n: t.detach().clone().float() for n, t in initial.items()}
            self.info = VersionInfo(block=block, version=0, base_version=0, sha256=state_sha256(params))
            store.write(0, params, meta=self.meta(self.info))
        else:
            params = stored.params
            self.info = info_from_meta(stored.meta)
            state = stored.outer
            self.outer.load_state_dict({n: t for n, t in state.items() if not n.startswith(EF_PREFIX)})
            self.residual = {n[len(EF_PREFIX):]: t for n, t in state.items() if n.startswith(EF_PREFIX)}
            if state_sha256(params) != self.info.sha256:
                raise MalformedInput("checksum", f"{self.name} version {self.info.version} on disk fails its hash")
            log.info("%s resumed at version %d (%s)", self.name, self.info.version, self.info.sha256[:12])
        self.spec = params.shapes if isinstance(params, FileTheta) else {n: tuple(t.shape) for n, t in params.items()}
        self.params = store.theta(self.info.version) if self.theta_in_file and stored is None else params
        del params, stored
        # weights are len(steps) × batch × 0.5^staleness, at most 2H × batch (aggregate/trust/claims.py)
        self.unit = weight_unit(2 * cfg.claims.steps_per_round * cfg.claims.batch)
        self._sketch_key = sketch_key
        self._holds_updates = cfg.outer.robust in ("trimmed", "median")  # they need every value at close
        self._ranges: tuple[tuple[int, str], dict[str, Range]] | None = None
        self._open(self.clock())

    def _theta_ranges(self) -> dict[str, Range]:
        """θ's per-tensor ranges for the claims check, taken once per version (aggregate/trust/claims.py
        theta_ranges), not on every push. Keyed by the version's hash: a relay adopts its parent's."""
        key = (self.info.version, self.info.sha256)
        if self._ranges is None or self._ranges[0] != key:
            self._ranges = (key, theta_ranges(self.params))
        return self._ranges[1]

    def _open(self, now: float) -> None:
        """A new round on the current version: its clock, its running sum, its spill and its sketch key."""
        self.round = Round(version=self.info.version, opened_at=now, cfg=self.cfg.round)
        self._sum = self._accumulator()  # the open round's accepted updates, summed as they arrive
        old = getattr(self, "_spill", None)
        if old is not None:
            old.close()
        self._spill = self.sink.spill(self, now)
        key = hashlib.sha256(b"btnode-sketch\0" + self._sketch_key + self.info.sha256.encode()).digest()
        self._sketcher = Sketcher(self.spec, key) if self.cfg.outer.robust != "mean" else None

    @property
    def spill_file(self) -> Spill:
        """Where the open round keeps its updates' bytes (its sink's `spill`)."""
        return self._spill

    # -- membership -------------------------------------------------------------------------
    def register(self, worker_id: str) -> None:
        with self.lock:
            if not self.registered and not self.round.accepted and not self.round.reported:
                # nobody was training this block: the round's clock starts with its first replica,
                # so a swarm that takes a while to start does not lose its first round to τ
                self.round.opened_at = self.clock()
            self.registered.add(worker_id)
            self.forgotten.discard(worker_id)
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
               hold: bool = False, amends: frozenset[str] | None = None) -> Judgement:
        """Judge and (if accepted) record a decoded, frame-validated update. `raw`: its codec bytes
        (header.codec), which the round spills so that it need not hold the update (without them, as
        in-process callers pass, the update is held). `hold`: its sender is on
        probation (aggregate/trust/audit.py): judge it in full, answer PROBATION, and hold it out of the round
        until its audit passes (`admit_held`); the round does not count its sender as reported meanwhile,
        so it waits for the audit until its deadline. `amends`: for a relay's combined update, the child
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
                if outcome is Outcome.ACCEPTED:
                    samples = self.cfg.claims.check(header, delta, self.params, drift=2 + self.cfg.round.max_staleness,
                                                    ranges=self._theta_ranges())
                    size = norm(delta)
                    self._check_norm(size)
                    scale = self._clip_factor(size)
                    self._sum.check(scaled(delta, scale) if scale != 1 else delta, samples * factor)
            except PeerInputError as exc:
                self.reject(header, exc)
                raise
            if outcome is not Outcome.ACCEPTED:
                return self._answer(header, self.round.judgement(outcome, reason))
            update = Update(worker_id=header.worker_id, update_id=header.update_id, base_version=header.base_version,
                            samples=samples, loss=header.loss, delta=delta, weight=samples * factor, norm=size,
                            scale=scale, codec=header.codec, raw=dict(raw) if raw is not None else None,
                            manifest=header.manifest)
            if hold:
                self.held[header.update_id] = update
                self.counters[(Outcome.PROBATION.value, "")] += 1
                return self._remember(header.update_id, self.round.judgement(
                    Outcome.PROBATION, "on probation: applied only once its audit passes"))
            if old is not None:
                self._withdraw(old)
                self.counters[("replaced", "")] += 1
                log.info("%s round %d: %s amended its combined update (%d → %d child updates)", self.name,
                         self.round.version, old.worker_id, len(old.manifest), len(update.manifest))
            self._take(update)
            self.counters[(Outcome.ACCEPTED.value, "")] += 1
            log.info("%s round %d: accepted the update of %s (data key %s, steps %s, CE %.4f)", self.name,
                     self.round.version, header.worker_id, header.data_key or "not stated", format_steps(header.steps),
                     header.loss)
            answer = self._remember(header.update_id, self.round.judgement(Outcome.ACCEPTED))
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

    def admit_held(self, update_id: str, *, amends: frozenset[str] = frozenset()) -> bool:
        """A held update passed its audit: into the round, if the round it was based on is still open.
        A relay's combined update held while it amends one already accepted (`amends`: that one's child
        updates, as when it was judged) takes its place, unless the round changed meanwhile. True if it got in."""
        with self.lock:
            update = self.held.pop(update_id, None)
            if update is None:
                return False
            old = self.round.accepted.get(update.worker_id)
            replaced = old is not None and bool(old.manifest) and bool(update.manifest)
            if (update.base_version != self.round.version or (old is not None and not replaced)
                    or frozenset(old.included if replaced else ()) != amends):
                self.counters[(Outcome.LATE.value, "audited_after_close")] += 1
                return False
            if replaced:
                self._withdraw(old)
                self.counters[("replaced", "")] += 1
                log.info("%s round %d: %s amended its combined update (%d → %d child updates)", self.name,
                         self.round.version, old.worker_id, len(old.manifest), len(update.manifest))
            self._take(update)
            self.counters[(Outcome.ACCEPTED.value, "")] += 1
            log.info("%s round %d: accepted the audited update of %s", self.name, self.round.version, update.worker_id)
            self._maybe_close()
            return True

    def drop(self, worker_id: str, reason: str) -> bool:
        """Take a worker's update out of the open round (its sender failed an audit, or was revoked):
        it is counted as rejected with `reason`. True if there was one."""
        with self.lock:
            self.held = {k: u for k, u in self.held.items() if u.worker_id != worker_id}
            update = self.round.accepted.get(worker_id)
            if update is None:
                return False
            self._withdraw(update)
            self.counters[(Outcome.REJECTED.value, reason)] += 1
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

    def _withdraw(self, update: Update) -> None:
        """An accepted update out of the open round again: its sum (exactly) and its count."""
        del self.round.accepted[update.worker_id]
        self._leave(update)
        self.round.counts[Outcome.ACCEPTED] -= 1
        self.counters[(Outcome.ACCEPTED.value, "")] -= 1

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

    def _check_norm(self, size: float) -> None:
        if len(self._norms) >= 3:
            ref = statistics.median(self._norms)
            if ref > 0 and size > self.cfg.max_norm_ratio * ref:
                raise MalformedInput("norm", f"update norm {size:.4g} is over {self.cfg.max_norm_ratio:g}× "
                                             f"the median accepted norm {ref:.4g}")

    def _clip_factor(self, size: float) -> float:
        """With --clip, the factor that scales an update over the median norm of recent accepted
        updates down to it (SparseLoCo clips each peer so; the norm check above refuses far larger
        ones outright); 1 otherwise."""
        if not self.cfg.clip or len(self._norms) < 3:
            return 1.0
        ref = statistics.median(self._norms)
        return ref / size if size > ref > 0 else 1.0

    def _accumulator(self) -> Accumulator:
        return Accumulator(self.spec, self.cfg.sparse_mean, unit=self.unit)

    def _values(self, update: Update) -> dict:
        """An update's values as summed: held in memory, or decoded again from the round's spill
        (bit for bit what arrived: decoding is deterministic), times its clip factor."""
        delta = update.delta
        if delta is None:
            assert update.spilled is not None
            raw = self._spill.get(update.spilled)
            delta = {n: SparseTensor.decode(b, self.spec[n], update.codec.two_bit) if update.codec.sparse
                     else decode(update.codec, b, self.spec[n]) for n, b in raw.items()}
        return scaled(delta, update.scale) if update.scale != 1 else delta

    def _take(self, update: Update) -> None:
        """Into the open round: into its running sum and its sketch, its raw bytes into the spill, and
        out of memory (unless the rule needs every update at close, or it came without raw bytes). A
        durable sink's round keeps an update handed in without its codec bytes (in process) as fp32 bytes."""
        if self.sink.durable and update.raw is None and update.delta is not None and not self._holds_updates:
            update.raw = {n: t.contiguous().view(-1).numpy().tobytes() for n, t in update.delta.items()}
            update.codec = Codec.FP32
        values = self._values(update)
        if not self._holds_updates:
            self._sum.add(values, update.weight)
        if self._sketcher is not None:
            update.sketch = self._sketcher.of(values)
        if self._holds_updates:  # fp32 on disk: the close reads them a column of coordinates at a time
            update.spilled = self._spill.put({n: t.contiguous().view(-1).numpy().tobytes()
                                              for n, t in dense(values).items()})
            update.codec, update.scale = Codec.FP32, 1.0
            update.raw = update.delta = None
        elif update.raw is not None:
            update.spilled = self._spill.put(update.raw)
            update.raw = update.delta = None
        self.replicas.recall(update.worker_id, *(e.worker_id for e in update.manifest))
        self.round.add(update)
        self.sink.took(self, update)

    def _leave(self, update: Update) -> None:
        """Out of the round's running sum again, exactly."""
        if not self._holds_updates:
            self._sum.sub(self._values(update), update.weight)

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
        """Before a shutdown: publish the open round now if it accepted anything, so that no
        update a worker was told was accepted is lost with the process."""
        with self.lock:
            return self._close("drain") if self.round.accepted and self.sink.due(self) else None

    def _maybe_close(self) -> VersionInfo | None:
        if not self.sink.due(self):
            return None
        reason = self.round.close_reason(self.clock(), self.registered)
        return self._close(reason) if reason else None

    def _screen(self, ups: list[Update]) -> tuple[list[Update], list[tuple[str, str]]]:
        """The robust screen at close (round/screen.py `screen`): the updates it drops are taken out
        of the round's sum and counted as rejected, with the reason, in the counters and metrics (their
        senders were told ACCEPTED on arrival: the round could not judge them alone). Returns the
        updates kept and (worker id, reason) of those dropped."""
        kept, dropped = screen(ups, self.cfg, f"{self.name} round {self.round.version}")
        for u, why in dropped:
            self._leave(u)
            self.counters[(Outcome.REJECTED.value, why)] += 1
            self.counters[(Outcome.ACCEPTED.value, "")] -= 1
        return kept, [(u.worker_id, why) for u, why in dropped]

    def combiner(self, ups: list[Update], *, release: bool = True) -> tuple[Callable[[str], torch.Tensor], str]:
        """(tensor name → that tensor of Δ̄, the rule's name). The round's running sum, with what the
        screen dropped already taken out; trimmed and median combine the updates they held (sparse
        ones made dense: N copies, the cost of choosing them), computing the rule once."""
        if self._holds_updates:
            return (functools.partial(spilled_rule, self._spill, ups, self.spec, self.cfg.outer),
                    combine([{"x": torch.zeros(1)}] * len(ups), [1.0] * len(ups), self.cfg.outer)[1])
        robust = self.cfg.outer.robust if len(ups) >= 3 and self.cfg.outer.robust == "screened" else "mean"
        rule = f"{robust}/{self.cfg.sparse_mean}" if any(u.codec.sparse for u in ups) else robust
        return functools.partial(self._sum.mean_of, release=release), rule

    def _close(self, reason: str) -> VersionInfo | None:
        try:
            ups, dropped = self._screen(sorted(self.round.accepted.values(), key=lambda u: u.worker_id))
            return self.sink.close(self, reason, ups, dropped)
        except BaseException:
            # the close read (and freed) part of the running sum: build it again from what the round
            # holds (its spill), exactly as it was, so that a retry publishes the same version
            self._sum = self._accumulator()
            if not self._holds_updates:
                for u in sorted(self.round.accepted.values(), key=lambda u: u.worker_id):
                    self._sum.add(self._values(u), u.weight)
            raise

    def published(self, info: VersionInfo, params: Mapping[str, torch.Tensor], residual: Tensors, ups: list[Update],
                  dropped: list[tuple[str, str]]) -> None:
        """Version `info` (θ `params`, the publish codec's error feedback `residual`), made of the kept
        updates `ups` and written durably (round/publish.py), becomes current and a new round opens."""
        self._norms.extend(u.norm for u in ups)
        self.params, self.info, self.residual = params, info, residual
        now = self.clock()
        self.recent.append(RoundSummary(info=info, closed_at=now, dropped=tuple(dropped)))
        self.rounds_closed[info.closed_by] += 1
        if info.closed_by == "deadline":
            self._forget_silent()
        self._open(now)
        log.info("%s: version %d published (%s; %d accepted, %d late, %d stale, %d rejected; loss %.4f)",
                 self.name, info.version, info.closed_by, info.accepted, info.late, info.stale, info.rejected,
                 info.mean_loss)
        self.lock.notify_all()

    def meta(self, info: VersionInfo, rule: str = "") -> dict:
        return version_meta(info, rule)

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

    def wait_for(self, after: int, timeout: float) -> VersionInfo | None:
        """The current version once it is newer than `after`, or None after `timeout` seconds."""
        with self.lock:
            self.lock.wait_for(lambda: self.info.version > after, timeout=timeout)
            return self.info if self.info.version > after else None

    def delta(self, version: int) -> tuple[VersionInfo, Codec, dict[str, bytes]]:
        codec, raw, meta = self.store.delta(version)
        return info_from_meta(meta), codec, raw

    def theta_frames(self) -> DeltaFrames:
        """The current version's θ as fp32 frames compressed in a file (aggregate/round/deltas.py), made a tensor
        at a time: what a Pull sends, built once per version rather than once per Pull (issue #25)."""
        info, theta = self.current()
        return DeltaFrames(info, Codec.FP32, ((n, encode(Codec.FP32, theta[n])) for n in self.spec), self.spec,
                           self.store.folder)

    def delta_frames(self, version: int) -> DeltaFrames:
        """The delta that produced `version` as compressed frames in a file (aggregate/round/deltas.py)."""
        codec, meta, pieces = self.store.delta_pieces(version)
        return DeltaFrames(info_from_meta(meta), codec, pieces, self.spec, self.store.folder)

