"""Delegated verification (docs/security.md, "Delegated verification"): a `Verifier` whose replays run
on other workers of the block, while the aggregator only referees.

A drawn update (aggregate/trust/audit.py) becomes a `VerifyTask` for one verifier, or two for a
`redundancy` share, drawn by HMAC(secret, update id, i) among the block's other replicas with the
author's recipe (bit-for-bit replays need it), those behind the author's relay last (`near`): the author
cannot predict the draw (the secret is the aggregator's) and never draws itself. The verifier
fetches θ^base and the author's committed start state (`inputs`), replays the claimed steps
(train/replay.py) and attests the `result_digest` of what it got. The aggregator compares it with the
digest of the push (its bytes, its claim's end hashes): all equal, the update passes.

A disagreement is a dispute, refereed by bisection: the author and every verifier whose digest differs
send the trace of their replay (the state digest after each step; `TraceWanted`); at the first step
where two traces differ, one party uploads the whole state before it (`StateWanted`, checked against
the trace both agree on), and the aggregator trains that one step itself (`RoundReplay.step_once`):
whoever's trace matches is right, the other is revoked. Traces that agree everywhere mean the encode
differs: the aggregator encodes the final state once. A party that does not answer within `timeout_s`
loses. So a dispute costs the aggregator one training step (or one encode), not H.

Layers against lying verifiers: the referee (an accusation of an honest author loses the dispute), the
redundant share (a vouching verifier disagrees with an honest second one), and the aggregator's own
replay of a `spot` share of delegated updates (it decides, and a verifier that vouched against it is
revoked). With fewer than `min_workers` replicas in a block, the aggregator replays itself (`local`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from btnode.aggregate.trust.audit import AuditJob, LocalReplays, Verdict
from btnode.codec.codecs import keep_in
from btnode.errors import ConfigError, MalformedInput
from btnode.protocol import Attestation, Duties, StateWanted, TraceWanted, VerifyTask
from btnode.settings import flag
from btnode.store.files import state_sha256
from btnode.train.recipe import Recipe
from btnode.train.replay import RoundReplay, result_digest, torch_threads
from btnode.train.terms import TrainingTerms

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]
RECHECKED = 4  # a revoked author's last updates that verifiers passed, replayed by the aggregator
WAIT_S = 5.0  # how long a job waits for verifiers whose recipes are known (at a swarm's start) before it is replayed here


@dataclass(frozen=True)
class DelegationConfig:
    min_workers: int = flag("--verify-min-workers", "Replicas a block needs before its audits are replayed by "
                                                    "its workers (delegated verification) rather than by the "
                                                    "aggregator. 0: the aggregator always replays.", default=3)
    redundancy: float = flag("--verify-redundancy", "Share of delegated audits given to two verifiers (a vouching "
                                                    "verifier disagrees with an honest second one).", default=0.2)
    spot: float = flag("--verify-spot", "Share of delegated audits the aggregator also replays itself, and "
                                        "decides (catches a verifier that vouches for its own cheater).", default=0.02)
    timeout_s: float = flag("--verify-timeout", "Seconds a verifier has to attest, and a party to a dispute to send "
                                                "its trace or state; then another verifier is drawn, or the "
                                                "silent party loses the dispute.", default=120.0)

    def __post_init__(self) -> None:
        if self.min_workers < 0 or not 0 <= self.redundancy <= 1 or not 0 <= self.spot <= 1 or self.timeout_s <= 0:
            raise ConfigError(f"invalid delegation settings: {self}")

    @property
    def on(self) -> bool:
        return self.min_workers > 0


@dataclass
class _Dispute:
    claims: dict[str, str]  # party → the digest it stands for (the author: its push's)
    traces: dict[str, tuple[str, ...]] = field(default_factory=dict)
    asked_at: float = 0.0
    step: int = -1  # the first step where two traces differ (≥ 0), once known
    state_from: str = ""  # the party asked for the state before `step`


@dataclass
class _Task:
    task: VerifyTask
    job: AuditJob
    verifiers: list[str]
    given_at: float
    attests: dict[str, Attestation] = field(default_factory=dict)
    dispute: _Dispute | None = None
    spot: bool = False  # the aggregator replays it too, and its verdict decides
    local: Verdict | None = None  # ... once in: the verifiers' attestations are judged against it
    handed: float = field(default_factory=time.monotonic)  # wall clock, bounding the time a verifier may claim

    @property
    def author(self) -> str:
        return self.job.header.worker_id


def draw(secret: bytes, update_id: str, names: list[str], n: int) -> list[str]:
    """`n` of `names` (sorted), drawn without replacement by HMAC(secret, update id, i): a draw only the
    holder of `secret` can compute before the update exists, in O(n) whatever the swarm's size."""
    pool, out = sorted(names), []
    for i in range(min(n, len(pool))):
        digest = hmac.new(secret, f"verifier\0{update_id}\0{i}".encode(), hashlib.sha256).digest()
        out.append(pool.pop(int.from_bytes(digest[:8], "big") % len(pool)))
    return out


