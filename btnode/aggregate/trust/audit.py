"""Replay audits (docs/security.md, "Work claims and replay audits"): the aggregator re-runs a share
of accepted updates and compares the result with what was pushed.

Every push carries a `WorkClaim`: the base θ by hash, the data, the worker's recipe, and the hashes
of its inner AdamW state and error-feedback residual at the start and end of the round. `Chains`
checks that each round starts where the worker's previous one ended (a fresh state after a join),
so every change of a worker's state is inside some claimed round.

Which updates are replayed is drawn per update by HMAC(secret, update id) < p, with a secret the
worker never sees, after the update is committed: a worker cannot tell which of its updates will be
checked. A drawn update's sender is asked for its start state (`Judgement.audit`); its hashes must
match the claim. `Replayer` then trains the claimed steps on the claimed windows from θ^base and
that state, exactly as a worker does (the same trainer, sampler and `encode_update`), and compares
codec bytes: bit for bit when the worker's recipe equals the auditor's (CPU, same torch and thread
count), within a relative tolerance otherwise. New workers are on probation: every update is
replayed, and none is applied, until they have passed `probation` audits. A drawn update is held
out of its round until its verdict, like a probation one, so a drawn cheat is never published.

Who replays is a `Verifier` (the round and aggregate/replays.py's ReplayDesk talk to nothing else):
`LocalReplays`, the aggregator's own `Replayer`s, is the first; delegated verifiers go behind it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from btnode.codec.codecs import decode, keep_in
from btnode.data.source import ByteSource
from btnode.errors import ConfigError, MalformedInput
from btnode.model.config import ModelConfig
from btnode.protocol import EMPTY_STATE, OPTIMIZER_PREFIX, RESIDUAL_PREFIX, PushHeader, WorkClaim
from btnode.settings import flag
from btnode.store.files import state_sha256
from btnode.train.config import TrainConfig
from btnode.train.recipe import Recipe
from btnode.train.replay import RoundReplay, split_state, torch_threads

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]


# Why p = 0.25 (docs/security.md, "Work claims and replay audits"): a replay costs what the update's
# training cost (bench/results/replay-cost: 1.01×), so the aggregator spends p × the workers' compute on
# audits (the cheats bench measured 0.23 of it at p = 0.25). An attacker with k ids that cheats for r rounds
# is missed with (1 − p)^(k·r): 0.32 for one id over 4 rounds, 0.032 for 3 ids over 4 rounds, 0.001 for 3
# over 8; and one caught id makes every id of its rounds a suspect (drawn for sure) and takes back what the
# caught ones added within the last `window` rounds (round/repairs.py). p = 0.1 would miss 3 ids over 4
# rounds with 0.28, at 0.4 the auditor would need 40% of the swarm's compute.
DEFAULT_SHARE = 0.25


@dataclass(frozen=True)
class AuditConfig:
    share: float = flag("--audit", "Share p of accepted updates the aggregator replays to check them, held out of "
                                   "their round until the verdict (0: no audits). Default 0.25: a replay costs one "
                                   "worker's round, so audits cost p × the workers' compute; a 3-id cheat goes 4 "
                                   "rounds unseen with 0.75^12 = 0.03. Replays run on --data (default: the bundled "
                                   "corpus). docs/security.md.", default=DEFAULT_SHARE)
    probation: int = flag("--probation", "With --audit: audits a new worker id must pass before any of its updates is "
                                         "applied.", default=2)
    state_timeout_s: float = flag("--audit-timeout", "Seconds a worker has to send the start state of an update "
                                                     "drawn for audit.", default=120.0)
    abandon_limit: int = 3  # audits a worker id may leave unanswered by rejoining (a crash), plus one per 20 it passed
    tolerance: float = 1e-3  # relative L2 error allowed when the recipes differ (1 vs 2 threads: 8.5e-5 at H = 25)
    window: int = 4  # closed rounds kept to repair (round/repairs.py), and a suspect's updates all drawn; workers keep 4 states

    def __post_init__(self) -> None:
        if (not 0 <= self.share <= 1 or self.probation < 0 or self.state_timeout_s <= 0 or not self.tolerance > 0
                or self.window < 0):
            raise ConfigError(f"invalid audit settings: {self}")

    @property
    def on(self) -> bool:
        return self.share > 0


@dataclass
class AuditJob:
    header: PushHeader
    claim: WorkClaim
    train: TrainConfig  # the worker's, as stated at Join
    raw: dict[str, bytes]  # the pushed codec bytes, kept until the verdict
    base: Mapping[str, torch.Tensor]  # θ^base_version
    arrived: float
    probation: bool
    start: Tensors | None = None  # the uploaded start state (opt.* and ef.*); {} when both are fresh
    later: bool = False  # opened after its push was answered (aggregate/replays.py `ReplayDesk.later`): its
    #   sender hears of it with a version (states_wanted), and one that never sends it is not thereby a cheat

    @property
    def needs_state(self) -> bool:
        return self.claim.optimizer_start != EMPTY_STATE or self.claim.residual_start != EMPTY_STATE


@dataclass(frozen=True)
class Verdict:
    header: PushHeader
    passed: bool
    reason: str  # "" when passed; else delta, optimizer_end, residual_end, steps, state, late_state, recipe
    detail: str
    seconds: float  # the replay's wall time (what the auditor spent on it)
    probation: bool
    delay_s: float  # from the push's arrival to the verdict


def secret_draw(secret: bytes, update_id: str) -> float:
    """A uniform number in [0, 1) that only the holder of `secret` can compute before the update exists."""
    digest = hmac.new(secret, update_id.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class Verifier(Protocol):
    """Who decides drawn updates (the audit backend). ReplayDesk (aggregate/replays.py) hands it the
    jobs whose start state is in and collects verdicts; it never sees a round, so a verifier may
    answer at once (`LocalReplays`) or later (delegated to other workers), in any order."""

    def start_spec(self, block: int, claim: WorkClaim) -> dict[str, tuple[int, ...]]:
        """What the start state of an update of `block` with this claim must hold (its sender uploads it)."""
        ...

    def check_start(self, block: int, claim: WorkClaim, state: Mapping[str, torch.Tensor]) -> None:
        """MalformedInput unless an uploaded start state is the one the claim committed to."""
        ...

    def submit(self, job: AuditJob) -> None:
        """Verify this job (its start state is in)."""
        ...

    def verdicts(self) -> list[Verdict]:
        """The verdicts reached since the last call; a job that could not be verified gives none."""
        ...

    def forget(self, worker_id: str) -> None:
        """Drop the pending jobs of a punished worker: nothing is left to decide about it."""
        ...

    def outcomes(self) -> tuple[list[tuple[str, str, str]], dict[str, int]]:
        """Since the last call: (verifiers found lying, as (name, reason, detail), to revoke; verifiers
        whose replays an upheld verdict agreed with → how many: verified work of theirs)."""
        ...


class Replayer:
    """Re-runs a claimed round of one unit (train/replay.py `RoundReplay`) and judges it against the
    pushed bytes and claim. Holds no lock and no swarm state: give it a job, get a verdict."""

    def __init__(self, cfg: ModelConfig, unit: int, corpus: ByteSource | bytes, *, tolerance: float):
        self.cfg, self.unit, self.tolerance = cfg, unit, tolerance
        self.replay = RoundReplay(cfg, unit, corpus)
        self.shapes, self.optimizer_shapes = self.replay.shapes, self.replay.optimizer_shapes

    def start_spec(self, claim: WorkClaim) -> dict[str, tuple[int, ...]]:
        """What the start state of an update with this claim must hold: the optimizer's tensors unless
        the optimizer was fresh, and the residual unless there was none."""
        spec: dict[str, tuple[int, ...]] = {}
        if claim.optimizer_start != EMPTY_STATE:
            spec.update({OPTIMIZER_PREFIX + n: s for n, s in self.optimizer_shapes.items()})
        if claim.residual_start != EMPTY_STATE:
            spec.update({RESIDUAL_PREFIX + n: s for n, s in self.shapes.items()})
        return spec

    def check_start(self, claim: WorkClaim, state: Mapping[str, torch.Tensor]) -> None:
        """MalformedInput("state") unless an uploaded start state hashes to what the claim committed."""
        optim, residual = split_state(state)
        if state_sha256(optim) != claim.optimizer_start or state_sha256(residual) != claim.residual_start:
            raise MalformedInput("state", "the start state sent does not hash to the one its update's claim committed")

    def __call__(self, job: AuditJob, clock: Callable[[], float]) -> Verdict:
        t0 = time.perf_counter()  # the clock a worker's train_seconds uses, so the two compare
        passed, reason, detail = self._replay(job)
        return Verdict(job.header, passed, reason, detail, time.perf_counter() - t0, job.probation,
                       clock() - job.arrived)

    def _replay(self, job: AuditJob) -> tuple[bool, str, str]:
        steps = job.header.steps
        if not steps or any(b != a + 1 for a, b in zip(steps, steps[1:])):
            return False, "steps", f"steps {steps[:3]}… are not one run of consecutive steps, as a worker trains a round"
        try:
            theirs = Recipe.from_json(job.claim.recipe)
        except MalformedInput as exc:
            return False, "recipe", str(exc)
        with torch_threads(theirs.threads if theirs.device == "cpu" else torch.get_num_threads()):
            return self._run(job, theirs)

    def _run(self, job: AuditJob, theirs: Recipe) -> tuple[bool, str, str]:
        """The replay itself, under the worker's thread count where it trained on CPU."""
        h, claim = job.header, job.claim
        res = self.replay.run(h, job.train, job.base, job.start or {}, keep=keep_in(h.codec, job.raw),
                              error_feedback=theirs.error_feedback)
        raw = res.raw
        exact = theirs.exact_with(Recipe.here(torch.device("cpu"), theirs.precision,
                                              error_feedback=theirs.error_feedback))
        if exact and raw != job.raw:
            bad = next(n for n in raw if raw[n] != job.raw.get(n))
            return False, "delta", f"the replay's {bad} differs from the pushed bytes (recipe {theirs.to_json()})"
        if not exact:
            err = self._relative_error(raw, job.raw, h)
            if not err <= self.tolerance:
                return False, "delta", f"the replay differs from the pushed delta by {err:.3g} (relative L2; " \
                                       f"tolerance {self.tolerance:g} for a recipe other than the auditor's)"
            return True, "", f"within tolerance ({err:.3g})"
        if res.optimizer_end != claim.optimizer_end:
            return False, "optimizer_end", "the replay's optimizer state differs from the claimed end state"
        if res.residual_end != claim.residual_end:
            return False, "residual_end", "the replay's residual differs from the claimed end residual"
        return True, "", "bit for bit"

    def _relative_error(self, ours: Mapping[str, bytes], theirs: Mapping[str, bytes], h: PushHeader) -> float:
        num = den = 0.0
        for n, shape in self.shapes.items():
            a, b = decode(h.codec, ours[n], shape), decode(h.codec, theirs[n], shape)
            num += float(torch.linalg.vector_norm(a - b)) ** 2
            den += float(torch.linalg.vector_norm(b)) ** 2
        return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


