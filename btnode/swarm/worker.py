"""`BlockWorker` (design §3.2): join with the run fingerprint, pull the block, then per round
train H local steps with a persistent inner AdamW, push the encoded delta (with error feedback)
against its base version, wait for the next version on the server stream, apply the published
delta and check its hash, falling back to a full pull when behind or on a mismatch.

No idle waiting (issue #5): the exchange of a round (push the update, wait for the next version,
fetch it) runs in a background thread, and meanwhile the worker keeps training from its local
state (at most H steps). When the version arrives, that work is folded in:
θ ← θ^{v+1} + (θ_now − θ_pushed), so the next update carries it and the next round needs only
the remaining H − (steps done while waiting). If the pushed update was refused (late, stale,
rejected), nothing of it reached θ^{v+1}, so the fold keeps all of it: θ ← θ^{v+1} + (θ_now − θ^v).
`swarm.fold.Fold` holds that state; `swarm.announcements` follows the server stream of versions.

An update taken into a round is answered PENDING (or PROBATION: held for its audit); its round
receipt comes with the next version: APPLIED, or DROPPED with the reason (the robust screen at the
round's close, a revocation, a failed or late audit). A dropped update's work is not folded into the
next update: the round judged it, and sending it again would bring back what it dropped. Its
error-feedback residual is dropped with it too, except after the screen's direction or standing drop
(KEEPS_RESIDUAL): a sparse codec's residual holds most of the worker's last rounds (at 0.3 % density,
all but the top-k), which such a drop, a noisy judgement of one round's top-k, would otherwise throw
away; the audit chain accepts it (the next update starts from the last one's end residual).

A DiLoCo run (ModelConfig.kind "ar") uses this same loop: its one unit, block 0, is the whole AR
model, so a worker trains a full replica with its inner AdamW and pushes the replica's delta; only
the unit's model and trainer differ (store.models.init_unit, train.trainers.unit_trainer).

Which windows it trains is the swarm's choice: Join hands it a data key
(btnode/aggregate/trust/datakeys.py), and step s trains WindowSampler.batch(seed, key, s, batch); each
update names its key and steps, so anyone holding the data can re-derive what it was trained on.

It talks to the aggregator only through an Upstream, so the same loop runs over gRPC or
in-process. Every transfer is counted (raw and wire bytes) for the benchmarks.
"""

from __future__ import annotations

import json
import logging
import operator
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from btnode.codec.codecs import SPARSE_DENSITY, Codec, parse
from btnode.codec.profiles import CLI_LINK, LINKS, Link, link_codecs
from btnode.codec.warmup import DensityWarmup
from btnode.codec.frames import Bundle, Frame, ReplayableFrames, encode_update, frame_from_raw, lazy_frames
from btnode.data.source import ByteSource
from btnode.data.windows import WindowSampler
from btnode.errors import BtnodeError, ConfigError, Forbidden, MalformedInput, PeerInputError, PeerUnavailable
from btnode.model.config import ModelConfig
from btnode.protocol import (EMPTY_STATE, OPTIMIZER_PREFIX, RESIDUAL_PREFIX, Upstream, Judgement, Outcome,
                             PushHeader, RoundReceipt, RoundSize, Transfer, VersionInfo, WorkClaim)
from btnode.settings import fill, flag, same_flag
from btnode.store.files import optimizer_tensors, state_sha256
from btnode.store.models import init_unit
from btnode.swarm.announcements import Announcements
from btnode.swarm.fold import Fold
from btnode.swarm.verify import Verification
from btnode.train.config import TrainConfig
from btnode.train.recipe import Recipe
from btnode.train.terms import TrainingTerms
from btnode.train.trainers import unit_trainer

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]
T = TypeVar("T")
# Start states kept for audits (audits on): an update drawn at its push is asked for with the answer; one
# asked for later (dropped at close, or in a round found attacked) within the aggregator's repair window
# (AuditConfig.window = 4 closed rounds), a round after it: 4 + 2 covers both. Each is the optimizer state
# and the residual: about 3 × the block's parameters.
STATES_KEPT = 6
# The screen's drops after which a worker keeps its residual (module doc): not a norm drop, whose residual
# would carry the outlying size into the next update, nor a failed audit or a revocation
KEEPS_RESIDUAL = frozenset({"direction_at_close", "standing_at_close"})
DUTIES_POLL_S = 5.0  # while waiting for a version, how often a worker asks for duties its stream did not announce


