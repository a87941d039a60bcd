"""Delegated verification in the simulator (aggregate/trust/delegate.py, swarm/verify.py): the daemon's
own SwarmAggregator and BlockWorkers in process. Workers replay each other's drawn rounds and attest
digests; the aggregator referees disputes by one step (or one encode), replays a spot share itself,
and rechecks a revoked author's passed updates."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.delegate import DelegationConfig
from btnode.data.corpus import bundled
from btnode.model.config import ModelConfig
from btnode.sim.simulator import SimConfig, Simulation
from btnode.train.config import TrainConfig
from lab.cheats import AccusingWorker, NegatedWorker, verifier_workers

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1,))
TC = TrainConfig(batch=4, steps=200, warmup=5)


class LateNegated(NegatedWorker):
    """Honest in round 0 (when nobody's recipe is known yet and the aggregator replays), −Δ after."""

    def forge(self, delta):  # type: ignore[no-untyped-def]
        return super().forge(delta) if self.info is not None and self.info.version >= 1 else delta


def simulate(tmp_path: Path, corpus: bytes, *, workers: dict | None = None, replicas: int = 4, rounds: int = 3,
             audit: float = 1.0, seed: int = 0, **delegation: object) -> Simulation:
    acfg = AggregatorConfig(claims=ClaimConfig(enforce=True), delegation=DelegationConfig(**delegation))
    sim = Simulation(CFG, TC, acfg, SimConfig(rounds=rounds, replicas=replicas, steps_per_round=4, audit=audit,
                                              probation=0, seed=seed), corpus, tmp_path, device=torch.device("cpu"),
                     workers=workers)
    sim.run()
    return sim


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return bundled().train.read(0, 400_000)


def verified(sim: Simulation) -> dict[str, int]:
    return {r.worker.wcfg.worker_id: r.worker.stats.verified for r in sim.replicas}


def test_honest_workers_verify_each_other_and_agree_with_the_aggregators_own_replays(tmp_path, corpus):
    """Every update drawn (p = 1) and every delegated one replayed by the aggregator too (spot = 1): the
    verifiers' digests equal the push's and the aggregator's verdict, bit for bit, each time."""
    sim = simulate(tmp_path, corpus, spot=1.0, redundancy=0.5)
    d = sim.agg.delegated
    assert d is not None and d.counts["tasks"] >= 6 and d.counts["spot"] == d.counts["tasks"]
    assert not sim.agg.identities.revoked and all(v.passed for v in sim.verdicts)
    assert sum(verified(sim).values()) >= d.counts["tasks"]  # each task attested by its verifier(s)
    assert not d.tasks and not d._offenders  # every task decided, no verifier contradicted


def test_without_spot_checks_the_aggregator_replays_only_what_it_cannot_delegate(tmp_path, corpus):
    sim = simulate(tmp_path, corpus, spot=0.0, redundancy=0.0)
    d = sim.agg.delegated
    assert d is not None and d.counts["tasks"] >= 6 and "disputes" not in d.counts
    # the first pushes waited for verifiers whose recipes are known: the aggregator replayed nothing
    assert "local" not in d.counts and sim.agg.audits.seconds == 0.0
    assert d.referee_seconds == 0.0 and not sim.agg.identities.revoked
    assert all(v.passed for v in sim.verdicts)


def test_an_accusing_verifier_loses_its_dispute_and_is_revoked(tmp_path, corpus):
    """It replays honestly and attests another digest: the traces agree on every step, so the referee
    encodes the final state once (not a replay of H steps) and the accuser is revoked, the author upheld."""
    sim = simulate(tmp_path, corpus, workers={"b0r3": AccusingWorker}, spot=0.0, redundancy=0.0, rounds=4)
    d = sim.agg.delegated
    assert sim.agg.identities.is_revoked("b0r3") and set(sim.agg.identities.revoked) == {"b0r3"}
    assert d.counts["disputes"] >= 1 and "local_after_dispute" not in d.counts
    assert sim.agg.counters[("revoked", "verifier")] == 1
    assert all(v.passed for v in sim.verdicts)  # no honest author failed


def test_a_cheat_is_caught_by_an_honest_verifier_through_the_referee(tmp_path, corpus):
    """A negated update attested against by its verifier: the author's trace (an honest replay of its
    round) agrees with the verifier's on every step, the encode of the final state is the verifier's
    digest, and the author is revoked, at a referee cost of one encode; no verifier is flagged."""
    sim = simulate(tmp_path, corpus, workers={"b0r3": LateNegated}, spot=0.0, redundancy=0.0)
    d = sim.agg.delegated
    assert sim.agg.identities.is_revoked("b0r3") and set(sim.agg.identities.revoked) == {"b0r3"}
    assert [v.header.worker_id for v in sim.verdicts if not v.passed] == ["b0r3"]
    assert d.counts["disputes"] == 1 and "local_after_dispute" not in d.counts
    assert 0 < d.referee_seconds < sum(d.work.values()) / d.counts["tasks"]  # one encode, less than a replay


def test_a_verifier_that_vouches_for_its_forger_is_revoked_with_it(tmp_path, corpus):
    """Two verifiers per update (redundancy 1): when the ring's verifier is drawn for its forger, an
    honest second one disagrees, and the referee (or the recheck of the forger's passed updates once it
    is revoked) finds the vouch. The seeds are tried in order until one draws the vouch; honest workers
    are never flagged."""
    for seed in range(6):
        workers = verifier_workers("verifier_vouching", ["b0r3", "b0r4"])  # b0r3 vouches for b0r4
        sim = simulate(tmp_path / str(seed), corpus, workers={"b0r3": workers["b0r3"], "b0r4": LateRing(workers)},
                       replicas=5, spot=0.0, redundancy=1.0, rounds=4, seed=seed)
        assert sim.agg.identities.is_revoked("b0r4") and set(sim.agg.identities.revoked) <= {"b0r3", "b0r4"}
        if sim.worker("b0r3").ring.vouched:
            assert sim.agg.identities.is_revoked("b0r3") and sim.agg.counters[("revoked", "verifier")] == 1
            return
    pytest.fail("no seed of 6 drew the vouching verifier for its forger")


def LateRing(workers: dict):  # type: ignore[no-untyped-def]
    """The ring's forger, honest in round 0 (so that its forged rounds are delegated)."""
    make = workers["b0r4"]

    def build(*args, **kwargs):  # type: ignore[no-untyped-def]
        w = make(*args, **kwargs)
        w.forge = lambda delta, w=w: ({n: -d for n, d in delta.items()} if w.info is not None and w.info.version >= 1
                                      else delta)
        return w
    return build


def test_a_swarm_too_small_to_delegate_replays_at_the_aggregator(tmp_path, corpus):
    sim = simulate(tmp_path, corpus, replicas=3, min_workers=4)
    d = sim.agg.delegated
    assert d is not None and "tasks" not in d.counts and d.counts["local"] == len(sim.verdicts)
    assert all(v.passed for v in sim.verdicts) and sum(verified(sim).values()) == 0


def test_delegation_settings_are_checked():
    with pytest.raises(Exception, match="invalid delegation"):
        DelegationConfig(redundancy=1.5)
    assert not DelegationConfig(min_workers=0).on
    assert dataclasses.replace(DelegationConfig(), spot=0.5).spot == 0.5
