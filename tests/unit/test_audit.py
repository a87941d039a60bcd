"""Work claims and replay audits (aggregate/trust/audit.py) in the one-process simulator: the daemon's own
aggregator and workers, real training, real frames; only the network and the clock are replaced."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from btnode.aggregate.trust.audit import AuditConfig, secret_draw
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.codecs import Codec
from btnode.data.corpus import bundled
from btnode.errors import Forbidden, MalformedInput
from btnode.model.config import ModelConfig
from btnode.protocol import EMPTY_STATE, Outcome
from btnode.sim.simulator import SimConfig, Simulation
from btnode.swarm.worker import BlockWorker
from btnode.train.config import TrainConfig
from btnode.train.recipe import Recipe

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1,))
TC = TrainConfig(batch=4, steps=200, warmup=5)
ACFG = AggregatorConfig(claims=ClaimConfig(enforce=True))


class Negating(BlockWorker):
    """Pushes its honest delta negated, with the claims of the honest one."""

    def _encode(self) -> dict[str, bytes]:
        with torch.no_grad():
            for n, p in self.trainer.model.state_dict().items():
                p.copy_(2 * self.base[n] - p)
        return super()._encode()


class Skipping(BlockWorker):
    """Lazy: trains every other step it claims (the claim lists all of them)."""

    def train_steps(self, n: int) -> None:
        for _ in range(n):
            if self.trainer.step % 2:
                self._fold = self._fold.trained(self.trainer.step, 0.0)
                self.trainer.step += 1
            else:
                super().train_steps(1)


def simulate(tmp_path: Path, corpus: bytes, *, rounds: int = 3, audit: float = 1.0, probation: int = 1,
             cheater: type[BlockWorker] | None = None, seed: int = 0, codec: Codec = Codec.INT8,
             acfg: AggregatorConfig = ACFG) -> Simulation:
    sim = Simulation(CFG, TC, acfg, SimConfig(rounds=rounds, replicas=3, steps_per_round=4, audit=audit,
                                              probation=probation, seed=seed, codec=codec, density=0.03),
                     corpus, tmp_path, device=torch.device("cpu"), workers={"b0r2": cheater} if cheater else None)
    sim.run()
    return sim


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return bundled().train.read(0, 400_000)


def test_honest_updates_replay_bit_for_bit(tmp_path, corpus):
    sim = simulate(tmp_path, corpus, rounds=3)
    audits = sim.agg.audits
    assert audits is not None
    assert audits.counts == {("passed", ""): 9}  # p = 1: every update of 3 workers × 3 rounds
    assert not sim.agg.identities.revoked
    counts = sim.agg.block(0).counters
    assert counts[(Outcome.PROBATION.value, "")] == 3  # each worker's first update, held until audited
    assert counts[(Outcome.PROBATION.value, "drawn")] == 6  # p = 1: every later one too (drawn)
    assert counts[(Outcome.PENDING.value, "admitted")] == 9  # ... then admitted
    assert counts[(Outcome.APPLIED.value, "")] == 9 and not any(o == Outcome.DROPPED.value for o, _ in counts)  # none lost
    assert sim.agg.block(0).info.version == 3


@pytest.mark.parametrize("codec", [Codec.SPARSE8, Codec.SPARSE2])
def test_sparse_updates_replay_bit_for_bit_and_a_negated_one_is_caught(tmp_path, corpus, codec):
    """The replay re-encodes at the keep the pushed frames state, with the sparse codecs' decayed error feedback."""
    honest = simulate(tmp_path / "honest", corpus, rounds=2, codec=codec)
    assert honest.agg.audits.counts == {("passed", ""): 6}
    cheat = simulate(tmp_path / "cheat", corpus, rounds=2, codec=codec, cheater=Negating)
    assert cheat.agg.identities.is_revoked("b0r2") and cheat.agg.audits.counts[("failed", "delta")] == 1


@pytest.mark.parametrize("cheat", [Negating, Skipping])
def test_a_cheater_on_probation_is_caught_before_any_update_counts(tmp_path, corpus, cheat):
    sim = simulate(tmp_path, corpus, rounds=3, cheater=cheat)
    assert sim.agg.identities.is_revoked("b0r2")
    assert sim.agg.audits.counts[("failed", "delta")] == 1
    assert sim.agg.audits.counts[("passed", "")] >= 2  # the honest ones pass
    block = sim.agg.block(0)
    assert block.counters[(Outcome.REJECTED.value, "revoked")] >= 1  # its later pushes are refused
    assert [r.name for r in sim.agg.identities.records() if r.failed] == ["b0r2"]


