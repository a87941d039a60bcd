"""The virtual async simulator (design §6.5, issue #5).

One process runs the daemon's own parts: a SwarmAggregator (rounds, validation, averaging,
version store) and one BlockWorker per replica (training, codec with error feedback, catch-up,
folding). Only two things are replaced: the network (a LocalLink, plus a sampled one-way delay
per message) and the clock (a virtual clock that the aggregator reads and an event queue
advances). Training is real; the time it takes is virtual: `step_time_s` per local step.

Each replica makes `rounds` attempts. Before each it draws, from its own seeded stream, whether
it takes part. If it does, it trains its steps and its update arrives after the compute time
plus a sampled upload delay; once a newer version is published it hears of it after a sampled
download delay, catches up and tries again. If it does not, it is away for one deadline τ (the
machine is busy or offline: no compute, no update), then catches up with the newest version
and tries again. Participation streams are nested across probabilities: the attempts a replica
misses at p = 0.9 are a subset of those it misses at p = 0.42, so runs compare like for like.

With ModelConfig.kind "ar" (DiLoCo) the same code runs a swarm of one unit, the whole AR model,
with `replicas` full-replica workers: nothing here depends on what a unit is.

With `relays` R > 0, each block's replicas are split evenly over R relays (sim/relays.py: the
daemon's relay aggregator, in process), which push their combined updates to the root: a worker's
update reaches its relay after its delay, a relay's combined update the root after the relay's
own, a relay hears of a root version after its delay and its waiting children after theirs.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter
import itertools
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from btnode.aggregate.trust.audit import Verdict
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.delegate import WAIT_S
from btnode.aggregate.service import SwarmAggregator
from btnode.codec.codecs import SPARSE_DENSITY, Codec
from btnode.codec.warmup import NONE, DensityWarmup
from btnode.data.source import ByteSource
from btnode.errors import ConfigError, Forbidden
from btnode.model.config import ModelConfig
from btnode.protocol import Outcome, VersionInfo
from btnode.sim.link import ChildLink, LocalCA, LocalLink, identity
from btnode.sim.relays import SimRelay
from btnode.store.models import init_unit
from btnode.swarm.worker import BlockWorker, WorkerConfig
from btnode.train.config import TrainConfig

DISTRIBUTIONS = ("fixed", "exp", "lognormal")
AUDITOR_S = 0.2  # with relays: how soon after it may go on the aggregator's auditor takes up a job that waited (node/aggregator.py)
# Builds a replica's worker from BlockWorker's constructor arguments (BlockWorker itself, or a
# subclass: the cheats of lab/cheats.py)
WorkerFactory = Callable[..., BlockWorker]


@dataclass(frozen=True)
class SimConfig:
    participation: float = 1.0  # probability that a replica takes part in a given attempt
    rounds: int = 20  # attempts per replica
    replicas: int = 2  # per block
    steps_per_round: int = 20  # H
    step_time_s: float = 0.1  # virtual seconds per local step
    delays_s: tuple[float, ...] = (0.02,)  # mean one-way delay per replica (cycled over replicas)
    delay_dist: str = "exp"  # fixed | exp (exponential) | lognormal (σ = 0.5), with that mean
    codec: Codec = Codec.INT8
    density: float = SPARSE_DENSITY  # a sparse codec's share of values sent
    warmup: DensityWarmup = NONE  # ... over the first versions (codec/warmup.py; the aggregator's: AggregatorConfig's)
    train_while_waiting: bool = False
    schedule_by_version: bool = True  # see WorkerConfig
    seed: int = 0  # participation and delay streams
    audit: float | None = None  # share p of updates replayed (0: no audits; None: the AggregatorConfig's); the draw's key follows `seed`
    probation: int | None = None  # with audits: audits a new worker must pass first (None: the AggregatorConfig's)
    identities: bool = True  # each replica joins and pushes as its own proven identity (as under mutual TLS)
    relays: int = 0  # relays each block's replicas are split over, evenly (0: every replica pushes to the root)

    def __post_init__(self) -> None:
        if not 0 <= self.participation <= 1:
            raise ConfigError(f"participation must be in [0, 1], got {self.participation}")
        if self.rounds < 1 or self.replicas < 1 or self.steps_per_round < 1 or self.step_time_s <= 0:
            raise ConfigError("rounds, replicas and steps per round must be ≥ 1 and the step time > 0")
        if not self.delays_s or any(d < 0 or not math.isfinite(d) for d in self.delays_s):
            raise ConfigError(f"delays must be finite and ≥ 0, got {self.delays_s}")
        if self.delay_dist not in DISTRIBUTIONS:
            raise ConfigError(f"delay distribution must be one of {DISTRIBUTIONS}, got {self.delay_dist!r}")
        if not 0 <= self.relays <= self.replicas:
            raise ConfigError(f"relays must be in [0, replicas], got {self.relays} for {self.replicas} replicas")


@dataclass
class Replica:
    worker: BlockWorker
    mean_delay_s: float
    turnout: random.Random  # participation draws
    jitter: random.Random  # delay draws
    attempts: int = 0
    absent: int = 0
    missed: list[int] = field(default_factory=list)  # the attempts it sat out
    finished: bool = False
    finished_at: float = 0.0
    waiting_for: int | None = None  # base version of the update it waits on
    waiting_since: float = 0.0
    taken: tuple | None = None  # (header, judgement) of its last update taken into a round: settled when it hears
    busy_s: float = 0.0  # virtual seconds spent training
    relay: SimRelay | None = None  # the relay it pushes to (None: the root)


@dataclass
class Hop:
    """A relay's link to the root, as the event queue sees it: a mean one-way delay and its draws."""

    relay: SimRelay
    mean_delay_s: float
    jitter: random.Random
    sending: bool = False  # a push of its pending combined updates is on its way