@dataclass(frozen=True)
class WorkerConfig:
    """Local settings of one worker (never part of the fingerprint)."""

    worker_id: str = flag("--worker-id", "Unique name (default host-pid; a stage: block-B).")
    block: int = flag("--block", "The block to train or serve (a --model ar worker: 0, the default).")
    steps_per_round: int = same_flag(RoundSize, "steps_per_round")  # H: local steps between pushes
    codec: Codec = flag("--codec", "Update codec: fp32, bf16, int8, sparse8 or sparse2 (default: --link's; "
                                   "docs/tuning.md).",
                        default=Codec.INT8, value=str, parse=parse, format=lambda c: c.name.lower(), optional=True)
    density: float = flag("--density", "Share of values a sparse codec sends (0, 1]; default: --link's.",
                          default=SPARSE_DENSITY, optional=True)  # sparse codecs: top-k per 4,096-value chunk at this share
    warmup: DensityWarmup = DensityWarmup()  # ... denser over the first versions (codec/warmup.py)
    link: str = same_flag(Link, "link")  # the profile the CLI filled the codec from (codec/profiles.py)
    # a codec the link profile chose, not the user: where the aggregator does not take it (a relay takes
    # dense updates only), the worker sends this one instead (a flag, so that `btnode swarm` can pass it on)
    fallback: Codec | None = flag("--codec-fallback", "Codec to send where the aggregator does not take --codec "
                                                      "(--link sets int8 for its sparse choice).",
                                  default=None, value=str, parse=parse, format=lambda c: c.name.lower(),
                                  optional=True)
    error_feedback: bool = flag("--no-error-feedback", "Drop the codec's rounding error.", default=True,
                                parse=operator.not_, format=operator.not_)  # carry the rounding error into the next update
    rounds: int | None = flag("--rounds", "Stop after this many pushes.",
                              default=None)  # stop after this many pushes (None: until stopped)
    wait_timeout_s: float = 600.0  # give up waiting for a version after this long
    outage_s: float = 600.0  # keep retrying a push or fetch through UNAVAILABLE this long (same update id)
    train_while_waiting: bool = flag("--train-while-waiting/--idle-while-waiting",
                                     "Keep training while the next version is on its way, and fold that work into the "
                                     "next update.", default=True)
    schedule_by_version: bool = flag("--schedule-by-version/--schedule-by-own-steps",
                                     "Inner LR schedule position: at least version × H (catch up after an absence), or "
                                     "its own step count.", default=True)  # see _adopt

    def __post_init__(self) -> None:
        if not 0 < self.density <= 1:
            raise ConfigError(f"--density must be in (0, 1], got {self.density}")
        if self.link not in LINKS:
            raise ConfigError(f"--link must be one of {LINKS}, got {self.link!r}")

    @classmethod
    def from_flags(cls, values: Mapping[str, Any]) -> WorkerConfig:
        """The flags' settings; a codec and density no flag gives come from --link (the CLI's default:
        wan) for the swarm's model (codec/profiles.py), with int8 to fall back on where the aggregator
        does not take the profile's codec."""
        made = fill(cls, values)
        link = link_codecs(values.get("link"), values.get("model"))
        made = replace(made, link=values.get("link") or CLI_LINK)
        if values.get("codec") is None:
            made = replace(made, codec=link.codec, fallback=Codec.INT8 if link.codec is not Codec.INT8 else None)
        if values.get("density") is None:
            made = replace(made, density=link.density)
        return replace(made, warmup=link.warmup.over(values))