class LocalReplays:
    """The aggregator's own replays, one `Replayer` per block, run in the caller's thread (the
    auditor's) when it asks for verdicts: the first `Verifier`. A replay that fails for a reason
    of its own (not the worker's) gives no verdict, only a log line and `error()`."""

    def __init__(self, replayers: Mapping[int, Replayer], clock: Callable[[], float], *,
                 error: Callable[[], None] = lambda: None):
        self.replayers, self.clock, self.error = dict(replayers), clock, error
        self.queue: list[AuditJob] = []
        self.lock = threading.Lock()

    def start_spec(self, block: int, claim: WorkClaim) -> dict[str, tuple[int, ...]]:
        return self.replayers[block].start_spec(claim)

    def check_start(self, block: int, claim: WorkClaim, state: Mapping[str, torch.Tensor]) -> None:
        self.replayers[block].check_start(claim, state)

    def submit(self, job: AuditJob) -> None:
        with self.lock:
            self.queue.append(job)

    def verdicts(self) -> list[Verdict]:
        with self.lock:
            jobs, self.queue = self.queue, []
        out = []
        for job in jobs:
            try:
                out.append(self.replayers[job.header.block](job, self.clock))
            except Exception:  # noqa: BLE001 - a fault of the replay, not of the worker: never a verdict
                log.exception("the replay of %s's update %s failed; the update is not judged", job.header.worker_id,
                              job.header.update_id[:8])
                self.error()
        return out

    def forget(self, worker_id: str) -> None:
        with self.lock:
            self.queue = [j for j in self.queue if j.header.worker_id != worker_id]

    def outcomes(self) -> tuple[list[tuple[str, str, str]], dict[str, int]]:
        return [], {}  # the aggregator verifies alone: nobody else to judge or credit


