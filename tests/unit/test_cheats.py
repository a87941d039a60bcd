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
from lab.cheats import NegatedWorker, ZeroWorker
from btnode.train.config import TrainConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1, 8))
TC = TrainConfig(steps=6, batch=4, warmup=1)
CORPUS = bundled().train  # real text: honest updates agree in direction
H, ROUNDS = 3, 2


def swarm(tmp_path, cheat):
    scfg = SimConfig(rounds=ROUNDS, replicas=3, steps_per_round=H, delays_s=(0.02,), delay_dist="fixed")
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
