"""The Sybil of issue #38 in a simulated open swarm (btnode/sim): 2 established honest identities and 3
fresh ones of one attacker, which train honestly through probation and then push one identical update
against the honest mean. Standing (aggregate/trust/standing.py) keeps their weight at their verified
work, so they never hold the reference, and no honest update is dropped."""

from __future__ import annotations

import torch

from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.trust.audit import AuditConfig, Verdict
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.data.corpus import bundled
from btnode.model.config import ModelConfig
from btnode.protocol import PushHeader
from btnode.sim.simulator import SimConfig, Simulation
from btnode.swarm.worker import BlockWorker
from btnode.codec.codecs import Codec, decode
from btnode.codec.frames import encode_raw
from btnode.train.config import TrainConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1, 8))
H, ROUNDS, PROBATION = 3, 5, 2
TC = TrainConfig(steps=H * ROUNDS, batch=4, warmup=1)
HONEST, ATTACKERS = ("b0r0", "b0r1"), ("b0r2", "b0r3", "b0r4")


class SleeperSybil(BlockWorker):
    """Honest for its first PROBATION pushes; then every id of the attacker pushes the same update: −Δ of
    the first of them to train that round (one attacker, one forged update, several identities)."""

    forged: dict[int, dict[str, bytes]] = {}  # base version → the attacker's update of that round
    sent: set[str] = set()  # the update ids it pushed the forged update under

    def make_update(self):
        header, raw = super().make_update()
        if self.stats.pushes >= PROBATION:
            if header.base_version not in self.forged:
                delta = {n: decode(self.wcfg.codec, raw[n], self.spec[n]) for n in self.spec}
                self.forged[header.base_version] = encode_raw({n: -d for n, d in delta.items()}, self.wcfg.codec)
            raw = self.forged[header.base_version]
            self.sent.add(header.update_id)
        self._last_update = (header, raw)
        return self._last_update


def test_three_fresh_identities_pushing_one_update_never_outweigh_two_established_ones(tmp_path):
    SleeperSybil.forged = {}
    scfg = SimConfig(rounds=ROUNDS, replicas=5, steps_per_round=H, delays_s=(0.02,), delay_dist="fixed",
                     audit=0.25, probation=PROBATION)
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=1.0), claims=ClaimConfig(enforce=True), open=True,
                            audit=AuditConfig(share=0.25, probation=PROBATION))
    sim = Simulation(CFG, TC, acfg, scfg, bundled().train, tmp_path, device=torch.device("cpu"),
                     workers={w: SleeperSybil for w in ATTACKERS})
    for w in HONEST:  # established: verified work from before this run
        for i in range(8):
            sim.agg.audits.record(Verdict(PushHeader(worker_id=w, block=0, base_version=0, samples=0.0, loss=0.0,
                                                     codec=Codec.INT8, update_id=f"before-{i}"),
                                          True, "", "", 0.0, False, 0.0))
    sim.run()
    agg = sim.agg.block(0)
    dropped = [(s.info.base_version, w, why) for s in agg.recent for w, why in s.dropped]
    assert not [d for d in dropped if d[1] in HONEST]  # no honest update dropped, in any round
    assert SleeperSybil.sent and {w for _, w, _ in dropped} <= set(ATTACKERS)  # it cheated: dropped where not caught
    included = {i for s in agg.recent for i in s.info.included}
    assert not included & SleeperSybil.sent  # no version holds a forged update
    assert all(s.info.accepted >= 2 for s in agg.recent)
    assert sim.agg.standing.factor("b0r0") == 1.0 and sim.agg.standing.verified("b0r2") <= 3 / 8