@dataclass
class ChainEnd:
    """Where a worker's last round left its state, as its claim said, and what it must start from next."""

    optimizer: str = EMPTY_STATE
    residual: str = EMPTY_STATE
    update_id: str = ""  # the update whose claim ended here ...
    claim: WorkClaim | None = None  # ... and that claim: the same update pushed again is no break in the chain


@dataclass
class AuditRecord:
    passed: int = 0  # since its last abandoned audit (probation counts these)
    failed: int = 0
    verified: float = 0.0  # others' rounds it replayed that upheld verdicts agreed with, × p (`Audits.credit`)
    abandoned: int = 0  # audits it left waiting for a state when it rejoined
    passed_total: int = 0

    def forgiven(self, limit: int) -> int:
        """Abandoned audits forgiven: `limit`, and one more per 20 passed, so that an honest worker
        that crashes now and then over a long life is not revoked for it, while dodging draws by
        rejoining costs a cheater 20 passed audits each."""
        return limit + self.passed_total // 20


@dataclass(frozen=True)
class AuditTotals:
    """The audit book's totals at one instant (`Audits.totals`), for metrics."""

    counts: dict[tuple[str, str], int]  # (result, reason) → audits
    seconds: float  # replay compute
    detections: int  # failed verdicts ...
    detection_seconds: float  # ... and their seconds from push to verdict, summed
    waiting: int  # jobs waiting for their start state