def test_without_probation_a_drawn_cheat_is_caught_and_its_held_update_dropped(tmp_path, corpus):
    sim = simulate(tmp_path, corpus, rounds=3, probation=0, cheater=Negating)
    block = sim.agg.block(0)
    assert sim.agg.identities.is_revoked("b0r2")
    assert block.counters[(Outcome.DROPPED.value, "audit_delta")] == 1  # held for its verdict, then dropped
    assert not block.held and "b0r2" not in block.round.accepted
    assert [(r.outcome, r.reason) for v in range(1, 4) for r in block.receipts_for("b0r2", v)].count(
        (Outcome.DROPPED, "audit_delta")) == 1  # and its sender is told so with the next version


def test_a_cheat_the_screen_drops_is_replayed_after_its_close_and_revokes(tmp_path, corpus):
    """No update is drawn (p ≈ 0, no probation): the negated one is only outvoted by the screen at close.
    Its later audit (its start state sent with the next version) fails, so its sender is revoked rather
    than left to try again; and the round it attacked is verified in full (the honest two pass)."""
    sim = simulate(tmp_path, corpus, rounds=3, audit=1e-9, probation=0, cheater=Negating)
    block = sim.agg.block(0)
    assert block.counters[(Outcome.DROPPED.value, "direction_at_close")] == 1
    assert sim.agg.identities.is_revoked("b0r2")
    assert [(v.header.worker_id, v.passed) for v in sim.verdicts][0] == ("b0r2", False)
    events = sim.agg.counters
    assert events[("later_audits", "dropped")] == 1 and events[("later_audits", "attacked")] == 2
    assert all(v.passed for v in sim.verdicts if v.header.worker_id != "b0r2")
    assert [r.name for r in sim.agg.identities.records() if r.failed] == ["b0r2"]


def test_honest_updates_the_screen_drops_pass_their_later_audit(tmp_path, corpus):
    """All honest, under a screen so strict that it drops honest updates (norms within 0.1% of the median):
    each one dropped is replayed after its close and passes; nobody is flagged."""
    strict = dataclasses.replace(ACFG, screen_band=(0.999, 1.001))
    sim = simulate(tmp_path, corpus, rounds=3, audit=1e-9, probation=0, acfg=strict)
    assert not sim.agg.identities.revoked
    dropped = sum(n for (o, _), n in sim.agg.block(0).counters.items() if o == Outcome.DROPPED.value)
    assert dropped >= 2
    assert sim.agg.counters[("later_audits", "dropped")] == dropped == len(sim.verdicts)
    assert all(v.passed for v in sim.verdicts)


def test_draws_follow_the_secret_and_the_share():
    ids = [f"{i:032x}" for i in range(4000)]
    a = [secret_draw(b"k" * 32, u) < 0.25 for u in ids]
    b = [secret_draw(b"j" * 32, u) < 0.25 for u in ids]
    assert 0.22 < sum(a) / len(a) < 0.28
    assert a != b  # another secret, other draws: a worker without the key cannot tell which are checked
    assert sum(x and y for x, y in zip(a, b)) / len(a) < 0.09  # ≈ 0.0625 if independent


def joined_worker(tmp_path: Path, corpus: bytes) -> tuple[Simulation, BlockWorker]:
    """A swarm (audits on, no probation) and one of its workers, joined and 4 steps into its first round."""
    sim = Simulation(CFG, TC, ACFG, SimConfig(rounds=1, replicas=3, steps_per_round=4, audit=0.5, probation=0),
                     corpus, tmp_path, device=torch.device("cpu"))
    w = sim.replicas[0].worker
    w.start()
    w.train_steps(4)
    return sim, w


def test_a_broken_chain_is_refused_and_revokes(tmp_path, corpus):
    sim, w = joined_worker(tmp_path, corpus)
    header, raw = w.make_update()
    forged = dataclasses.replace(header, claim=dataclasses.replace(header.claim, optimizer_start="ab" * 32))
    with pytest.raises(MalformedInput, match="another optimizer state"):
        sim.agg.push(forged, iter([]))
    assert sim.agg.identities.is_revoked(w.wcfg.worker_id)


