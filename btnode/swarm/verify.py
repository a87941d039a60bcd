"""A worker's part in delegated verification (aggregate/trust/delegate.py; docs/security.md, "Delegated
verification"): between its rounds it asks for its duties, replays the rounds it was drawn to verify
(train/replay.py, under the author's thread count, as the aggregator would) and attests the digest of
what it got; in a dispute it sends the trace of a round (its own update's, or one it verified) and the
whole state before a disputed step. Its replays are metered (`seconds`): they are its verified work."""

from __future__ import annotations

import logging
import time

from btnode.data.source import ByteSource
from btnode.errors import BtnodeError, MalformedInput
from btnode.model.config import ModelConfig
from btnode.protocol import Attestation, Upstream, VerifyTask
from btnode.train.recipe import Recipe
from btnode.train.replay import ReplayResult, RoundReplay, torch_threads
from btnode.train.terms import TrainingTerms

log = logging.getLogger(__name__)


class Verification:
    def __init__(self, cfg: ModelConfig, block: int, corpus: ByteSource | bytes, link: Upstream, worker_id: str):
        self.block, self.link, self.worker_id = block, link, worker_id
        self.replay = RoundReplay(cfg, block, corpus)
        self.seconds = 0.0  # compute spent verifying (replays, traces, dispute states)

    def run(self) -> int:
        """Do every duty handed out since the last call; returns how many. A duty that fails here (the
        aggregator refused it, the task closed) is logged and skipped: verification never stops training."""
        try:
            duties = self.link.duties(self.block, self.worker_id)
        except BtnodeError as exc:
            log.warning("worker %s: could not ask for verification duties (%s)", self.worker_id, exc)
            return 0
        done = 0
        for task in duties.tasks:
            done += self._do("verify", task, lambda t=task: self._attest(t))
        for tw in duties.traces:
            done += self._do("trace", tw.task, lambda t=tw.task: self.link.submit_trace(
                self.block, t.task_id, self.worker_id, self._replayed(t, trace=True).trace))
        for sw in duties.states:
            done += self._do("state", sw.task, lambda t=sw.task, k=sw.k: self.link.submit_dispute_state(
                self.block, t.task_id, self.worker_id, k, self._state_after(t, k)))
        return done

    def _do(self, what: str, task: VerifyTask, fn) -> int:  # type: ignore[no-untyped-def]
        try:
            fn()
            return 1
        except (BtnodeError, MalformedInput) as exc:
            log.warning("worker %s: %s of %s's update %s: %s", self.worker_id, what, task.header.worker_id,
                        task.task_id[:8], exc)
            return 0

    def _attest(self, task: VerifyTask) -> None:
        t0 = time.perf_counter()
        result = self._replayed(task)
        self.link.attest(self.block, Attestation(task.task_id, self.worker_id, self.digest(task, result),
                                                 time.perf_counter() - t0))

    def digest(self, task: VerifyTask, result: ReplayResult) -> str:
        """What this verifier attests (a lying one, in the cheats bench, overrides it)."""
        return result.digest

    def _replayed(self, task: VerifyTask, *, trace: bool = False) -> ReplayResult:
        base, start = self.link.verify_inputs(self.block, task.task_id, self.worker_id)
        recipe = Recipe.from_json(task.header.claim.recipe) if task.header.claim is not None else None
        if recipe is None:
            raise MalformedInput("claim", "a verification task without a work claim")
        t0 = time.perf_counter()
        with torch_threads(recipe.threads):
            out = self.replay.run(task.header, TrainingTerms.from_json(task.terms_json).train, base, start,
                                  keep=task.keep, error_feedback=recipe.error_feedback, trace=trace)
        self.seconds += time.perf_counter() - t0
        return out

    def _state_after(self, task: VerifyTask, k: int) -> dict:
        base, start = self.link.verify_inputs(self.block, task.task_id, self.worker_id)
        recipe = Recipe.from_json(task.header.claim.recipe) if task.header.claim is not None else None
        t0 = time.perf_counter()
        with torch_threads(recipe.threads if recipe is not None else 1):
            state = self.replay.state_after(task.header, TrainingTerms.from_json(task.terms_json).train, base, start, k)
        self.seconds += time.perf_counter() - t0
        return state