class Audits:
    """The swarm's audit book: chains, draws, jobs waiting for state or replay, verdicts. Thread-safe.
    The aggregator feeds it pushes and states; `due()` hands out jobs ready to replay (or whose state
    is late) and `record()` takes their verdicts. It punishes nobody itself: the aggregator does."""

    def __init__(self, cfg: AuditConfig, secret: bytes, clock: Callable[[], float]):
        self.cfg, self.secret, self.clock = cfg, secret, clock
        self.lock = threading.Lock()
        self.chains: dict[tuple[int, str], ChainEnd] = {}
        self.records: dict[str, AuditRecord] = {}
        self.waiting: dict[str, AuditJob] = {}  # update id → job awaiting its start state
        self.ready: list[AuditJob] = []
        self.counts: Counter = Counter()  # (result, reason) → audits
        self.seconds = 0.0  # replay wall time, all audits
        self.probation_seconds = 0.0  # ... of which on probation audits
        self.delays: list[float] = []  # seconds from push to a failed verdict (detection delay)
        self.suspects: dict[str, int] = {}  # worker id → its next updates drawn for sure (`suspect`)

    # -- chains --------------------------------------------------------------------------------
    def joined(self, block: int, worker_id: str) -> int | None:
        """A (re)join starts a new chain from a fresh optimizer and no residual. Audits its previous
        process left waiting for a start state are abandoned: a worker that crashed between its push
        and the state upload has lost that state, and revoking it for a crash would flag honest
        workers (the soak did, twice in 52 kills). Abandoning puts it back on probation, and only
        `abandon_limit` are forgiven (a cheater cannot dodge every draw by rejoining). Returns how
        many more than forgiven it has abandoned when this join abandoned any (≤ 0: forgiven), else None."""
        with self.lock:
            self.chains[(block, worker_id)] = ChainEnd()
            gone = [k for k, j in self.waiting.items() if (j.header.block, j.header.worker_id) == (block, worker_id)]
            if not gone:
                return None
            for k in gone:
                del self.waiting[k]
            rec = self.records.setdefault(worker_id, AuditRecord())
            rec.abandoned += len(gone)
            rec.passed = 0  # on probation again
            self.counts[("abandoned", "rejoin")] += len(gone)
            return rec.abandoned - rec.forgiven(self.cfg.abandon_limit)

    def check_chain(self, header: PushHeader) -> None:
        """MalformedInput("chain") unless this update starts where the worker's last round ended."""
        claim = header.claim
        if claim is None:
            raise MalformedInput("claim", f"{header.worker_id} sent no work claim; audits need one with every push")
        with self.lock:
            end = self.chains.get((header.block, header.worker_id))
        if end is None:
            return  # the aggregator restarted since it joined: the chain starts here
        if header.update_id == end.update_id and claim == end.claim:
            return  # the update that ended the chain, pushed again (a refusal is not remembered: a re-push is judged again)
        if claim.optimizer_start != end.optimizer:
            raise MalformedInput("chain", f"{header.worker_id}'s update starts from another optimizer state than its "
                                          f"last round ended with")
        if claim.residual_start not in (end.residual, EMPTY_STATE):
            raise MalformedInput("chain", f"{header.worker_id}'s update starts from another residual than its last "
                                          f"round ended with")

    def advance(self, header: PushHeader) -> None:
        """After the answer: the next round starts from this one's optimizer state, and from its
        residual or none. A worker keeps the residual when told its update was accepted and drops it
        otherwise (swarm.worker.BlockWorker.pushed), and the answer it acted on may not be this
        aggregator's (a re-push after a restart is judged again), so either is a valid start. Dropping
        a residual only loses the dropper's error feedback; keeping one is checked against this end."""
        claim = header.claim
        if claim is None:
            return
        with self.lock:
            self.chains[(header.block, header.worker_id)] = ChainEnd(claim.optimizer_end, claim.residual_end,
                                                                     header.update_id, claim)

    # -- draws and jobs -----------------------------------------------------------------------
    def on_probation(self, worker_id: str) -> bool:
        with self.lock:
            return self.records.get(worker_id, AuditRecord()).passed < self.cfg.probation

    def passed(self, worker_id: str) -> tuple[int, float]:
        """(audits passed since its probation last began, audits passed all told plus the replays it did
        as a verifier that verdicts upheld): its verified work (aggregate/trust/standing.py)."""
        with self.lock:
            rec = self.records.get(worker_id, AuditRecord())
            return rec.passed, rec.passed_total + rec.verified

    def credit(self, worker_id: str, n: int) -> None:
        """`n` replays of others' rounds by `worker_id` that upheld verdicts agreed with (trust/delegate.py):
        verified work, each worth p of a passed audit. Why p: a passed audit stands for 1/p rounds of
        training on average (only p of them are drawn), a replay for one round of compute; weighed so, the
        Sybil bound (docs/security.md, "Standing and the Sybil bound") is the same whichever way an
        identity earns its standing."""
        with self.lock:
            self.records.setdefault(worker_id, AuditRecord()).verified += n * self.cfg.share

    def force(self, worker_id: str) -> None:
        """Put `worker_id` on probation again (trust/standing.py, after repeated drops at close): every update
        of it is replayed, and held out of its round until its audit passes, for `probation` audits."""
        with self.lock:
            self.records.setdefault(worker_id, AuditRecord()).passed = 0

    def drawn(self, update_id: str, worker_id: str = "") -> bool:
        """Whether this update is audited: drawn at p, or for sure while its sender is a suspect (each
        such draw uses up one of its suspect updates)."""
        with self.lock:
            left = self.suspects.get(worker_id, 0)
            if left > 0:
                self.suspects[worker_id] = left - 1
                return True
        return secret_draw(self.secret, update_id) < self.cfg.share

    def suspect(self, worker_ids: Iterable[str]) -> list[str]:
        """A failed audit found a cheat in rounds these workers also pushed to (the cheat's other ids
        may be among them): audit each one's next `window` updates, every one. Returns the new suspects."""
        new = []
        with self.lock:
            for w in worker_ids:
                if self.suspects.get(w, 0) < self.cfg.window:
                    new.append(w)
                    self.suspects[w] = max(self.cfg.window, 1)
        return new

    def open(self, job: AuditJob) -> bool:
        """Queue a job; True when its sender must send the start state first."""
        with self.lock:
            if job.needs_state:
                self.waiting[job.header.update_id] = job
                return True
            job.start = {}
            self.ready.append(job)
            return False

    def waiting_for(self, update_id: str) -> AuditJob | None:
        with self.lock:
            return self.waiting.get(update_id)

    def received(self, update_id: str, state: Tensors) -> None:
        with self.lock:
            job = self.waiting.pop(update_id, None)
            if job is not None:
                job.start = state
                self.ready.append(job)

    def wanted(self, worker_id: str) -> tuple[str, ...]:
        """The update ids of `worker_id`'s later audits (AuditJob.later) still waiting for a start state."""
        with self.lock:
            return tuple(k for k, j in self.waiting.items() if j.later and j.header.worker_id == worker_id)

    def unanswered(self, job: AuditJob) -> int:
        """A later audit whose start state did not come: its sender may have left (or restarted, losing
        its kept states), so this is no verdict; it counts as abandoned (Audits.joined): on probation
        again, and revoked once past what is forgiven. Returns how many more than forgiven it has abandoned."""
        with self.lock:
            rec = self.records.setdefault(job.header.worker_id, AuditRecord())
            rec.abandoned += 1
            rec.passed = 0
            self.counts[("abandoned", "unanswered")] += 1
            return rec.abandoned - rec.forgiven(self.cfg.abandon_limit)

    def due(self) -> tuple[list[AuditJob], list[AuditJob]]:
        """(jobs ready to replay, jobs whose start state did not come in time), both taken off the book."""
        now = self.clock()
        with self.lock:
            ready, self.ready = self.ready, []
            late = [j for j in self.waiting.values() if now - j.arrived > self.cfg.state_timeout_s]
            for j in late:
                del self.waiting[j.header.update_id]
        return ready, late

    def record(self, v: Verdict) -> None:
        with self.lock:
            rec = self.records.setdefault(v.header.worker_id, AuditRecord())
            if v.passed:
                rec.passed += 1
                rec.passed_total += 1
            else:
                rec.failed += 1
                self.delays.append(v.delay_s)
            self.counts[("passed" if v.passed else "failed", v.reason)] += 1
            self.seconds += v.seconds
            self.probation_seconds += v.seconds if v.probation else 0.0

    def totals(self) -> AuditTotals:
        with self.lock:
            return AuditTotals(dict(self.counts), self.seconds, len(self.delays), sum(self.delays), len(self.waiting))

    def forget(self, worker_id: str) -> None:
        """Drop the jobs of a punished worker: there is nothing left to decide about it."""
        with self.lock:
            self.waiting = {k: j for k, j in self.waiting.items() if j.header.worker_id != worker_id}
            self.ready = [j for j in self.ready if j.header.worker_id != worker_id]