@dataclass
class WorkerStats:
    pushes: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    bytes_pushed_raw: int = 0
    bytes_pushed_wire: int = 0
    bytes_pulled_raw: int = 0
    bytes_pulled_wire: int = 0
    push_seconds: float = 0.0  # summed over pushes (answer included)
    pull_seconds: float = 0.0  # summed over full pulls and delta fetches
    full_pulls: int = 0
    delta_fetches: int = 0
    bytes_delta_wire: int = 0  # the part of bytes_pulled_wire that published deltas took (the rest: full pulls)
    train_seconds: float = 0.0  # wall time inside training steps (utilisation = train_seconds / wall)
    steps: int = 0
    wait_steps: int = 0  # steps trained while waiting for a version, folded into the next update
    folds: int = 0
    started: float = field(default_factory=time.perf_counter)
    losses: list[float] = field(default_factory=list)
    version: int = -1  # the version the worker holds now, and its hash
    sha256: str = ""
    retries: int = 0  # calls tried again: refused for now (over a server's limit) or through an outage
    reconnects: int = 0  # version streams opened again after one broke or was refused
    repushes: dict[str, int] = field(default_factory=dict)  # updates pushed again after a reconnect, by the answer
    accepted_updates: list[str] = field(default_factory=list)  # ids of its updates taken into a round (PENDING)
    not_included: list[str] = field(default_factory=list)  # ... that the next version left out, no receipt saying why
    applied: int = 0  # its updates whose round receipt says APPLIED
    verified: int = 0  # verification duties done for the swarm (replays of others' rounds, dispute traces and states)
    verify_seconds: float = 0.0  # ... and their compute (swarm/verify.py)
    dropped: dict[str, int] = field(default_factory=dict)  # reason → its updates whose receipt says DROPPED


@dataclass(frozen=True)
class Exchanged:
    """What a round's exchange brought back: the answer to the push, the next version (None when
    stopped first) and its θ, fetched and hash-checked."""

    judgement: Judgement
    newer: VersionInfo | None
    fetched: tuple[VersionInfo, Tensors] | None


