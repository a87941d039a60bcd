"""`BlockAggregator` owns one block: its current version, the open round, the outer optimizer and
the version store. Pushes, the deadline ticker and watchers meet here under one lock.

Memory does not grow with the number of updates (issue #25): an accepted update is summed on
arrival into the round's exact running sum (aggregate/accumulate.py; the same sum in any arrival
order) and then dropped; the round keeps of it its norm, its weight, a 4,096-value sketch for the
screen, and where its raw codec bytes lie in the round's spill file (aggregate/spill.py), from which
it is re-decoded and subtracted if an audit or the screen takes it out. Only the trimmed and median
rules, which need every value of every update, hold the updates (4 bytes a parameter each).

Publishing version v+1, tensor by tensor (so that the close's temporaries are one tensor, not one
block): the mean of the kept updates, the outer step, encode it with the publish codec, decode it
again and add it to θ^v exactly as every worker will; then hash the result, write it durably, and
only then announce it.
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
from dataclasses import dataclass, field

import torch

from btnode.aggregate.accumulate import SPARSE_MEANS, Accumulator, Sketcher, dense, norm, scaled, weight_unit
from btnode.aggregate.audit import AuditConfig
from btnode.aggregate.claims import ClaimConfig, Range, theta_ranges
from btnode.aggregate.deltas import DeltaFrames
from btnode.aggregate.evidence import RelayAuditConfig
from btnode.aggregate.averaging import OuterConfig, OuterOptimizer, combine
from btnode.aggregate.rounds import Round, RoundConfig, Update
from btnode.aggregate.screen import sketch_cosines, spilled_rule
from btnode.aggregate.spill import Spill
from btnode.codec.codecs import Codec, decode, encode, parse
from btnode.codec.sparse import SparseTensor, keep_of
from btnode.errors import ConfigError, MalformedInput, PeerInputError
from btnode.protocol import Judgement, Outcome, PushHeader, VersionInfo, format_steps
from btnode.settings import flag
from btnode.store.files import Streamed, state_sha256
from btnode.store.theta import IN_FILE_BYTES, Applied, FileTheta
from btnode.store.versions import VersionStore

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]
EF_PREFIX = "ef."  # publish-codec error feedback, stored with the outer state
ABORTED = "aborted"  # reason for a push whose sender vanished mid-stream: it may still re-push
# An update that did not arrive whole says nothing about whether its replica is done with the round
# (a dropped connection can look like either reason), so these do not count as the replica reporting.
INCOMPLETE = {ABORTED, "truncated"}


@dataclass(frozen=True)
class AggregatorConfig:
    round: RoundConfig = RoundConfig()
    outer: OuterConfig = OuterConfig()
    claims: ClaimConfig = ClaimConfig()  # the swarm's batch, H and inner lr: an update's weight and bound
    audit: AuditConfig = AuditConfig()  # replay audits: share, probation, how long a state may take
    relay_audit: RelayAuditConfig = RelayAuditConfig()  # relays' combined pushes checked bit for bit (evidence.py)
    update_codecs: tuple[Codec, ...] = tuple(Codec)
    publish_codec: Codec = flag("--publish-codec", "Codec of published deltas: fp32, bf16, int8, sparse8, sparse2.",
                                default=Codec.FP32, value=str, parse=parse,
                                format=lambda c: c.name.lower())  # every replica applies these same bytes, lossy or not
    publish_density: float = flag("--publish-density", "Share of values a sparse publish codec sends (0, 1].",
                                  default=0.03)  # a sparse publish codec keeps the top of step + residual
    keep: int = flag("--keep", "Versions kept on disk per block.", default=3)  # versions kept on disk
    max_norm_ratio: float = 10.0  # reject an update whose norm exceeds this × the median accepted norm
    screen_band: tuple[float, float] = (0.5, 2.0)  # screened mode: keep norms within this × the round's median
    screen_cosine: float = 0.7  # screened mode: drop a cosine with the median update under this × the round's median cosine
    history: int = 20  # round summaries kept for status
    theta_in_file_bytes: int = IN_FILE_BYTES  # a unit larger in fp32 keeps θ in its version file, not in memory
    sparse_mean: str = flag("--sparse-mean", "How sparse updates are averaged per coordinate: senders (over the updates "
                                             "that sent it) or all (docs/tuning.md).", default="senders")
    decode_slots: int = flag("--decode-slots", "Pushes decoded and judged at once; the others wait, holding only "
                                               "their compressed bytes (bounds the memory of pushes in flight). "
                                               "Of a unit over 64 MiB, one at a time.",
                             default=2)
    mmap_threshold_kib: int = flag("--mmap-threshold-kib", "glibc's mmap threshold: freed blocks from this size up "
                                                           "go back to the kernel at once. 0: the role's default "
                                                           "(aggregator 128, relay 4096; docs/operations.md).",
                                   default=0)  # memory against page faults (node/memory.py)
    clip: bool = flag("--clip/--no-clip", "Scale an update larger than the median norm of recent accepted updates "
                                          "down to it before averaging.", default=False)

    def __post_init__(self) -> None:
        if not 0 < self.publish_density <= 1:
            raise ConfigError(f"--publish-density must be in (0, 1], got {self.publish_density}")
        if self.decode_slots < 1:
            raise ConfigError(f"--decode-slots must be at least 1, got {self.decode_slots}")
        if self.mmap_threshold_kib < 0:
            raise ConfigError(f"--mmap-threshold-kib must be 0 (the role's default) or more, got {self.mmap_threshold_kib}")
        if self.sparse_mean not in SPARSE_MEANS:
            raise ConfigError(f"--sparse-mean must be one of {SPARSE_MEANS}, got {self.sparse_mean!r}")


@dataclass(frozen=True)
class RoundSummary:
    info: VersionInfo
    closed_at: float
    dropped: tuple[tuple[str, str], ...] = ()  # (worker id, reason) of each update the robust screen dropped


@dataclass(frozen=True)
class BlockStatus:
    """One block at one instant, read under its lock (`BlockAggregator.status`): what the Status
    RPC and /metrics report. The mappings are copies, so the aggregator moving on leaves it as it was."""

    block: int
    current: VersionInfo
    replicas: tuple[str, ...]  # registered workers, sorted
    round_age_s: float  # since the open round's clock started
    accepted_in_round: int
    recent: tuple[RoundSummary, ...]  # the last `history` closed rounds, oldest first
    updates: Mapping[tuple[str, str], int]  # (outcome, reason) → pushes, in the order first seen
    rounds_closed: Mapping[str, int]  # closed_by → rounds
    data_keys: Mapping[str, str] = field(default_factory=dict)  # worker id → data key (filled by SwarmAggregator)
    relays: tuple = ()  # manifests.RelayRecord of each relay pushing here (filled by SwarmAggregator)


FORGET_AFTER = 2  # deadline rounds in a row a replica without a stream here may miss before it is not waited for

class BlockAggregator:
    def __init__(self, block: int, initial: Tensors, store: VersionStore, cfg: AggregatorConfig, *,
                 clock: Callable[[], float] = time.time, name: str = "", sketch_key: bytes = b""):
        """`sketch_key`: a secret the screen's sketches are drawn from (one per round from it), so that
        no worker can shape an update to look aligned in the sketch but not in fact."""
        self.block = block
        self.name = name or f"block {block}"  # in logs: "block 2", or "ar" for a DiLoCo run's whole model
        self.cfg = cfg
        self.store = store
        self.clock = clock
        self.lock = threading.Condition()
        self.outer = OuterOptimizer(cfg.outer)
        self.residual: Tensors = {}
        self.registered: set[str] = set()
        self.streams: Counter = Counter()  # worker id → its version streams open here (rpc/server.py Watch)
        self.forgotten: set[str] = set()  # not waited for since they missed rounds (`_forget_silent`)
        self.missed: Counter = Counter()  # worker id → deadline rounds in a row it missed without a stream here
        self.counters: Counter = Counter()  # (outcome, reason) → count
        self.rounds_closed: Counter = Counter()  # closed_by → count
        self.recent: deque[RoundSummary] = deque(maxlen=cfg.history)
        self._answers: OrderedDict[str, Judgement] = OrderedDict()  # update id → answer (idempotent re-push)
        self.held: dict[str, Update] = {}  # update id → an update of a worker on probation, awaiting its audit
        self._norms: deque[float] = deque(maxlen=50)
        # θ held in memory, or (a unit over theta_in_file_bytes) read from its version file as needed: issue #25
        self._theta_in_file = 4 * sum(t.numel() for t in initial.values()) > cfg.theta_in_file_bytes
        stored = store.latest(in_file=self._theta_in_file)
        params: Mapping[str, torch.Tensor]
        if stored is None:
            params = {n: t.detach().clone().float() for n, t in initial.items()}
            self.info = VersionInfo(block=block, version=0, base_version=0, sha256=state_sha256(params))
            store.write(0, params, meta=self._meta(self.info))
        else:
            params = stored.params
            self.info = _info_from_meta(stored.meta)
            state = stored.outer
            self.outer.load_state_dict({n: t for n, t in state.items() if not n.startswith(EF_PREFIX)})
            self.residual = {n[len(EF_PREFIX):]: t for n, t in state.items() if n.startswith(EF_PREFIX)}
            if state_sha256(params) != self.info.sha256:
                raise MalformedInput("checksum", f"{self.name} version {self.info.version} on disk fails its hash")
            log.info("%s resumed at version %d (%s)", self.name, self.info.version, self.info.sha256[:12])
        self.spec = params.shapes if isinstance(params, FileTheta) else {n: tuple(t.shape) for n, t in params.items()}
        self.params = store.theta(self.info.version) if self._theta_in_file and stored is None else params
        del params, stored
        # weights are len(steps) × batch × 0.5^staleness, at most 2H × batch (aggregate/claims.py)
        self.unit = weight_unit(2 * cfg.claims.steps_per_round * cfg.claims.batch)
        self._sketch_key = sketch_key
        self._holds_updates = cfg.outer.robust in ("trimmed", "median")  # they need every value at close
        self._ranges: tuple[tuple[int, str], dict[str, Range]] | None = None
        self._open(self.clock())

    def _theta_ranges(self) -> dict[str, Range]:
        """θ's per-tensor ranges for the claims check, taken once per version (aggregate/claims.py
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
        self._spill = self._round_spill(now)
        key = hashlib.sha256(b"btnode-sketch\0" + self._sketch_key + self.info.sha256.encode()).digest()
        self._sketcher = Sketcher(self.spec, key) if self.cfg.outer.robust != "mean" else None

    def _round_spill(self, now: float) -> Spill:
        """Where the new round keeps its updates' bytes: an unnamed file (aggregate/spill.py)."""
        return Spill(self.store.folder)

    # -- membership -------------------------------------------------------------------------
    def register(self, worker_id: str) -> None:
        with self.lock:
            if not self.registered and not self.round.accepted and not self.round.reported:
                # nobody was training this block: the round's clock starts with its first replica,
                # so a swarm that takes a while to start does not lose its first round to τ
                self.round.opened_at = self.clock()
            self.registered.add(worker_id)
            self.forgotten.discard(worker_id)

    def unregister(self, worker_id: str) -> None:
        with self.lock:
            self.registered.discard(worker_id)
            self._maybe_close()

    def stream_opened(self, worker_id: str) -> None:
        """A replica's version stream: it is registered while one is open here."""
        with self.lock:
            self.streams[worker_id] += 1
        self.register(worker_id)

    def stream_closed(self, worker_id: str) -> None:
        with self.lock:
            self.streams[worker_id] -= 1
            if self.streams[worker_id] <= 0:
                del self.streams[worker_id]
        self.unregister(worker_id)

    def _forget_silent(self) -> None:
        """At a deadline close: stop waiting for the registered workers that missed FORGET_AFTER deadline
        rounds in a row without a version stream here (workers under relays: their relay tells us when
        their streams end, but a relay that died cannot), until they report again (`_recall`). Not after
        one: a dead relay's live children join again through a spare and report in the next round,
        whose close must wait for them (forgotten after one round, they were not, and the spare's
        push came late: 95 updates lost in a kill run at N = 1,024)."""
        missing = [w for w in self.registered - self.round.reported if not self.streams.get(w)]
        for w in set(self.missed) - set(missing):
            del self.missed[w]
        self.missed.update(missing)
        silent = sorted(w for w in missing if self.missed[w] >= FORGET_AFTER)
        for w in silent:
            del self.missed[w]
        if silent:
            self.registered.difference_update(silent)
            self.forgotten.update(silent)
            log.warning("%s round %d: not waiting any more for %d replicas that missed it without a version stream "
                        "here (%s)", self.name, self.round.version, len(silent), ", ".join(silent[:5]))

    # -- updates ----------------------------------------------------------------------------
    def precheck(self, header: PushHeader) -> Judgement | None:
        """Answer a push from its header alone when possible (re-push, late, stale), before any payload."""
        with self.lock:
            if header.update_id in self._answers:
                return self._answers[header.update_id]
            outcome, _, reason = self.round.judge(header.worker_id, header.base_version,
                                                  replacing=self._replaces(header) is not None)
            if outcome is Outcome.LATE:
                return self._answer(header, self.round.judgement(outcome, reason))
            return None

    def closes_in(self, version: int) -> float:
        """Seconds until the deadline of the open round, if it is `version`'s (0 otherwise): told to a
        relay whose combined push it took, so that the relay knows how long it may still amend it."""
        with self.lock:
            return max(0.0, self.round.deadline() - self.clock()) if self.round.version == version else 0.0

    def answered(self, update_id: str) -> Judgement | None:
        """The answer already given to this update id (a re-push gets it again), if any."""
        with self.lock:
            return self._answers.get(update_id)

    def submit(self, header: PushHeader, delta: Tensors, *, raw: Mapping[str, bytes] | None = None,
               hold: bool = False, amends: frozenset[str] | None = None) -> Judgement:
        """Judge and (if accepted) record a decoded, frame-validated update. `raw`: its codec bytes
        (header.codec), which the round spills so that it need not hold the update (without them, as
        in-process callers pass, the update is held). `hold`: its sender is on
        probation (aggregate/audit.py): judge it in full, answer PROBATION, and hold it out of the round
        until its audit passes (`admit_held`); the round does not count its sender as reported meanwhile,
        so it waits for the audit until its deadline. `amends`: for a relay's combined update, the child
        updates of the one it was checked to replace (`amends()`); if the round moved on since, it is LATE."""
        with self.lock:
            if header.update_id in self._answers:
                return self._answers[header.update_id]
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
        the parent named some as counted already; aggregate/relay.py), takes the place of."""
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

    def _recall(self, *workers: str) -> None:
        """Workers that reported again (any answer, or listed in a relay's manifest) are waited for again."""
        back = self.forgotten.intersection(workers)
        self.forgotten.difference_update(back)
        for w in workers:
            self.missed.pop(w, None)
        self.registered.update(back)

    def _answer(self, header: PushHeader, j: Judgement) -> Judgement:
        self._recall(header.worker_id)
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
        out of memory (unless the rule needs every update at close, or it came without raw bytes)."""
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
        self._recall(update.worker_id, *(e.worker_id for e in update.manifest))
        self.round.add(update)

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
            return self._close("drain") if self.round.accepted else None

    def _maybe_close(self) -> VersionInfo | None:
        reason = self.round.close_reason(self.clock(), self.registered)
        return self._close(reason) if reason else None

    def _screen(self, ups: list[Update]) -> tuple[list[Update], list[tuple[str, str]]]:
        """Robust mode, with at least 3 updates: before combining, drop an update whose norm is
        outside the band around the round's median norm (screened: `screen_band`, [0.5, 2]×, which
        also drops zero, tiny and replayed updates; trimmed and median: over max_norm_ratio×), or
        whose cosine with the weighted sum of the others is negative (sign-flipped updates) or,
        screened, under `screen_cosine` × the round's median cosine (an update trained on other data
        drifts away from the others). Cosines are read from the updates' sketches (accumulate.Sketcher:
        4,096 values each, whatever the block's size), so the screen needs no update in memory.
        Deterministic: the same updates in worker-id order drop the same ones, in any arrival order.
        Their senders were told ACCEPTED on arrival (the round could not judge them alone); they are
        taken out of the round's sum and counted as rejected here, with the reason, in the counters
        and metrics. Returns the updates kept and (worker id, reason) of those dropped."""
        if self.cfg.outer.robust == "mean" or len(ups) < 3:
            return ups, []
        screened = self.cfg.outer.robust == "screened"
        low, high = self.cfg.screen_band if screened else (0.0, self.cfg.max_norm_ratio)
        norms = [u.norm for u in ups]
        ref = statistics.median(norms)
        cosines = sketch_cosines(ups)
        least = max(0.0, self.cfg.screen_cosine * statistics.median(cosines)) if screened else 0.0
        kept, dropped = [], []
        for u, size, cos in zip(ups, norms, cosines):
            why = ("norm" if ref > 0 and not low * ref <= size <= high * ref else
                   "direction" if cos < least else "")
            if why:
                dropped.append((u, f"{why}_at_close"))
                log.warning("%s round %d: dropping the update of %s at close (%s: norm %.4g vs median %.4g, "
                            "cosine %.3f with the others, least %.3f)", self.name, self.round.version,
                            u.worker_id, why, size, ref, cos, least)
            else:
                kept.append(u)
        if not kept:
            return ups, []
        for u, why in dropped:
            self._leave(u)
            self.counters[(Outcome.REJECTED.value, why)] += 1
            self.counters[(Outcome.ACCEPTED.value, "")] -= 1
        return kept, [(u.worker_id, why) for u, why in dropped]

    def _combiner(self, ups: list[Update], *, release: bool = True) -> tuple[Callable[[str], torch.Tensor], str]:
        """(tensor name → that tensor of Δ̄, the rule's name). The round's running sum, with what the
        screen dropped already taken out; trimmed and median combine the updates they held (sparse
        ones made dense: N copies, the cost of choosing them), computing the rule once."""
        if self._holds_updates:
            return (functools.partial(spilled_rule, self._spill, ups, self.spec, self.cfg.outer),
                    combine([{"x": torch.zeros(1)}] * len(ups), [1.0] * len(ups), self.cfg.outer)[1])
        robust = self.cfg.outer.robust if len(ups) >= 3 and self.cfg.outer.robust == "screened" else "mean"
        rule = f"{robust}/{self.cfg.sparse_mean}" if any(u.codec.sparse for u in ups) else robust
        return functools.partial(self._sum.mean_of, release=release), rule

    def _close(self, reason: str) -> VersionInfo:
        try:
            return self._publish(reason)
        except BaseException:
            # the close read (and freed) part of the running sum: build it again from what the round
            # holds (its spill), exactly as it was, so that a retry publishes the same version
            self._sum = self._accumulator()
            if not self._holds_updates:
                for u in sorted(self.round.accepted.values(), key=lambda u: u.worker_id):
                    self._sum.add(self._values(u), u.weight)
            raise

    def _publish(self, reason: str) -> VersionInfo:
        ups, dropped = self._screen(sorted(self.round.accepted.values(), key=lambda u: u.worker_id))
        mean_of, rule = self._combiner(ups)
        # Tensor by tensor: a round's close is the aggregator's memory peak (bench/scale.py measures
        # it), and a unit may be large; each temporary is one tensor, dropped as soon as it is used.
        codec = self.cfg.publish_codec
        keep = keep_of(self.cfg.publish_density)
        raw, made, residual = {}, {}, dict(self.residual)
        for n in self.spec:
            step = self.outer.step({n: mean_of(n)})[n]
            if codec is not Codec.FP32:  # error feedback on the published step
                step = step + residual.get(n, 0)
            raw[n] = encode(codec, step, keep=keep)
            decoded = decode(codec, raw[n], self.spec[n])
            if codec is not Codec.FP32:
                residual[n] = step - decoded
            del step
            if not self._theta_in_file:
                made[n] = self.params[n] + decoded
            del decoded
        # θ in its file: θ^{v+1} is made a tensor at a time from θ^v's file and the delta, the same
        # float operations as above, twice (hashed in sorted order, then written in the file's order)
        params = Applied(self.params, raw, codec, self.spec) if self._theta_in_file else made
        counts = self.round.counts
        info = VersionInfo(block=self.block, version=self.info.version + 1, base_version=self.info.version,
                           sha256=state_sha256(params), delta_codec=codec, accepted=len(ups),
                           late=counts[Outcome.LATE], stale=counts[Outcome.STALE],
                           rejected=counts[Outcome.REJECTED] + len(dropped),
                           mean_loss=sum(u.loss for u in ups) / len(ups), closed_by=reason,
                           included=tuple(i for u in ups for i in u.included))
        outer_state = {**self.outer.buffers, **{EF_PREFIX + n: r for n, r in residual.items()}}  # read, not copied
        self.store.write(info.version, Streamed(self.spec, params.items) if self._theta_in_file else params,
                         meta=self._meta(info, rule), delta_raw=raw, delta_codec=codec, outer=outer_state)
        del raw
        if self._theta_in_file:
            params = self.store.theta(info.version)
        self._norms.extend(u.norm for u in ups)
        self.params, self.info, self.residual = params, info, residual
        now = self.clock()
        self.recent.append(RoundSummary(info=info, closed_at=now, dropped=tuple(dropped)))
        self.rounds_closed[reason] += 1
        if reason == "deadline":
            self._forget_silent()
        self._open(now)
        log.info("%s: version %d published (%s; %d accepted, %d late, %d stale, %d rejected; loss %.4f)",
                 self.name, info.version, reason, info.accepted, info.late, info.stale, info.rejected, info.mean_loss)
        self.lock.notify_all()
        return info

    def _meta(self, info: VersionInfo, rule: str = "") -> dict:
        return {"info": {**info.__dict__, "delta_codec": info.delta_codec.name}, "rule": rule}

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
        return _info_from_meta(meta), codec, raw

    def theta_frames(self) -> DeltaFrames:
        """The current version's θ as fp32 frames compressed in a file (aggregate/deltas.py), made a tensor
        at a time: what a Pull sends, built once per version rather than once per Pull (issue #25)."""
        info, theta = self.current()
        return DeltaFrames(info, Codec.FP32, ((n, encode(Codec.FP32, theta[n])) for n in self.spec), self.spec,
                           self.store.folder)

    def delta_frames(self, version: int) -> DeltaFrames:
        """The delta that produced `version` as compressed frames in a file (aggregate/deltas.py)."""
        codec, meta, pieces = self.store.delta_pieces(version)
        return DeltaFrames(_info_from_meta(meta), codec, pieces, self.spec, self.store.folder)


def _info_from_meta(meta: dict) -> VersionInfo:
    d = dict(meta["info"])
    d["delta_codec"] = Codec[d["delta_codec"]]
    d["included"] = tuple(d.get("included", ()))
    return VersionInfo(**d)