def share_draw(secret: bytes, what: str, update_id: str) -> float:
    digest = hmac.new(secret, f"{what}\0{update_id}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class DelegatedReplays:
    """The `Verifier` of a swarm whose workers verify each other (see the module doc). `candidates(block,
    author)`: the block's replicas that may verify the author's update (live, not revoked, with its
    recipe); `replicas(block)`: how many the block has, known recipe
    or not; `wake(block)`: new duties for the block's workers (their version streams say so at once);
    `local`: the aggregator's own replays (small blocks, spot checks). Thread-safe."""

    def __init__(self, cfg: DelegationConfig, local: LocalReplays, replays: Mapping[int, RoundReplay], secret: bytes,
                 clock: Callable[[], float], candidates: Callable[[int, str], list[str]],
                 replicas: Callable[[int], int] = lambda block: 0, wake: Callable[[int], None] = lambda block: None,
                 near: Callable[[str], str | None] = lambda worker: None):
        self.cfg, self.local, self.replays, self.secret, self.clock = cfg, local, dict(replays), secret, clock
        self.candidates, self.replicas, self.wake, self.near = candidates, replicas, wake, near
        self.lock = threading.Lock()
        self.tasks: dict[str, _Task] = {}
        self.duties: dict[str, Duties] = {}
        self.handed_out: dict[str, int] = {}  # worker → duties ever handed to it (`handed`)
        self.spots: dict[str, str] = {}  # update id → task id, of jobs the aggregator replays too
        self._verdicts: list[Verdict] = []
        self._offenders: list[tuple[str, str, str]] = []  # (verifier, reason, detail) to revoke
        self._credits: dict[str, int] = {}  # verifier → replays of its that upheld verdicts agreed with
        self.upheld: dict[str, int] = {}  # ... ever (status: IdentityRecord.verified)
        self.work: dict[str, float] = {}  # verifier → seconds of replays it attested (its verified work)
        self.counts: dict[str, int] = {}  # event → count (tasks, redundant, spot, disputes, local, reassigned)
        self.referee_seconds = 0.0  # the aggregator's own compute on disputes
        # author → its last updates that verifiers passed (job, verifier → digest): if the author is revoked
        # later, they are replayed here, and a verifier that vouched for one that fails lied (`forget`)
        self.passed: dict[str, deque[tuple[AuditJob, dict[str, str]]]] = {}
        self.rechecks: dict[str, dict[str, str]] = {}  # update id → its verifiers' digests, replayed here
        self.waiting: list[AuditJob] = []  # jobs with too few known verifiers yet (a swarm's first pushes)
        self._scanned = float("-inf")  # when `_expire` last looked over the open tasks

    # -- the Verifier protocol --------------------------------------------------------------------------
    def start_spec(self, block: int, claim) -> dict[str, tuple[int, ...]]:  # type: ignore[no-untyped-def]
        return self.local.start_spec(block, claim)

    def check_start(self, block: int, claim, state: Mapping[str, torch.Tensor]) -> None:  # type: ignore[no-untyped-def]
        self.local.check_start(block, claim, state)

    def submit(self, job: AuditJob) -> None:
        if not self._delegate(job, waited=False):
            with self.lock:
                self.waiting.append(job)

    def _delegate(self, job: AuditJob, *, waited: bool) -> bool:
        """Hand `job` to verifiers, or to the aggregator's own replay; False: not yet (a fresh swarm whose
        other replicas' recipes are not known yet: tried again for up to WAIT_S, `verdicts`)."""
        h = job.header
        pool = [n for n in self.candidates(h.block, h.worker_id) if n != h.worker_id]
        exact = self._exact(job)
        if not self.cfg.on or len(pool) + 1 < self.cfg.min_workers or not exact:
            if self.cfg.on and exact and not waited and self.replicas(h.block) >= self.cfg.min_workers:
                return False  # enough replicas, whose recipes are not all known yet
            self._count("local")
            self.local.submit(job)
            return True
        n = 2 if share_draw(self.secret, "redundant", h.update_id) < self.cfg.redundancy and len(pool) >= 2 else 1
        chosen = self._draw(h.update_id, h.worker_id, pool, n)
        task = VerifyTask(task_id=h.update_id, header=h, terms_json=TrainingTerms(job.train, len(h.steps)).to_json(),
                          keep=keep_in(h.codec, job.raw))
        spot = share_draw(self.secret, "spot", h.update_id) < self.cfg.spot
        with self.lock:
            self.tasks[task.task_id] = _Task(task, job, chosen, self.clock(), spot=spot)
            for v in chosen:
                self._hand(v).tasks.append(task)
            if spot:
                self.spots[h.update_id] = task.task_id
        self.wake(h.block)
        self._count("tasks")
        self._count("redundant") if n == 2 else None
        if spot:
            self._count("spot")
            self.local.submit(job)
        return True

    def _draw(self, update_id: str, author: str, pool: list[str], n: int) -> list[str]:
        """`n` verifiers of `pool`: none behind the author's relay while others are left (a relay could
        otherwise hand its own children's updates to its own children), then from those behind it."""
        relay = self.near(author)
        far = [v for v in pool if relay is None or self.near(v) != relay]
        chosen = draw(self.secret, update_id, far, n)
        if len(chosen) < n:
            chosen += draw(self.secret, f"{update_id}\0near", [v for v in pool if v not in far], n - len(chosen))
        return chosen

    def verdicts(self) -> list[Verdict]:
        with self.lock:
            waiting, self.waiting = self.waiting, []
        now = self.clock()
        for job in waiting:
            if not self._delegate(job, waited=now - job.arrived > WAIT_S):
                with self.lock:
                    self.waiting.append(job)
        local = self.local.verdicts()  # small blocks, and spot checks (which decide their task)
        out: list[Verdict] = []
        with self.lock:
            for v in local:
                if v.header.update_id in self.rechecks:  # a revoked author's passed update, replayed here
                    self._rechecked(v, self.rechecks.pop(v.header.update_id))
                    continue
                tid = self.spots.pop(v.header.update_id, None)
                task = self.tasks.get(tid) if tid is not None else None
                if task is not None:
                    task.local = v
                    if len(task.attests) == len(task.verifiers):
                        self._spot_checked(task)
                out.append(v)
            self._expire()
            out += self._verdicts
            self._verdicts = []
        return out

    def outcomes(self) -> tuple[list[tuple[str, str, str]], dict[str, int]]:
        """Since the last call: verifiers found lying, (name, reason, detail), which the caller revokes;
        and verifiers whose replays upheld verdicts agreed with → how many (their verified work)."""
        with self.lock:
            out, self._offenders = self._offenders, []
            credits, self._credits = self._credits, {}
        return out, credits

    def forget(self, worker_id: str) -> None:
        """`worker_id` was revoked: its open tasks go, and the updates of its that verifiers passed are
        replayed here (a cheat is rarely caught on its first lie: whoever vouched for one lied too)."""
        self.local.forget(worker_id)
        self.released(worker_id)
        with self.lock:
            self.waiting = [j for j in self.waiting if j.header.worker_id != worker_id]
            for tid in [t for t, task in self.tasks.items() if task.author == worker_id]:
                del self.tasks[tid]
            self.duties.pop(worker_id, None)
            kept = self.passed.pop(worker_id, ())
            for job, digests in kept:
                self.rechecks[job.header.update_id] = digests
        for job, _ in kept:
            self._count("rechecks")
            self.local.submit(job)  # (after local.forget above: the queue keeps it)

    def released(self, worker_id: str) -> None:
        """`worker_id` will not verify any more (revoked, or it left its block): the tasks it has not
        attested go to the aggregator's own replay at once, rather than waiting out `timeout_s` while the
        rounds of their updates close without them."""
        with self.lock:
            self.duties.pop(worker_id, None)
            stuck = [t for t in self.tasks.values() if worker_id in t.verifiers and worker_id not in t.attests
                     and t.dispute is None and not t.spot]
            for t in stuck:
                self._to_local(t, "reassigned")

    # -- what workers ask and answer ----------------------------------------------------------------------
    def handed(self, worker_id: str) -> int:
        """How many duties `worker_id` was ever handed: its version stream says so when this grows, so that
        the worker asks at once rather than poll. A read of one dict entry, no lock (streams check it often)."""
        return self.handed_out.get(worker_id, 0)

    def _hand(self, worker_id: str) -> Duties:
        self.handed_out[worker_id] = self.handed_out.get(worker_id, 0) + 1
        return self.duties.setdefault(worker_id, Duties())

    def duties_of(self, worker_id: str) -> Duties:
        """The verification work handed to `worker_id` since it last asked (each item once), less what
        closed meanwhile (decided, or its author revoked)."""
        with self.lock:
            d = self.duties.pop(worker_id, Duties())
            return Duties([t for t in d.tasks if t.task_id in self.tasks],
                          [w for w in d.traces if w.task.task_id in self.tasks],
                          [w for w in d.states if w.task.task_id in self.tasks])

    def inputs(self, task_id: str, worker_id: str) -> tuple[Mapping[str, torch.Tensor], Tensors]:
        """(θ^base, the author's start state) of a task `worker_id` is a verifier or party of; a
        MalformedInput otherwise (nobody else may read a worker's state)."""
        with self.lock:
            t = self.tasks.get(task_id)
            if t is None or (worker_id not in t.verifiers and worker_id != t.author):
                raise MalformedInput("no_task", f"{worker_id!r} has no verification task {task_id[:16]!r}")
            return t.job.base, dict(t.job.start or {})

    def attest(self, a: Attestation) -> None:
        """A verifier's result. Refused (MalformedInput) unless the task is its own and still open."""
        with self.lock:
            t = self.tasks.get(a.task_id)
            if t is None or a.verifier not in t.verifiers or a.verifier in t.attests or t.dispute is not None:
                raise MalformedInput("no_task", f"{a.verifier!r} has no open verification task {a.task_id[:16]!r}")
            t.attests[a.verifier] = a
            # its own word for its replay's time, at most the time since the task was handed out (not inflatable)
            spent = min(max(0.0, a.seconds), time.monotonic() - t.handed)
            self.work[a.verifier] = self.work.get(a.verifier, 0.0) + spent
            if len(t.attests) < len(t.verifiers):
                return
            if not t.spot:
                self._decide(t)
            elif t.local is not None:
                self._spot_checked(t)

    def submit_trace(self, task_id: str, worker_id: str, trace: tuple[str, ...]) -> None:
        with self.lock:
            t = self.tasks.get(task_id)
            d = t.dispute if t is not None else None
            if d is None or worker_id not in d.claims or worker_id in d.traces:
                raise MalformedInput("no_task", f"no dispute asks {worker_id!r} for the trace of {task_id[:16]!r}")
            if len(trace) != len(t.task.header.steps):
                raise MalformedInput("trace", f"a trace has one digest per claimed step ({len(t.task.header.steps)}), "
                                              f"not {len(trace)}")
            d.traces[worker_id] = tuple(trace)
            if len(d.traces) == len(d.claims):
                self._bisect(t)

    def submit_state(self, task_id: str, worker_id: str, k: int, state: Mapping[str, torch.Tensor]) -> None:
        """The whole state after `k` steps, from the party asked for it: the referee's one step."""
        with self.lock:
            t = self.tasks.get(task_id)
            d = t.dispute if t is not None else None
            if d is None or d.state_from != worker_id or k != d.step:
                raise MalformedInput("no_task", f"no dispute asks {worker_id!r} for a state of {task_id[:16]!r}")
            if state_sha256(state) != d.traces[worker_id][k - 1]:
                raise MalformedInput("state", "the state sent is not the one its trace names")
            if k == len(t.task.header.steps):
                self._referee_encode(t, state)
            else:
                self._referee_step(t, state)

    # -- deciding ----------------------------------------------------------------------------------------
    def _exact(self, job: AuditJob) -> bool:
        """A delegated replay is compared by digest, so it must be bit for bit, and so must the referee's
        one step: a CPU recipe with the aggregator's torch and precision (verifiers are drawn with the
        author's recipe, and every replay runs under the author's thread count). Else the aggregator
        replays it itself, within its tolerance (aggregate/trust/audit.py)."""
        try:
            theirs = Recipe.from_json(job.claim.recipe)
        except MalformedInput:
            return False
        return compatible(theirs, Recipe.here(torch.device("cpu"), theirs.precision, error_feedback=theirs.error_feedback))

    def _expected(self, t: _Task) -> str:
        c = t.job.claim
        return result_digest(t.job.raw, c.optimizer_end, c.residual_end)

    def _decide(self, t: _Task) -> None:
        expected = self._expected(t)
        if all(a.digest == expected for a in t.attests.values()):
            self._pass(t, f"verified by {', '.join(sorted(t.attests))}")
            return
        self._count("disputes")
        claims = {t.author: expected, **{v: a.digest for v, a in t.attests.items()}}
        t.dispute = _Dispute(claims=claims, asked_at=self.clock())
        for party in claims:
            self._hand(party).traces.append(TraceWanted(t.task))
        self.wake(t.task.header.block)
        log.warning("audit of %s's update %s: disputed (%s); asking for traces", t.author, t.task.task_id[:8],
                    ", ".join(f"{v} {'agrees' if a.digest == expected else 'differs'}" for v, a in t.attests.items()))

    def _bisect(self, t: _Task) -> None:
        """Every party's trace is in: find the first step where the author's and a dissenter's differ."""
        d = t.dispute
        assert d is not None
        mine = d.traces[t.author]
        other = next(p for p in d.traces if p != t.author and d.traces[p] != mine) if any(
            d.traces[p] != mine for p in d.traces) else None
        if other is None:  # every trace agrees: they differ in the encode (or one attested another digest)
            other, d.step = next(p for p, c in d.claims.items() if c != d.claims[t.author]), len(mine)
        else:
            d.step = next(k for k, (a, b) in enumerate(zip(mine, d.traces[other])) if a != b)
        if d.step == 0:  # the state before step 0 is θ^base and the committed start state: the referee has it
            self._referee_step(t, None)
            return
        d.state_from, d.asked_at = other, self.clock()  # a party that does not send it loses (`_expire`)
        self._hand(other).states.append(StateWanted(t.task, d.step))
        self.wake(t.task.header.block)

    def _referee_step(self, t: _Task, state: Mapping[str, torch.Tensor] | None) -> None:
        """Train the one disputed step and see whose trace it matches (lock held)."""
        d = t.dispute
        assert d is not None
        replay, h = self.replays[t.task.header.block], t.task.header
        t0 = time.perf_counter()
        with torch_threads(_threads(t)):
            if state is None:
                state = replay.initial_state(t.job.base, t.job.start or {})
            got = replay.step_once(h, t.job.train, state, d.step)
        self.referee_seconds += time.perf_counter() - t0
        self._settle(t, {p for p, tr in d.traces.items() if tr[d.step] == got}, f"step {h.steps[d.step]}")

    def _referee_encode(self, t: _Task, final: Mapping[str, torch.Tensor]) -> None:
        """Every trace agrees on every state: encode the final one here and see whose digest it is."""
        t0 = time.perf_counter()
        digest = self.replays[t.task.header.block].encode_final(
            t.task.header, t.job.base, t.job.start or {}, final, keep=t.task.keep,
            error_feedback=Recipe.from_json(t.job.claim.recipe).error_feedback)
        self.referee_seconds += time.perf_counter() - t0
        d = t.dispute
        assert d is not None
        self._settle(t, {p for p, c in d.claims.items() if c == digest}, "the encode")

    def _settle(self, t: _Task, right: set[str], where: str) -> None:
        d = t.dispute
        assert d is not None
        if not right:  # the referee agrees with nobody: it cannot tell, so it replays the round itself
            self._to_local(t)
            return
        self.tasks.pop(t.task.task_id, None)
        self._credit(p for p in right if p != t.author)
        for p in d.claims:
            if p != t.author and p not in right:
                self._offenders.append((p, "verifier", f"its verdict on {t.author}'s update {t.task.task_id[:8]} "
                                                       f"lost the dispute at {where}"))
        if t.author in right:
            self._verdicts.append(self._verdict(t, True, "", f"disputed, upheld at {where}"))
        else:
            self._verdicts.append(self._verdict(t, False, "delta", f"lost the dispute at {where}"))

    def _pass(self, t: _Task, detail: str) -> None:
        self.tasks.pop(t.task.task_id, None)
        self._credit(t.attests)
        kept = self.passed.setdefault(t.author, deque(maxlen=RECHECKED))
        kept.append((t.job, {n: a.digest for n, a in t.attests.items()}))
        self._verdicts.append(self._verdict(t, True, "", detail))

    def _credit(self, names) -> None:  # type: ignore[no-untyped-def]
        for n in names:
            self._credits[n] = self._credits.get(n, 0) + 1
            self.upheld[n] = self.upheld.get(n, 0) + 1

    def _to_local(self, t: _Task, why: str = "local_after_dispute") -> None:
        """The aggregator replays the task's round itself, and its verdict decides (as a spot check's)."""
        t.spot = True
        self.spots[t.task.task_id] = t.task.task_id
        self._count(why)
        self.local.submit(t.job)

    def _rechecked(self, v: Verdict, digests: dict[str, str]) -> None:
        """A revoked author's update that verifiers passed, replayed here: if it fails, they vouched for a cheat."""
        if v.passed:
            return
        for name in digests:
            self._offenders.append((name, "verifier", f"it passed {v.header.worker_id}'s update "
                                                      f"{v.header.update_id[:8]}, which the aggregator's replay fails"))

    def _spot_checked(self, t: _Task) -> None:
        """The aggregator's own replay decided a spot-checked task: a verifier that said otherwise lied."""
        v = t.local
        assert v is not None
        self.tasks.pop(t.task.task_id, None)
        expected = self._expected(t)
        self._credit(n for n, a in t.attests.items() if (a.digest == expected) == v.passed)
        for name, a in t.attests.items():
            if (a.digest == expected) != v.passed:
                self._offenders.append((name, "verifier", f"its verdict on {t.author}'s update {t.task.task_id[:8]} "
                                                          f"contradicts the aggregator's own replay"))

    def _expire(self) -> None:
        """Tasks whose verifier did not attest in time go to the aggregator; a silent dispute too. Looked
        over once a second at most (a scan of every open task)."""
        now = self.clock()
        if now - self._scanned < 1.0:
            return
        self._scanned = now
        for t in list(self.tasks.values()):
            if t.spot:  # decided by the aggregator's replay; verifiers still silent after it go unjudged
                if t.local is not None and now - t.given_at > self.cfg.timeout_s:
                    del self.tasks[t.task.task_id]
                continue
            d = t.dispute
            if d is None and now - t.given_at > self.cfg.timeout_s:
                del self.tasks[t.task.task_id]
                self._count("reassigned")
                self.local.submit(t.job)
            elif d is not None and now - d.asked_at > self.cfg.timeout_s:
                # a silent party may be a cheat or may have left (an honest author that finished): the
                # aggregator replays the round itself, and its verdict decides (no one is revoked for silence)
                self._to_local(t)

    def _verdict(self, t: _Task, passed: bool, reason: str, detail: str) -> Verdict:
        return Verdict(t.job.header, passed, reason, detail, 0.0, t.job.probation, self.clock() - t.job.arrived)

    def _count(self, event: str) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1


def compatible(a: Recipe, b: Recipe) -> bool:
    """Whether replays under recipes `a` and `b` give the same bytes, each under the author's thread count."""
    return (a.torch, a.device, a.precision) == (b.torch, b.device, b.precision) and a.device == "cpu"


def _threads(t: _Task) -> int:
    r = Recipe.from_json(t.job.claim.recipe)
    return r.threads if r.device == "cpu" else torch.get_num_threads()