class BlockWorker:
    def __init__(self, cfg: ModelConfig, tc: TrainConfig, wcfg: WorkerConfig, link: Upstream,
                 corpus: ByteSource | bytes, *, device: torch.device, data_id: str = ""):
        """`data_id`: what `corpus` is (btnode.data.identity), stated at Join so that the aggregator
        can refuse a worker that trains on other data than the swarm; empty: not stated."""
        self.cfg, self.tc, self.wcfg, self.link = cfg, tc, wcfg, link
        self.data_id = data_id
        self.data_key = ""  # handed out by the aggregator at Join
        self.sampler = WindowSampler(corpus, cfg.context)
        self.corpus = corpus
        self.verification: Verification | None = None  # made at Join when the swarm audits (swarm/verify.py)
        model = init_unit(cfg, wcfg.block, tc.seed)
        self.spec = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        self.trainer = unit_trainer(cfg, wcfg.block, model, tc, device=device)
        self.base: Tensors = {}
        self.info: VersionInfo | None = None
        self.residual: Tensors = {}
        self.stats = WorkerStats()
        self.announcements = Announcements(link, wcfg.block, wcfg.worker_id, wait_timeout_s=wcfg.wait_timeout_s,
                                           on_reconnect=self._count_reconnect)
        self._fold = Fold()  # what the next update carries (replaced at each step, push, answer and version)
        self._last_update: tuple[PushHeader, dict[str, bytes]] | None = None  # re-pushed after a reconnect
        self.recipe = Recipe.here(device, tc.precision.value, error_feedback=wcfg.error_feedback)
        self.audits = False  # set at Join: the swarm replays updates, so keep each round's start state
        self.bundles = True  # set at Join: the aggregator reads a bundle (an older one: frames)
        self._start: tuple[str, Tensors | None] = (EMPTY_STATE, None)  # the round's optimizer start: hash, state
        # update id → (its header, the state its round started from), for an audit: asked for with the push's
        # answer (drawn), or later (dropped at close, or in a round found attacked: `send_wanted`)
        self._states: OrderedDict[str, tuple[PushHeader, Tensors]] = OrderedDict()
        self._stop: threading.Event | None = None
        self.heartbeat: Callable[[], None] = lambda: None  # called every step and wait tick (a watchdog)
        self.on_ready: Callable[[], None] = lambda: None  # called once joined and pulled
        self.new_update_id: Callable[[], str] = lambda: uuid.uuid4().hex  # a seeded one in the simulator

    def _count_reconnect(self) -> None:
        self.stats.reconnects += 1

    def count_retry(self, what: str = "", reason: str = "") -> None:
        """A call tried again (the link's refused calls report here too)."""
        self.stats.retries += 1

    # -- versions ----------------------------------------------------------------------------
    def _adopt(self, info: VersionInfo, params: Tensors) -> None:
        """Make θ^version the base and the model's parameters; the inner optimizer state stays."""
        self.info, self.base = info, {n: t.clone() for n, t in params.items()}
        self.stats.version, self.stats.sha256 = info.version, state_sha256(params)
        if self.wcfg.schedule_by_version:
            # the inner LR schedule follows the swarm's progress: a replica that was away (or joins
            # late) continues at version × H, not where its own step count left it
            self.trainer.step = max(self.trainer.step, info.version * self.wcfg.steps_per_round)
        with torch.no_grad():
            for name, p in self.trainer.model.state_dict().items():
                p.copy_(params[name])

    def _fetch_full(self) -> tuple[VersionInfo, Tensors]:
        pulled = self.link.pull(self.wcfg.block, self.wcfg.worker_id, self.spec)
        self.stats.full_pulls += 1
        self._count_pull(pulled.transfer)
        if state_sha256(pulled.tensors) != pulled.info.sha256:
            raise MalformedInput("checksum", f"pulled block {self.wcfg.block} v{pulled.info.version} fails its hash")
        return pulled.info, pulled.tensors

    def _pull(self) -> None:
        self._adopt(*self._fetch_full())

    def _count_pull(self, t: Transfer) -> None:
        self.stats.bytes_pulled_raw += t.raw
        self.stats.bytes_pulled_wire += t.wire
        self.stats.pull_seconds += t.seconds

    def _fetch(self, target: VersionInfo) -> tuple[VersionInfo, Tensors]:
        """θ of `target`, hash-checked: its delta added to our base when it builds on it, else a full
        pull. Touches neither the model nor the base, so it may run while the model trains."""
        assert self.info is not None
        if target.base_version == self.info.version:
            try:
                got = self.link.fetch_delta(self.wcfg.block, target.version, self.spec)
                self.stats.delta_fetches += 1
                self.stats.bytes_delta_wire += got.transfer.wire
                self._count_pull(got.transfer)
                params = {n: self.base[n] + got.tensors[n] for n in self.base}  # exactly as the aggregator adds
                if state_sha256(params) == target.sha256 == got.info.sha256:
                    return target, params
                log.warning("block %d v%d: delta result fails the published hash; pulling in full",
                            self.wcfg.block, target.version)
            except BtnodeError as exc:
                log.warning("block %d v%d: delta unavailable (%s); pulling in full", self.wcfg.block, target.version, exc)
        return self._fetch_full()

    def _catch_up(self, target: VersionInfo) -> None:
        """Reach `target`: apply its delta when it builds on our base, else pull in full."""
        self._adopt(*self._fetch(target))

    def _repush(self, version: int) -> None:
        """After the announcement stream reconnects while we wait on the round of `version`, push
        the same update again (same update id). If the aggregator only lost the connection, it
        answers as before; if it restarted and lost its open round, the update is judged again
        rather than silently lost."""
        if self._last_update is None or self._last_update[0].base_version != version:
            return
        header, raw = self._last_update
        j = self.push(header, raw)
        self.stats.repushes[j.outcome.value] = self.stats.repushes.get(j.outcome.value, 0) + 1
        log.info("worker %s: re-pushed update %s after reconnecting: %s%s", self.wcfg.worker_id, header.update_id[:8],
                 j.outcome.value, f" ({j.reason})" if j.reason else "")

    # -- rounds ------------------------------------------------------------------------------
    def train_steps(self, n: int) -> None:
        """Train n local steps; their CE joins the next update's."""
        t0 = time.perf_counter()
        for _ in range(n):
            if self._stop is not None and self._stop.is_set():
                break  # draining: stop at a step boundary
            if not self._fold.pending:
                self._mark_start()
            step = self.trainer.step
            x = self.sampler.batch(self.tc.seed, self.data_key, step, self.tc.batch)
            self._fold = self._fold.trained(step, self.trainer.train_step(x, self.wcfg.worker_id).ce)
            self.stats.steps += 1
            self.heartbeat()
        self.stats.train_seconds += time.perf_counter() - t0

    def _mark_start(self) -> None:
        """The optimizer state a round starts from: its hash goes into the claim, and (audits on) a copy
        is kept until the update's answer says whether an auditor wants it."""
        state = optimizer_tensors(self.trainer.opt)[0]
        kept = {n: t.detach().cpu().clone() for n, t in state.items()} if self.audits else None
        self._start = (state_sha256(state), kept)

    def _claim(self, residual_start: Tensors, residual_end: Tensors) -> WorkClaim:
        assert self.info is not None
        return WorkClaim(base_sha256=self.info.sha256, data_id=self.data_id, recipe=self.recipe.to_json(),
                         optimizer_start=self._start[0],
                         optimizer_end=state_sha256(optimizer_tensors(self.trainer.opt)[0]),
                         residual_start=state_sha256(residual_start), residual_end=state_sha256(residual_end))

    def steps_due(self) -> int:
        """Steps still to train before the next push (H minus what was folded in)."""
        return self._fold.due(self.wcfg.steps_per_round)

    def make_update(self) -> tuple[PushHeader, dict[str, bytes]]:
        """The header and codec bytes of Δ = θ_local − θ^v (+ residual) over the pending steps."""
        assert self.info is not None and self._fold.pending
        loss, samples, steps = self._fold.loss, len(self._fold.pending) * self.tc.batch, self._fold.steps
        self.stats.losses.append(loss)
        self._fold = self._fold.sent()
        residual_start = self.residual
        raw = self._encode()
        header = PushHeader(worker_id=self.wcfg.worker_id, block=self.wcfg.block, base_version=self.info.version,
                            samples=float(samples), loss=loss, codec=self.wcfg.codec, update_id=self.new_update_id(),
                            data_key=self.data_key, steps=steps, claim=self._claim(residual_start, self.residual))
        if self._start[1] is not None:
            self._states[header.update_id] = (header, {
                **{OPTIMIZER_PREFIX + n: t for n, t in self._start[1].items()},
                **{RESIDUAL_PREFIX + n: t.clone() for n, t in residual_start.items()}})
            while len(self._states) > STATES_KEPT:
                self._states.popitem(last=False)
        self._last_update = (header, raw)
        return self._last_update

    def pushed(self, j: Judgement, at_push: Tensors | None = None) -> None:
        """Record the answer to the last update and decide what the wait may fold in. `at_push` is θ
        when the update was made (default: now), for when training went on during the push."""
        self.stats.pushes += 1
        self.stats.outcomes[j.outcome.value] = self.stats.outcomes.get(j.outcome.value, 0) + 1
        # PENDING and PROBATION may still be applied (a re-push may hear the receipt itself: APPLIED or
        # DROPPED): the residual stays until a DROPPED receipt says otherwise (`settle`), so a worker on
        # probation keeps its error feedback; the update's work is never folded in again (see the module doc)
        taken = j.outcome.in_round or j.outcome in (Outcome.APPLIED, Outcome.DROPPED)
        if not taken:
            self.residual = {}  # refused: the delta was not applied, its rounding error means nothing
        if j.outcome is Outcome.DROPPED:
            self._dropped(j.reason, j.round_version + 1)
        elif j.outcome is Outcome.APPLIED:
            self.stats.applied += 1
        if not self.wcfg.train_while_waiting:
            self._fold = self._fold.idle()
        elif taken:
            self._fold = self._fold.accepted(at_push if at_push is not None else self._params())
        else:
            self._fold = self._fold.refused(dict(self.base), 2 * self.wcfg.steps_per_round)  # claims.max_steps

    def advance(self, target: VersionInfo, fetched: tuple[VersionInfo, Tensors] | None = None) -> None:
        """Move to `target` (or to an already `fetched` version) and fold in what was trained since
        the push (see the module doc)."""
        carry = self._fold.carry(self._params()) if self._fold.carries else None
        self._fold = self._fold.landed()
        if fetched is not None:
            self._adopt(*fetched)
        else:
            self._catch_up(target)
        if carry is not None:
            self.stats.folds += 1
            with torch.no_grad():
                for name, p in self.trainer.model.state_dict().items():
                    p.add_(carry[name].to(p.device))

    def _params(self) -> Tensors:
        return {n: t.detach().cpu().clone() for n, t in self.trainer.model.state_dict().items()}

    def _encode(self) -> dict[str, bytes]:
        """The codec's raw bytes of Δ (+ residual); keeps the new residual (error feedback). A sparse codec keeps
        the share of values the warm-up gives the base version (codec/warmup.py)."""
        assert self.info is not None
        keep = self.wcfg.warmup.keep(self.wcfg.density, self.info.version)
        raw, residual = encode_update(self.trainer.model.state_dict(), self.base, self.residual, self.wcfg.codec,
                                      error_feedback=self.wcfg.error_feedback, keep=keep)
        self.residual = residual
        return raw

    def _frames(self, raw: dict[str, bytes]) -> Iterator[Bundle | Frame]:
        """One bundle (to an aggregator older than bundles, a frame a tensor), compressed lazily as gRPC
        sends: counted once sent (a re-push counts again)."""
        if self.bundles:
            yield Bundle(self.wcfg.codec, [(n, raw[n]) for n in self.spec], on_sent=self._sent)
            return
        for n, s in self.spec.items():
            f = frame_from_raw(n, s, self.wcfg.codec, raw[n])
            self._sent(f.raw_bytes, f.payload_bytes)
            yield f

    def _sent(self, raw: int, wire: int) -> None:
        self.stats.bytes_pushed_raw += raw
        self.stats.bytes_pushed_wire += wire

    def _through_outage(self, what: str, fn: Callable[[], T]) -> T:
        """fn(), retried with backoff while the aggregator is unreachable, for up to outage_s (a
        restart, a network partition); then the UNAVAILABLE is raised."""
        start, attempt = time.monotonic(), 0
        while True:
            try:
                return fn()
            except PeerUnavailable as exc:
                stopping = self._stop is not None and self._stop.is_set()
                if stopping or time.monotonic() - start > self.wcfg.outage_s:
                    raise
                log.warning("%s unavailable (%s); retrying", what, exc)
                self.heartbeat()
                self.count_retry(what)
                time.sleep(min(5.0, 0.5 * 2**attempt) * random.uniform(0.5, 1.0))  # jittered: not all at once
                attempt += 1

    def push(self, header: PushHeader, raw: dict[str, bytes]) -> Judgement:
        """Push (re-pushing the same update id through UNAVAILABLE). A refusal (stale, or rejected
        by validation) is an answer, not a failure: the worker drops the update and catches up."""
        def once() -> Judgement:
            t0 = time.perf_counter()
            j = self.link.push(header, ReplayableFrames(lambda: self._frames(raw)))
            self.stats.push_seconds += time.perf_counter() - t0
            return j

        try:
            j = self._through_outage("push", once)
        except Forbidden:
            raise  # revoked (a failed audit, the operator): no later push can be taken, so stop
        except PeerInputError as exc:
            outcome = Outcome.STALE if exc.reason == "stale" else Outcome.REJECTED
            log.warning("worker %s: update %s: %s", self.wcfg.worker_id, outcome.value, exc)
            return Judgement(outcome=outcome, reason=str(exc), round_version=-1)
        if j.audit:
            self._send_state(header)
        return j

    def _send_state(self, header: PushHeader) -> None:
        """The aggregator drew this update for a replay audit: send the state its round started from.
        Not sending it counts as failing the audit, so a refusal is logged loudly."""
        state = self._states.get(header.update_id, (None, None))[1]
        if state is None:
            log.error("worker %s: update %s was drawn for audit, but its start state is no longer kept",
                      self.wcfg.worker_id, header.update_id[:8])
            return
        try:
            self._through_outage("state upload", lambda: self.link.submit_state(
                header, ReplayableFrames(lambda: lazy_frames(state, Codec.FP32))))
            log.info("worker %s: sent the start state of update %s for its audit", self.wcfg.worker_id,
                     header.update_id[:8])
        except PeerInputError as exc:
            log.error("worker %s: the start state of update %s was refused: %s", self.wcfg.worker_id,
                      header.update_id[:8], exc)

    def make_verification(self) -> Verification:
        """This worker's verifier (a cheat in the bench makes a lying one)."""
        return Verification(self.cfg, self.wcfg.block, self.corpus, self.link, self.wcfg.worker_id)

    def verify(self) -> int:
        """Do the verification duties handed out since the last call (between rounds); returns how many."""
        if self.verification is None:
            return 0
        done = self.verification.run()
        self.stats.verified += done
        self.stats.verify_seconds = self.verification.seconds
        return done

    def send_wanted(self) -> None:
        """Send the start states the aggregator asked for after their pushes were answered (an update the
        screen dropped at close, or one of a round a failed audit found attacked: aggregate/replays.py)."""
        if not self.audits:
            return
        try:
            wanted = self.link.states_wanted(self.wcfg.block, self.wcfg.worker_id)
        except BtnodeError as exc:  # asked again with the next version
            log.warning("worker %s: could not ask which start states are wanted (%s)", self.wcfg.worker_id, exc)
            return
        for update_id in wanted:
            kept = self._states.get(update_id)
            if kept is None:
                log.error("worker %s: an audit asks for the start state of update %s, which is no longer kept",
                          self.wcfg.worker_id, update_id[:8])
                continue
            self._send_state(kept[0])

    def _exchange(self, header: PushHeader, raw: dict[str, bytes], stop: threading.Event, *,
                  overlap: bool) -> Exchanged:
        """Push the update, wait for the next version and fetch it, in a background thread; with
        `overlap`, keep training here meanwhile (at most H steps), to be folded in by advance()."""
        at_push = self._params() if overlap else None
        result: Future[Exchanged] = Future()

        def talk() -> None:
            try:
                j = self.push(header, raw)
                newer = self.announcements.newer(header.base_version, stop, self._repush)
                fetched = self._through_outage("fetch", lambda: self._fetch(newer)) if newer is not None else None
                result.set_result(Exchanged(j, newer, fetched))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
                result.set_exception(exc)

        thread = threading.Thread(target=talk, daemon=True, name="exchange")
        thread.start()
        trained, asked = 0, time.monotonic()
        while thread.is_alive():
            if overlap and trained < self.wcfg.steps_per_round and not stop.is_set():
                self.train_steps(1)
                self.stats.wait_steps += 1
                trained += 1
            else:
                self.heartbeat()
                thread.join(0.05)
                # while it waits for the round to close: the rounds of others wait for its replays. The version
                # stream says when duties wait; it asks anyway every DUTIES_POLL_S (an older aggregator)
                if self.verification is not None and (time.monotonic() - asked >= DUTIES_POLL_S or
                                                      self.link.duties_waiting(self.wcfg.block, self.wcfg.worker_id)):
                    self.verify()
                    asked = time.monotonic()
        got = result.result(timeout=0)
        self.pushed(got.judgement, at_push)
        if not overlap:
            self._fold = self._fold.idle()
        return got

    def settle(self, header: PushHeader, j: Judgement, newer: VersionInfo) -> RoundReceipt | None:
        """The round receipt of an update taken into a round (answered PENDING or PROBATION), asked for
        once the next version is here (the watch stream brought it, or a RoundReceipt call): APPLIED is
        counted; DROPPED is counted by reason, logged, and drops the residual. Without a receipt (an older
        aggregator, or behind a relay, whose parent decides), an update its round's version does not list
        is counted in `not_included` (a relay on the way could otherwise drop it unseen; docs/swarm.md,
        "Relays")."""
        if not j.outcome.in_round:
            return None
        self.stats.accepted_updates.append(header.update_id)
        try:
            receipt = self.link.receipt(self.wcfg.block, self.wcfg.worker_id, header.update_id)
        except BtnodeError as exc:  # the answer is a courtesy: never a reason to stop training
            log.warning("worker %s: no round receipt for update %s (%s)", self.wcfg.worker_id, header.update_id[:8],
                        exc)
            receipt = None
        if receipt is not None and receipt.outcome is Outcome.DROPPED:
            self._dropped(receipt.reason, receipt.version)
        elif receipt is not None:
            self.stats.applied += 1
        elif newer.base_version == header.base_version and newer.included and header.update_id not in newer.included:
            self.stats.not_included.append(header.update_id)
            log.warning("worker %s: update %s was taken into round %d, but version %d does not include it (lost on "
                        "the way up)", self.wcfg.worker_id, header.update_id[:8], header.base_version, newer.version)
        return receipt

    def _dropped(self, reason: str, version: int) -> None:
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        if reason not in KEEPS_RESIDUAL:
            self.residual = {}  # its rounding error belongs to a delta nobody applied
        log.warning("worker %s: the update of %s round %d was dropped at its close (%s): version %d does not hold "
                    "it", self.wcfg.worker_id, self.cfg.unit_name(self.wcfg.block), version - 1, reason or "no reason",
                    version)

    def start(self) -> None:
        """Join with the fingerprint, data id and training terms, take the data key, and pull the block."""
        w = self.wcfg
        joined = self.link.join(w.worker_id, w.block, self.cfg.fingerprint(), json.dumps(self.cfg.to_dict()),
                                self.data_id, training_json=TrainingTerms(self.tc, w.steps_per_round).to_json())
        if w.codec not in joined.codecs and w.fallback in joined.codecs:
            log.info("worker %s: the aggregator does not take %s updates (a relay takes dense ones only): sending %s",
                     w.worker_id, w.codec.name.lower(), w.fallback.name.lower())  # type: ignore[union-attr]
            self.wcfg = w = replace(w, codec=w.fallback, fallback=None)  # type: ignore[arg-type]
        if w.codec not in joined.codecs:
            raise MalformedInput("codec", f"the aggregator does not accept {w.codec.name} updates")
        self.data_key = joined.data_key or w.worker_id
        self.audits = joined.audits
        self.bundles = joined.bundles
        if joined.audits:  # its workers may be drawn to verify each other's rounds (aggregate/trust/delegate.py)
            self.verification = self.make_verification()
        if joined.audits and w.train_while_waiting:
            log.info("worker %s: the swarm replays updates to audit them, so this worker trains nothing while it "
                     "waits for a version (work folded in could not be replayed)", w.worker_id)
            self.wcfg = replace(w, train_while_waiting=False)
        if not joined.data_key:
            log.warning("worker %s: the aggregator hands out no data key (an older version); drawing windows by the "
                        "worker id, so replicas with the same id train the same windows", w.worker_id)
        self._pull()

    def run(self, stop: threading.Event | None = None) -> WorkerStats:
        stop = self._stop = stop or threading.Event()
        self.start()
        w = self.wcfg  # as Join left it (audits turn training while waiting off)
        self.on_ready()
        watcher = threading.Thread(target=self.announcements.follow, args=(stop,), daemon=True, name="watch")
        watcher.start()
        log.info("worker %s: %s at version %d, data key %s", w.worker_id, self.cfg.unit_name(w.block),
                 self.info.version if self.info else -1, self.data_key)
        try:
            while not stop.is_set() and (w.rounds is None or self.stats.pushes < w.rounds):
                self.train_steps(self.steps_due())
                if stop.is_set():  # a drain: nothing partial is pushed; leaving frees the round from waiting on us
                    log.info("worker %s: stopping; abandoning the unfinished round (%d of %d steps)",
                             w.worker_id, len(self._fold.pending), w.steps_per_round)
                    break
                header, raw = self.make_update()
                last = w.rounds is not None and self.stats.pushes + 1 >= w.rounds
                got = self._exchange(header, raw, stop, overlap=w.train_while_waiting and not last)
                j = got.judgement
                log.info("worker %s: %s round %d: %s%s (CE %.4f, %d steps)", w.worker_id, self.cfg.unit_name(w.block),
                         header.base_version, j.outcome.value, f": {j.reason}" if j.reason else "", header.loss,
                         int(header.samples) // self.tc.batch)
                if got.newer is None:
                    break
                self.settle(header, j, got.newer)
                self.send_wanted()
                self.verify()
                self.advance(got.newer, got.fetched)
        finally:
            stop.set()
            try:
                self.link.leave(w.worker_id, w.block)
            except BtnodeError:
                pass
            # End the watch stream and wait for its thread: a daemon thread still inside gRPC when
            # the interpreter exits aborts the process ("terminate called without an active exception").
            self.link.cancel_watches(w.worker_id)
            watcher.join(timeout=10.0)
        return self.stats