def test_the_update_that_ended_the_chain_may_be_pushed_again(tmp_path, corpus):
    """A refusal (stale, say) is not remembered, but the chain moved past the refused update: its re-push
    after a reconnect is the same claim again, not a break (an honest worker was once revoked for it)."""
    sim, w = joined_worker(tmp_path, corpus)
    header, _ = w.make_update()
    audits = sim.agg.audits
    audits.check_chain(header)
    audits.advance(header)  # as after a refusal
    audits.check_chain(header)  # the same update again: fine
    other = dataclasses.replace(header, update_id="f" * 32)  # another update from the same start: a break
    with pytest.raises(MalformedInput, match="another optimizer state"):
        audits.check_chain(other)
    lied = dataclasses.replace(header, claim=dataclasses.replace(header.claim, optimizer_end="cd" * 32))
    with pytest.raises(MalformedInput, match="another optimizer state"):
        audits.check_chain(lied)  # the same id with another claim is no re-push


def test_claims_state_fresh_starts_and_chain(tmp_path, corpus):
    _, w = joined_worker(tmp_path, corpus)
    first, _ = w.make_update()
    assert (first.claim.optimizer_start, first.claim.residual_start) == (EMPTY_STATE, EMPTY_STATE)
    assert first.claim.optimizer_end != EMPTY_STATE and first.claim.residual_end != EMPTY_STATE  # int8 leaves a residual
    w.train_steps(4)
    second, _ = w.make_update()
    assert second.claim.optimizer_start == first.claim.optimizer_end
    assert second.claim.residual_start == first.claim.residual_end
    assert Recipe.from_json(first.claim.recipe).threads == torch.get_num_threads()


def test_recipes_decide_exactness():
    here = Recipe.here(torch.device("cpu"), "fp32", error_feedback=True)
    assert here.exact_with(dataclasses.replace(here))
    assert not here.exact_with(dataclasses.replace(here, threads=here.threads + 1))
    assert not dataclasses.replace(here, device="cuda").exact_with(dataclasses.replace(here, device="cuda"))
    with pytest.raises(MalformedInput):
        Recipe.from_json('{"torch": 1}')


def test_audit_settings_are_checked():
    with pytest.raises(Exception, match="invalid audit settings"):
        AuditConfig(share=1.5)


def test_a_simulation_can_stop_at_the_catch_and_keeps_every_verdict(tmp_path, corpus):
    sim = Simulation(CFG, TC, ACFG, SimConfig(rounds=6, replicas=3, steps_per_round=4, audit=1.0, probation=0),
                     corpus, tmp_path, device=torch.device("cpu"), workers={"b0r2": Negating})
    sim.run(until=lambda: sim.agg.identities.is_revoked("b0r2"))
    last = sim.verdicts[-1]
    assert (last.header.worker_id, last.passed, last.reason) == ("b0r2", False, "delta")
    assert last.header.base_version == 0  # p = 1: its first update is drawn, and the run stops there
    assert all(v.passed for v in sim.verdicts[:-1])


class Crashing(BlockWorker):
    """Dies between its push and the upload of its start state (the soak's kill -9 found this window)."""

    def _send_state(self, header) -> None:  # type: ignore[no-untyped-def]
        pass


def test_a_worker_that_rejoins_without_a_drawn_state_is_on_probation_again_and_revoked_past_the_limit(tmp_path,
                                                                                                       corpus):
    acfg = dataclasses.replace(ACFG, audit=AuditConfig(abandon_limit=1))
    sim = Simulation(CFG, TC, acfg, SimConfig(rounds=1, replicas=1, steps_per_round=4, audit=1.0, probation=1),
                     corpus, tmp_path, device=torch.device("cpu"), workers={"b0r0": Crashing})

    def drawn_round_then_crash() -> None:
        w = Crashing(CFG, TC, sim.worker("b0r0").wcfg, sim.link, corpus, device=torch.device("cpu"))
        w.start()  # a (re)join: a fresh process
        for _ in range(2):  # the first round starts fresh (nothing to send); the second needs its state
            w.train_steps(4)
            header, raw = w.make_update()
            w.pushed(w.push(header, raw))
            sim.agg.run_audits()
            w.advance(sim.agg.block(0).info)

    drawn_round_then_crash()
    assert sim.agg.audits.waiting  # the second update's state never came
    drawn_round_then_crash()  # rejoined: forgiven once, back on probation
    assert not sim.agg.identities.is_revoked("b0r0")
    assert sim.agg.audits.counts[("abandoned", "rejoin")] == 1
    assert sim.agg.block(0).counters[(Outcome.PROBATION.value, "")] == 2  # its first update after the rejoin was held
    with pytest.raises(Forbidden, match="left audits without its state once too often"):
        drawn_round_then_crash()
    assert sim.agg.identities.is_revoked("b0r0")