@dataclass
class SimResult:
    virtual_seconds: float
    versions: dict[int, int]
    outcomes: dict[str, int]
    attempts: int
    absent: int
    utilisation: float  # virtual training time ÷ virtual time until it finished, averaged over replicas
    closed_by: dict[str, int] = field(default_factory=dict)


class Simulation:
    def __init__(self, cfg: ModelConfig, tc: TrainConfig, acfg: AggregatorConfig, scfg: SimConfig,
                 corpus: ByteSource | bytes, state_dir: Path, *, device: torch.device,
                 workers: Mapping[str, WorkerFactory] | None = None,
                 on_publish: Callable[[int, VersionInfo], None] | None = None):
        """`workers`: worker id ("b{block}r{replica}") → the factory of that replica's worker, for
        the replicas that do not run a plain BlockWorker. `on_publish(block, info)`: called once the
        aggregator published a version, before any worker hears of it (to score every version)."""
        self.cfg, self.scfg = cfg, scfg
        self.on_publish = on_publish
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        # every replica here trains with tc and H: the aggregator judges their claims by the same
        audit = {k: v for k, v in (("share", scfg.audit), ("probation", scfg.probation)) if v is not None}
        acfg = replace(acfg, claims=ClaimConfig.of(tc, scfg.steps_per_round, enforce=acfg.claims.enforce),
                       # a state comes with the push's answer here, at once: one not in by the next step is late
                       audit=replace(acfg.audit, **audit,
                                     state_timeout_s=min(acfg.audit.state_timeout_s, scfg.step_time_s)))
        self.acfg = acfg  # as the aggregator holds it
        self.agg = SwarmAggregator(cfg, acfg, state_dir, seed=tc.seed, clock=lambda: self.now, corpus=corpus,
                                   audit_secret=hashlib.sha256(f"audit/{scfg.seed}".encode()).digest())
        self.link = LocalLink(self.agg)
        self.ca = LocalCA(hashlib.sha256(f"ca/{scfg.seed}".encode()).digest()) if scfg.identities else None
        self.relays: list[Hop] = []
        self._auditor_at: float | None = None  # with relays: when the auditor looks at waiting jobs again
        for i in range(scfg.relays):
            name = f"relay{i}"
            relay = SimRelay(name, self.agg, cfg, acfg, state_dir / "relays" / name, seed=tc.seed, clock=lambda: self.now,
                             ca=self.ca, amend_safety_s=2 * scfg.delays_s[i % len(scfg.delays_s)])
            self.relays.append(Hop(relay, scfg.delays_s[i % len(scfg.delays_s)], random.Random(f"delay/{scfg.seed}/{name}")))
        self.replicas: list[Replica] = []
        for b, r in itertools.product(range(cfg.total_blocks), range(scfg.replicas)):
            wid = f"b{b}r{r}"
            wcfg = WorkerConfig(worker_id=wid, block=b, steps_per_round=scfg.steps_per_round, codec=scfg.codec,
                                density=scfg.density, warmup=scfg.warmup,
                                train_while_waiting=scfg.train_while_waiting,
                                schedule_by_version=scfg.schedule_by_version)
            mean = scfg.delays_s[len(self.replicas) % len(scfg.delays_s)]
            make = (workers or {}).get(wid, BlockWorker)
            relay = self.relays[r % scfg.relays].relay if scfg.relays else None
            if relay is not None:
                link: LocalLink = ChildLink(relay.agg, identity(wid) if scfg.identities else None, self.ca)
                relay.children.append(link)
            else:
                link = LocalLink(self.agg, identity(wid)) if scfg.identities else self.link
            worker = make(cfg, tc, wcfg, link, corpus, device=device)
            ids = random.Random(f"update-ids/{scfg.seed}/{wid}")  # the audit draw reads them: one seed, one run
            worker.new_update_id = lambda ids=ids: f"{ids.getrandbits(128):032x}"
            self.replicas.append(Replica(worker, mean, random.Random(f"turnout/{scfg.seed}/{wid}"),
                                         random.Random(f"delay/{scfg.seed}/{wid}"), relay=relay))
        self._published = {b: agg.info.version for b, agg in self.agg.blocks.items()}
        self.verdicts: list[Verdict] = []  # every audit's, in order

    def worker(self, worker_id: str) -> BlockWorker:
        return next(r.worker for r in self.replicas if r.worker.wcfg.worker_id == worker_id)

    # -- the event queue and the network ----------------------------------------------------------
    def _at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), fn, args))

    def _parent(self, rep: Replica) -> SwarmAggregator:
        """Where the replica pushes and hears versions from: its relay, or the root."""
        return rep.relay.agg if rep.relay is not None else self.agg

    def _delay(self, rep: Replica | Hop) -> float:
        m, rng = rep.mean_delay_s, rep.jitter
        if m == 0 or self.scfg.delay_dist == "fixed":
            return m
        if self.scfg.delay_dist == "exp":
            return rng.expovariate(1 / m)
        return m * math.exp(0.5 * rng.gauss(0, 1) - 0.125)  # lognormal with mean m

    def _after_aggregator(self) -> None:
        """Announce newly published versions (each waiting replica hears after its own delay, each relay
        after its own) and schedule the new round's deadline tick; send relays' closed rounds up."""
        for hop in self.relays:
            if hop.relay.collect() and not hop.sending:
                hop.sending = True
                self._at(self.now + self._delay(hop), self._relay_push, hop)
        if self.relays:
            self._wake_auditor()
        for b, agg in self.agg.blocks.items():
            if agg.info.version == self._published[b]:
                continue
            self._published[b] = agg.info.version
            if self.on_publish is not None:
                self.on_publish(b, agg.info)
            self._at(agg.round.deadline(), self._tick, b)
            for rep in self.replicas:
                if rep.worker.wcfg.block == b and rep.waiting_for is not None and rep.relay is None:
                    self._at(self.now + self._delay(rep), self._hear, rep, rep.waiting_for)
            for hop in self.relays:
                self._at(self.now + self._delay(hop), self._relay_hears, hop, agg.info)

    # -- events ------------------------------------------------------------------------------
    def _tick(self, b: int) -> None:
        self._audit()  # as the aggregator's auditor runs on its own clock: audits waiting on time move on
        agg = self.agg.block(b)
        version = agg.info.version
        agg.tick()
        active = any(r.worker.wcfg.block == b and not r.finished for r in self.replicas)
        if agg.info.version == version and agg.round.deadline() > self.now and active:  # clock restarted
            self._at(agg.round.deadline(), self._tick, b)
        self._after_aggregator()

    # -- relays (sim/relays.py) ------------------------------------------------------------------
    def _relay_tick(self, hop: Hop, b: int) -> None:
        block = hop.relay.blocks[b]
        hop.relay.tick(b)
        active = any(r.relay is hop.relay and r.worker.wcfg.block == b and not r.finished for r in self.replicas)
        if block.round.deadline() > self.now and active:  # its round's clock restarted
            self._at(block.round.deadline(), self._relay_tick, hop, b)
        self._after_aggregator()

    def _relay_push(self, hop: Hop) -> None:
        """The relay's pending combined updates reach the root."""
        hop.sending = False
        hop.relay.forward()
        self._audit()
        self._after_aggregator()

    def _relay_hears(self, hop: Hop, info: VersionInfo) -> None:
        """The relay adopts the root's version, opens its next round, and its waiting children hear of it."""
        if hop.relay.hear(info):
            block = hop.relay.blocks[info.block]
            if block.round.deadline() > self.now:
                self._at(block.round.deadline(), self._relay_tick, hop, info.block)
            for rep in self.replicas:
                if rep.relay is hop.relay and rep.worker.wcfg.block == info.block and rep.waiting_for is not None:
                    self._at(self.now + self._delay(rep), self._hear, rep, rep.waiting_for)
        self._after_aggregator()

    def _wake_auditor(self) -> None:
        """Jobs that wait for verifiers (a swarm's first audits: trust/delegate.py WAIT_S) go on once they
        waited long enough, as the daemon's auditor finds them on its next pass, not at the next event:
        behind relays, every worker may be waiting for the version those jobs hold back."""
        d = self.agg.delegated
        if d is None or self._auditor_at is not None:
            return
        with d.lock:
            first = min((j.arrived for j in d.waiting), default=None)
        if first is not None:
            self._auditor_at = max(self.now, first + WAIT_S) + AUDITOR_S
            self._at(self._auditor_at, self._auditor)

    def _auditor(self) -> None:
        self._auditor_at = None
        self._audit()
        self._after_aggregator()

    def _heard(self, rep: Replica, b: int) -> int:
        """The newest version of block `b` announced where the replica listens (its relay, or the root)."""
        return rep.relay.blocks[b].info.version if rep.relay is not None else self._published[b]

    def _attempt(self, rep: Replica) -> None:
        if rep.attempts >= self.scfg.rounds:
            rep.finished, rep.finished_at = True, self.now
            return
        rep.attempts += 1
        if rep.turnout.random() >= self.scfg.participation:
            rep.absent += 1
            rep.missed.append(rep.attempts)
            self._at(self.now + self.acfg.round.deadline_s, self._come_back, rep)
            return
        w = rep.worker
        steps = w.steps_due()
        w.train_steps(steps)
        rep.busy_s += steps * self.scfg.step_time_s
        header, raw = w.make_update()
        sent = self.now + steps * self.scfg.step_time_s
        self._at(sent + self._delay(rep), self._arrive, rep, header, raw, sent)

    def _arrive(self, rep: Replica, header, raw, sent: float) -> None:
        try:
            j = rep.worker.push(header, raw)
            rep.worker.pushed(j)
            rep.taken = (header, j) if j.outcome.in_round else None
        except Forbidden:  # revoked after a failed audit: it stops, as a worker process does
            rep.finished, rep.finished_at = True, self.now
            self._audit()
            self._after_aggregator()
            return
        self._audit()
        rep.waiting_for, rep.waiting_since = header.base_version, sent  # it has waited since it sent
        before = self._heard(rep, header.block)
        self._after_aggregator()
        if before > header.base_version:  # it was late: a newer version was already out
            self._at(self.now + self._delay(rep), self._hear, rep, header.base_version)

    def _hear(self, rep: Replica, base: int) -> None:
        if rep.waiting_for != base:
            return  # already heard of a newer version
        w = rep.worker
        if w.wcfg.train_while_waiting and w.stats.pushes < self.scfg.rounds:  # off at Join when audits are on
            # what it would have trained while waiting, one step per step_time, at most H
            n = min(self.scfg.steps_per_round, int((self.now - rep.waiting_since) / self.scfg.step_time_s))
            w.train_steps(n)
            w.stats.wait_steps += n
            rep.busy_s += n * self.scfg.step_time_s
        rep.waiting_for = None
        w.send_wanted()  # start states asked for after their pushes (as a worker does with each version)
        self._audit()
        newer = self._parent(rep).block(w.wcfg.block).info
        if rep.taken is not None:  # its round receipt, as a worker asks for it with the next version
            w.settle(*rep.taken, newer)
            rep.taken = None
        w.advance(newer)
        self._attempt(rep)

    def _come_back(self, rep: Replica) -> None:
        w = rep.worker
        newest = self._parent(rep).block(w.wcfg.block).info
        assert w.info is not None
        if newest.version > w.info.version:
            w.advance(newest)
        self._attempt(rep)

    # -- running -----------------------------------------------------------------------------
    def _audit(self) -> None:
        """Replay what is due at once, the aggregator's replays and the workers' verification duties
        (delegated verification; a dispute takes a few exchanges): their compute is counted, their time
        is not simulated."""
        self.verdicts.extend(self.agg.run_audits())
        for _ in range(8):
            for hop in self.relays:  # a relay fetches its children's duties when its stream says so (at once here)
                hop.relay.admission.duties.refresh()
            if not sum(r.worker.verify() for r in self.replicas):
                break
            self.verdicts.extend(self.agg.run_audits())

    def run(self, until: Callable[[], bool] | None = None) -> SimResult:
        """Run every replica's rounds (or stop once `until()` holds, checked after each event)."""
        for rep in self.replicas:
            rep.worker.start()
        for b, agg in self.agg.blocks.items():
            self._at(agg.round.deadline(), self._tick, b)
        for hop in self.relays:
            for b, block in hop.relay.blocks.items():
                self._at(block.round.deadline(), self._relay_tick, hop, b)
        for rep in self.replicas:
            self._at(0.0, self._attempt, rep)
        while self._queue:
            t, _, fn, args = heapq.heappop(self._queue)
            self.now = max(self.now, t)
            fn(*args)
            if until is not None and until():
                for rep in self.replicas:  # stopped early: the unfinished ones end now
                    rep.finished_at = rep.finished_at if rep.finished else self.now
                break
        outcomes: dict[str, int] = {o.value: 0 for o in Outcome}
        for agg in self.agg.blocks.values():
            for (outcome, _), n in agg.counters.items():
                outcomes[outcome] = outcomes.get(outcome, 0) + n
        return SimResult(virtual_seconds=max(r.finished_at for r in self.replicas), versions={b: a.info.version for b, a in self.agg.blocks.items()},
                         outcomes=outcomes, attempts=sum(r.attempts for r in self.replicas),
                         absent=sum(r.absent for r in self.replicas),
                         utilisation=sum(r.busy_s / max(r.finished_at, 1e-9) for r in self.replicas) / len(self.replicas),
                         closed_by=dict(sum((a.rounds_closed for a in self.agg.blocks.values()), Counter())))

    def blocks(self) -> list[torch.nn.Module]:
        """The published model: each unit at its newest version (the blocks, or the one AR model)."""
        out = []
        for b, agg in sorted(self.agg.blocks.items()):
            blk = init_unit(self.cfg, b, 0)
            blk.load_state_dict(agg.current()[1])
            out.append(blk)
        return out

