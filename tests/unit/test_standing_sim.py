"""The Sybil of issue #38 in a simulated open swarm (btnode/sim): 2 established honest identities and 3
fresh ones of one attacker, which train honestly through probation and then push one identical update
against the honest mean. Standing (aggregate/trust/standing.py) keeps their weight at their verified
work, so they never hold the reference, and no honest update is dropped."""

from __future__ import annotations

import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.trust.audit import AuditConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.data.corpus import bundled
from btnode.sim.simulator import SimConfig, Simulation
from btnode.train.config import TrainConfig
from lab.sybil_bound import ATTACKERS, CFG, HONEST, SleeperSybil, establish

H, ROUNDS, PROBATION = 3, 5, 2
TC = TrainConfig(steps=H * ROUNDS, batch=4, warmup=1)


def test_three_fresh_identities_pushing_one_update_never_outweigh_two_established_ones(tmp_path):
    SleeperSybil.forged, SleeperSybil.sent, SleeperSybil.probation = {}, set(), PROBATION
    scfg = SimConfig(rounds=ROUNDS, replicas=5, steps_per_round=H, delays_s=(0.02,), delay_dist="fixed",
                     audit=0.25, probation=PROBATION)
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=1.0), claims=ClaimConfig(enforce=True), open=True,
                            audit=AuditConfig(share=0.25, probation=PROBATION))
    sim = Simulation(CFG, TC, acfg, scfg, bundled().train, tmp_path, device=torch.device("cpu"),
                     workers={w: SleeperSybil for w in ATTACKERS})
    establish(sim)  # the honest identities: verified work from before this run
    sim.run()
    agg = sim.agg.block(0)
    dropped = [(s.info.base_version, w, why) for s in agg.recent for w, why in s.dropped]
    assert not [d for d in dropped if d[1] in HONEST]  # no honest update dropped, in any round
    assert SleeperSybil.sent and {w for _, w, _ in dropped} <= set(ATTACKERS)  # it cheated: dropped where not caught
    included = {i for s in agg.recent for i in s.info.included}
    assert not included & SleeperSybil.sent  # no version holds a forged update
    assert all(s.info.accepted >= 2 for s in agg.recent)
    # its verified work: its own audits passed, and (delegated verification) the honest replays it did for
    # others that upheld verdicts agreed with, each worth p of an audit; still under full standing
    audits = sim.agg.audits
    passed, total = audits.passed("b0r2")
    assert sim.agg.standing.factor("b0r0") == 1.0 and sim.agg.standing.verified("b0r2") == min(1.0, total / 8) < 1.0
    assert total - audits.records["b0r2"].verified <= 3
