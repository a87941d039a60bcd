"""Drawn updates held until their verdict, and repairs (aggregate/round/repairs.py): a revoked sender's
updates taken back out of the kept rounds, exactly; in process with a fake clock, and in the simulator."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.sums.accumulate import Accumulator
from btnode.aggregate.sums.averaging import OuterConfig
from btnode.aggregate.trust.audit import AuditConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.codecs import Codec
from btnode.data.corpus import bundled
from btnode.protocol import Outcome, PushHeader
from btnode.sim.simulator import SimConfig, Simulation
from tests.unit.test_audit import CFG, TC, Negating

INIT = {"a": torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), "b": torch.randn(7)}
CLAIMS = ClaimConfig(batch=1, lr=1.0, steps_per_round=4, enforce=True)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(path, clock=None, **kw) -> BlockAggregator:
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=10.0), claims=CLAIMS, audit=AuditConfig(share=0.25), **kw)
    from btnode.store.versions import VersionStore
    return BlockAggregator(0, INIT, VersionStore(path, 0, keep=acfg.keep), acfg, clock=clock or Clock())


def header(worker: str, base: int) -> PushHeader:
    return PushHeader(worker_id=worker, block=0, base_version=base, samples=1.0, loss=1.0, codec=Codec.FP32,
                      update_id=f"{worker}-{base}", steps=(0,))


def honest(worker: str, r: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * r + ord(worker[0]))
    return {n: 0.3 + 0.1 * torch.randn(t.shape, generator=g) for n, t in INIT.items()}  # alike (cos ≈ 0.9), not copies


def test_a_drawn_update_is_held_until_its_verdict_and_the_round_waits_for_it(tmp_path):
    agg = make(tmp_path)
    for w in ("x", "y"):
        agg.register(w)
    assert agg.submit(header("x", 0), honest("x", 0)).outcome is Outcome.PENDING
    j = agg.submit(header("y", 0), honest("y", 0), hold=True, drawn=True)
    assert j.outcome is Outcome.PROBATION and j.reason.startswith("drawn for audit")
    assert agg.info.version == 0  # every replica pushed, but y's verdict is not in: no "all reported" close
    assert agg.counters[(Outcome.PROBATION.value, "drawn")] == 1
    assert agg.admit_held("y-0")  # its audit passed
    info = agg.current()[0]
    assert (info.version, info.accepted, info.closed_by) == (1, 2, "all_reported")
    assert set(info.included) == {"x-0", "y-0"}


def test_a_held_update_whose_verdict_fails_is_never_published(tmp_path):
    agg = make(tmp_path)
    for w in ("x", "y"):
        agg.register(w)
    agg.submit(header("x", 0), honest("x", 0))
    agg.submit(header("y", 0), {n: -t for n, t in honest("x", 0).items()}, hold=True, drawn=True)
    assert agg.drop("y", "audit_delta")  # its replay failed
    assert agg.counters[(Outcome.DROPPED.value, "audit_delta")] == 1
    agg.unregister("y")  # revoked: its stream closes
    info = agg.current()[0]
    assert (info.version, info.included) == (1, ("x-0",))


def test_a_round_closes_at_its_deadline_without_a_held_update_that_then_misses_it(tmp_path):
    clock = Clock()
    agg = make(tmp_path, clock)
    for w in ("x", "y"):
        agg.register(w)
    agg.submit(header("x", 0), honest("x", 0))
    agg.submit(header("y", 0), honest("y", 0), hold=True, drawn=True)
    clock.t += 10.0
    assert agg.tick().included == ("x-0",)  # the deadline does not wait for a verdict
    assert not agg.admit_held("y-0")  # passed, but its round is gone
    assert agg.counters[(Outcome.LATE.value, "audited_after_close")] == 1


def run(agg: BlockAggregator, rounds: int, workers: list[str], attackers: list[str], attack_rounds: range) -> None:
    for w in workers:
        agg.register(w)
    for r in range(rounds):
        if attackers and r == attack_rounds.start:
            for a in attackers:
                agg.register(a)
        if attackers and r == attack_rounds.stop:  # revoked after their rounds: their streams close, what they added is taken back
            for a in attackers:
                agg.unregister(a)
            assert agg.repair(lambda w: w in attackers) is not None
        senders = workers + (attackers if r in attack_rounds else [])
        for w in senders:
            # an attacker pushes against the honest course, each its own update (near-copies would share
            # one vote in the screen: round/screen.py), so that three of five still hold its median
            d = honest(w, r) if w in workers else {n: -t for n, t in honest(w, r).items()}
            assert agg.submit(header(w, r), d).outcome is Outcome.PENDING
        assert agg.info.version == r + 1


def means(agg: BlockAggregator) -> list[dict[str, torch.Tensor]]:
    return [agg.repairs.mean(r, r.kept) for r in agg.repairs.rounds]


@pytest.mark.parametrize("outer", [OuterConfig(robust="mean"), OuterConfig(lr=0.7, momentum=0.9, robust="mean")],
                         ids=["plain", "nesterov"])
def test_a_repair_takes_a_revoked_senders_updates_out_bit_for_bit(tmp_path, outer):
    """Attacked rounds 1 and 2 of 4, repaired before round 3: each repaired round's mean is bit for bit the
    mean without the attacker, the momentum the chain without it left, and θ the same within fp32 rounding."""
    workers = ["a", "b", "c"]
    ref = make(tmp_path / "ref", outer=outer)
    run(ref, 4, workers, [], range(0))
    agg = make(tmp_path / "attacked", outer=outer)
    run(agg, 4, workers, ["x"], range(1, 3))
    for got, want in zip(means(agg), means(ref), strict=True):
        assert all(torch.equal(got[n], want[n]) for n in INIT)
    # the mean of the honest updates alone, summed afresh: what each repaired round now holds
    fresh = Accumulator({n: tuple(t.shape) for n, t in INIT.items()}, "all", unit=agg.unit)
    for w in workers:
        fresh.add(honest(w, 1), 1.0)
    assert all(torch.equal(means(agg)[1][n], fresh.mean()[n]) for n in INIT)
    for n in agg.outer.buffers:
        assert torch.equal(agg.outer.buffers[n], ref.outer.buffers[n])
    params, want = agg.current()[1], ref.current()[1]
    for n in INIT:
        torch.testing.assert_close(params[n], want[n], rtol=0, atol=2e-6)
        assert not torch.allclose(params[n], INIT[n])
    assert agg.counters[("repaired", "")] == 1 and agg.repairs.count == 1


def test_a_repair_puts_back_honest_updates_the_screen_dropped_because_of_the_attackers(tmp_path):
    """Three identical ids of five set the screen's median: both honest updates are dropped at close. Once
    the three are revoked, the round is screened again without them and the honest pair is what counts."""
    workers, attackers = ["a", "b"], ["x", "y", "z"]
    agg = make(tmp_path / "attacked")
    run(agg, 1, workers, attackers, range(0, 1))
    first = agg.repairs.rounds[0]
    assert {u.worker_id for u in first.kept} == set(attackers)  # what the attack made of round 0
    for a in attackers:
        agg.unregister(a)
    fix = agg.repair(lambda w: w in attackers)
    assert sorted(fix.restored) == workers and sorted(set(fix.removed)) == attackers
    assert {u.worker_id for u in first.kept} == {"a", "b"} and not first.dropped
    for w in workers:
        agg.submit(header(w, 1), honest(w, 1))
    ref = make(tmp_path / "ref")
    run(ref, 2, workers, [], range(0))
    assert agg.info.version == ref.info.version == 2
    for n in INIT:
        torch.testing.assert_close(agg.current()[1][n], ref.current()[1][n], rtol=0, atol=2e-6)


class Sleeper(Negating):
    """Honest through probation; from round 4 on it pushes its delta negated, with the honest claims."""

    def _encode(self) -> dict[str, bytes]:
        if self.info is not None and self.info.version >= 4:
            return super()._encode()
        return super(Negating, self)._encode()


def test_a_three_id_sleeper_is_revoked_and_its_rounds_repaired(tmp_path):
    corpus = bundled().train.read(0, 400_000)
    acfg = AggregatorConfig(claims=ClaimConfig(enforce=True))
    sleepers = ("b0r2", "b0r3", "b0r4")
    sim = Simulation(CFG, TC, acfg, SimConfig(rounds=10, replicas=5, steps_per_round=4, audit=0.25, probation=2,
                                              seed=3, codec=Codec.INT8), corpus, tmp_path,
                     device=torch.device("cpu"), workers=dict.fromkeys(sleepers, Sleeper))
    sim.run()
    revoked = {w for w in sim.agg.identities.revoked}
    assert revoked == set(sleepers)  # one caught by its draw, the others as suspects; no honest one
    assert sim.agg.counters[("repairs", "delta")] >= 1
    block = sim.agg.block(0)
    assert all(u.worker_id not in sleepers for r in block.repairs.rounds for u in r.kept)
    failed = [v for v in sim.verdicts if not v.passed]
    assert {v.header.worker_id for v in failed} == set(sleepers)
    assert all(v.header.base_version >= 4 for v in failed)
    assert dataclasses.asdict(sim.agg.acfg.audit)["window"] == 4
