"""The issue #38 Sybil against standing (aggregate/trust/standing.py), in the simulator: one attacker with 3 of
5 identities that train honestly through probation, then push one identical update against the honest mean,
beside 2 established honest identities, in an open swarm with replay audits. Prints, per seed, the final ΔCE
against the all-honest swarm, the honest updates dropped and the forged ones applied, with standing and
shared votes on and (`weighing` false) off. docs/security.md, "Standing and the Sybil bound".

    .venv/bin/python -m lab.sybil_bound            # H = 10, 8 rounds, p = 0.25, seeds 1-3 (~10 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from unittest import mock

import torch

import btnode.aggregate.round.screen as screen_module
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.trust.audit import AuditConfig, Verdict
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.standing import Standing
from btnode.codec.codecs import Codec, decode
from btnode.codec.frames import encode_raw
from btnode.data.corpus import bundled
from btnode.evaluation.metrics import swarm_ce
from btnode.model.config import ModelConfig
from btnode.protocol import PushHeader
from btnode.sim.simulator import SimConfig, Simulation
from btnode.swarm.worker import BlockWorker
from btnode.train.config import TrainConfig

CFG = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1, 8))
HONEST, ATTACKERS = ("b0r0", "b0r1"), ("b0r2", "b0r3", "b0r4")
ESTABLISHED = 8  # audits the honest identities passed before the run


class SleeperSybil(BlockWorker):
    """Honest for its first `probation` pushes; then every id of the attacker pushes the same update: −Δ of
    the first of them to train that round (one attacker, one forged update, several identities)."""

    probation = 2
    forged: dict[int, dict[str, bytes]] = {}  # base version → the attacker's update of that round
    sent: set[str] = set()  # the update ids it pushed the forged update under

    def make_update(self) -> tuple[PushHeader, dict[str, bytes]]:
        header, raw = super().make_update()
        if self.stats.pushes >= self.probation:
            if header.base_version not in self.forged:
                delta = {n: decode(self.wcfg.codec, raw[n], self.spec[n]) for n in self.spec}
                self.forged[header.base_version] = encode_raw({n: -d for n, d in delta.items()}, self.wcfg.codec)
            raw = self.forged[header.base_version]
            self.sent.add(header.update_id)
        self._last_update = (header, raw)
        return self._last_update


def establish(sim: Simulation, n: int = ESTABLISHED) -> None:
    """The honest identities' verified work from before the run: n passed audits each."""
    assert sim.agg.audits is not None
    for w in HONEST:
        for i in range(n):
            sim.agg.audits.record(Verdict(PushHeader(worker_id=w, block=0, base_version=0, samples=0.0, loss=0.0,
                                                     codec=Codec.INT8, update_id=f"before-{i}"), True, "", "", 0.0,
                                          False, 0.0))


def run(seed: int, h: int, rounds: int, audit: float, *, cheat: bool, weighing: bool, tmp: Path) -> dict:
    SleeperSybil.forged, SleeperSybil.sent = {}, set()
    tc = TrainConfig(steps=h * rounds, batch=8, warmup=max(1, h * rounds // 10), seed=seed)
    scfg = SimConfig(rounds=rounds, replicas=5, steps_per_round=h, step_time_s=0.1, seed=seed, audit=audit,
                     probation=SleeperSybil.probation)
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=1.5 * h * 0.1), claims=ClaimConfig.of(tc, h, enforce=True),
                            open=True, audit=AuditConfig(share=audit, probation=SleeperSybil.probation), history=rounds)
    off = [mock.patch.object(screen_module, "votes", lambda w, near: list(w)),
           mock.patch.object(Standing, "factor", lambda self, w: 1.0)] if not weighing else []
    for p in off:
        p.start()
    try:
        sim = Simulation(CFG, tc, acfg, scfg, bundled().train, tmp, device=torch.device("cpu"),
                         workers={w: SleeperSybil for w in ATTACKERS} if cheat else None)
        establish(sim)
        sim.run()
    finally:
        for p in off:
            p.stop()
    recent = sim.agg.block(0).recent
    return {"ce": swarm_ce(sim.blocks(), bundled().test, 64, torch.device("cpu")),
            "honest_dropped": sum(w in HONEST for s in recent for w, _ in s.dropped),
            "forged_applied": len({i for s in recent for i in s.info.included} & SleeperSybil.sent),
            "revoked": [w for w in ATTACKERS if sim.agg.identities.is_revoked(w)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--h", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--audit", type=float, default=0.25)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()
    torch.set_num_threads(1)
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            base = run(seed, args.h, args.rounds, args.audit, cheat=False, weighing=True, tmp=Path(tmp))["ce"]
        for weighing in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                r = run(seed, args.h, args.rounds, args.audit, cheat=True, weighing=weighing, tmp=Path(tmp))
            print(json.dumps({"seed": seed, "weighing": weighing, "delta_ce": round(r.pop("ce") - base, 4), **r}),
                  flush=True)


if __name__ == "__main__":
    main()
