"""A cheating replica in a simulated swarm (lab/cheats.py, the simulator's `workers`
hook): the default aggregation drops its update, and the honest replicas' updates still count."""

from __future__ import annotations

import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.data.corpus import bundled
from btnode.model.config import ModelConfig
from btnode.sim.simulator import SimConfig, Simulation
from btnode.swarm.worker import BlockWorker
from btnode.codec.codecs import decode
from lab.cheats import ATTACKS, SLEEP, NegatedWorker, ZeroWorker, attack_workers
from btnode.train.config import TrainConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1, 8))
TC = TrainConfig(steps=6, batch=4, warmup=1)
CORPUS = bundled().train  # real text: honest updates agree in direction
H, ROUNDS = 3, 2


def swarm(tmp_path, cheat):
    # the screen alone: with audits (the default) the cheater's first update fails its probation replay
    # before the screen sees it (bench/cheats.py measures the shipped configuration)
    scfg = SimConfig(rounds=ROUNDS, replicas=3, steps_per_round=H, delays_s=(0.02,), delay_dist="fixed", audit=0.0)
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=1.0), claims=ClaimConfig(enforce=True))  # the default rule
    sim = Simulation(CFG, TC, acfg, scfg, CORPUS, tmp_path, device=torch.device("cpu"), workers={"b0r2": cheat})
    return sim, sim.run()


def test_the_hook_hosts_the_cheater_and_the_default_rule_drops_its_negated_update(tmp_path):
    sim, res = swarm(tmp_path, NegatedWorker)
    assert isinstance(sim.worker("b0r2"), NegatedWorker) and type(sim.worker("b0r0")) is BlockWorker
    agg = sim.agg.block(0)
    assert res.versions == {0: ROUNDS}
    assert [s.dropped for s in agg.recent] == [(("b0r2", "direction_at_close"),)] * ROUNDS
    assert agg.counters[("dropped", "direction_at_close")] == ROUNDS
    assert agg.counters[("applied", "")] == 2 * ROUNDS  # the honest two, every round
    assert all(s.info.accepted == 2 and s.info.rejected == 1 for s in agg.recent)


def test_a_zero_update_is_dropped_by_the_norm_band(tmp_path):
    sim, _ = swarm(tmp_path, ZeroWorker)
    assert [s.dropped for s in sim.agg.block(0).recent] == [(("b0r2", "norm_at_close"),)] * ROUNDS


def test_the_sybil_s_three_identities_push_the_same_negated_mean_of_their_honest_deltas(tmp_path, monkeypatch):
    ids = ("b0r2", "b0r3", "b0r4")
    pushed: dict[str, dict[str, bytes]] = {}
    real_push = BlockWorker.push

    def spy(self, header, raw):
        pushed[header.worker_id] = raw
        return real_push(self, header, raw)

    monkeypatch.setattr(BlockWorker, "push", spy)
    scfg = SimConfig(rounds=1, replicas=5, steps_per_round=H, delays_s=(0.02,), delay_dist="fixed")
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=1.0))
    sim = Simulation(CFG, TC, acfg, scfg, CORPUS, tmp_path, device=torch.device("cpu"),
                     workers=attack_workers("sybil3", ids))
    sim.run()
    attacker = sim.worker("b0r2").attacker
    assert all(sim.worker(w).attacker is attacker for w in ids) and type(sim.worker("b0r0")) is BlockWorker
    honest = attacker.honest[0]
    assert sorted(honest) == list(ids)
    assert pushed["b0r2"] == pushed["b0r3"] == pushed["b0r4"] != pushed["b0r0"]
    w = sim.worker("b0r2")
    sent = {n: decode(w.wcfg.codec, pushed["b0r2"][n], w.spec[n]) for n in w.spec}
    for n, t in sent.items():
        want = -sum(d[n] for d in honest.values()) / 3
        assert torch.allclose(t, want, atol=want.abs().max().item() / 100)  # int8: one step of 1/127 of the max


def test_a_sleeper_pushes_its_honest_update_before_it_turns():
    attack = ATTACKS["sleeper_sybil3"]
    assert not attack.turned(SLEEP - 1) and attack.turned(SLEEP) and attack.turned(SLEEP + 3)
    once = ATTACKS["flip_once_sybil3"]
    assert [once.turned(v) for v in range(SLEEP - 1, SLEEP + 2)] == [False, True, False]
