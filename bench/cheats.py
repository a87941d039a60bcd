"""Cheats benchmark (issue #23): a simulated swarm (btnode/sim: the daemon's own aggregator and
workers, int8 updates through the real frame checks, claims checked) of one block × 3 replicas,
in which one replica cheats (btnode/testing/cheats.py), one cheat at a time. For each cheat: the
first round its update was refused or dropped, and by what, and the held-out CE after R rounds
against the all-honest swarm with the same seeds and the same aggregation rule.

    .venv/bin/python -m bench.cheats                    # every rule, the shipped one first (~10 min on 2 cores)
    .venv/bin/python -m bench.cheats --rules screened   # the shipped rule only
    .venv/bin/python -m bench.cheats --quick            # a smoke run

Mode `default` is the swarm as shipped. Audits (a share of updates re-trained and compared) will
add mode `audit`: `MODES` maps a mode to what it changes in the simulation.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import statistics
import tempfile
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from bench.flags import BenchParser
from bench.report import publish, table
from btnode.aggregate.averaging import ROBUST_MODES, OuterConfig
from btnode.aggregate.block import AggregatorConfig
from btnode.aggregate.claims import ClaimConfig
from btnode.aggregate.rounds import RoundConfig
from btnode.codec.frames import Frame
from btnode.data.corpus import bundled
from btnode.errors import PeerInputError
from btnode.evaluation.metrics import swarm_ce
from btnode.model.config import ModelConfig
from btnode.protocol import Judgement, Outcome, PushHeader
from btnode.sim.link import LocalLink
from btnode.sim.simulator import SimConfig, Simulation
from btnode.swarm.worker import BlockWorker
from btnode.testing.cheats import CHEATS, cheat_factory
from btnode.train.config import TrainConfig

SHAPE = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1, 8))
CHEATER, VICTIM = "b0r2", "b0r0"
STEP_S = 0.1
# mode → the SimConfig fields it sets. The audit mode goes here: "audit": {"audit": P} from an --audit P
# option, with main() measuring both modes (its rows, false_positives and audit_cost_share).
MODES: dict[str, dict] = {"default": {}}
_corpus = functools.cache(bundled)  # once per process
RULES = (OuterConfig.robust, *(r for r in ROBUST_MODES if r != OuterConfig.robust))  # the shipped rule first


@dataclass(frozen=True)
class Settings:
    """What every swarm of a run shares (small and picklable: it goes to the worker processes)."""

    rounds: int
    h: int
    batch: int
    windows: int

    @property
    def tc(self) -> TrainConfig:
        total = self.rounds * self.h
        return TrainConfig(batch=self.batch, steps=total, warmup=min(20, max(1, total // 10)))  # as `btnode simulate`


@dataclass
class Tap:
    """The cheater's link: the shared LocalLink, with the answer to each of its pushes recorded as
    (round, worker id, outcome, reason) (a refusal's reason is the PeerInputError's label)."""

    link: LocalLink
    answers: list[tuple[int, str, str, str]] = field(default_factory=list)

    def __getattr__(self, name: str) -> object:
        return getattr(self.link, name)

    def push(self, header: PushHeader, frames: Iterable[Frame]) -> Judgement:
        try:
            j = self.link.push(header, frames)
        except PeerInputError as exc:
            self.answers.append((header.base_version, header.worker_id, Outcome.REJECTED.value, exc.reason))
            raise
        self.answers.append((header.base_version, header.worker_id, j.outcome.value, j.reason))
        return j


def run_swarm(rule: str, cheat: str | None, seed: int, mode: str, args: Settings) -> dict:
    """One simulated swarm; returns its CE and, with a cheat, when and how the cheater was caught."""
    torch.set_num_threads(1)  # a tiny model: more threads only contend (measured 25× slower with 2 on 2 cores)
    tc, corpus = args.tc, _corpus()
    sim: Simulation | None = None
    tap: Tap | None = None

    def cheater(cfg, tc_, wcfg, link, corpus, **kw) -> BlockWorker:  # type: ignore[no-untyped-def]
        nonlocal tap
        tap = Tap(link)
        make = cheat_factory(cheat, victim=lambda: sim.worker(VICTIM))  # type: ignore[arg-type,union-attr]
        return make(cfg, tc_, wcfg, tap, corpus, **kw)

    scfg = SimConfig(rounds=args.rounds, replicas=3, steps_per_round=args.h, step_time_s=STEP_S, seed=seed,
                     **MODES[mode])
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=1.5 * args.h * STEP_S), outer=OuterConfig(robust=rule),
                            claims=ClaimConfig.of(tc, args.h, enforce=True), history=args.rounds)  # every round's drops
    with tempfile.TemporaryDirectory(prefix="btnode-cheats-") as tmp:
        sim = Simulation(SHAPE, replace(tc, seed=seed), acfg, scfg, corpus.train, Path(tmp),
                         device=torch.device("cpu"), workers={CHEATER: cheater} if cheat else None)
        res = sim.run()
        ce = swarm_ce(sim.blocks(), corpus.test, args.windows, torch.device("cpu"))
        dropped = [(s.info.base_version, wid, why) for s in sim.agg.block(0).recent for wid, why in s.dropped]
    out = {"cheat": cheat, "rule": rule, "mode": mode, "seed": seed, "ce": ce, "versions": res.versions[0],
           "outcomes": res.outcomes, "honest_dropped": sum(not wid.startswith(CHEATER) for _, wid, _ in dropped)}
    if tap is not None:
        # (round, 0 on arrival / 1 at close, reason): within a round, a refusal comes before a drop
        caught = sorted([(r, 0, why) for r, wid, outcome, why in tap.answers if outcome != Outcome.ACCEPTED.value] +
                        [(r, 1, why) for r, wid, why in dropped if wid.startswith(CHEATER)])
        out.update(caught_round=caught[0][0] if caught else None, mechanism=caught[0][2] if caught else None,
                   caught_rounds=len({r for r, *_ in caught}), pushes=len({r for r, *_ in tap.answers}))
    return out


def measure(rule: str, mode: str, args: argparse.Namespace, pool: ProcessPoolExecutor) -> dict:
    """The honest CE per seed, and each cheat's runs, for one rule and mode."""
    settings = Settings(args.rounds, args.h, args.batch, args.windows)
    seeds = range(args.seeds)
    honest_runs = {s: pool.submit(run_swarm, rule, None, s, mode, settings) for s in seeds}
    cheat_runs = {c: [pool.submit(run_swarm, rule, c, s, mode, settings) for s in seeds] for c in args.cheats}
    honest_done = {s: f.result() for s, f in honest_runs.items()}
    honest = {s: r["ce"] for s, r in honest_done.items()}
    dropped = sum(r["honest_dropped"] for r in honest_done.values())
    print(f"[cheats] {rule}: honest CE {honest}, honest updates dropped {dropped}", flush=True)
    rows = []
    for cheat, futures in cheat_runs.items():
        runs = [f.result() for f in futures]
        caught = [r["caught_round"] for r in runs if r["caught_round"] is not None]
        row = {"cheat": cheat, "mode": mode, "rule": rule, "seeds": list(seeds),
               "caught_round": min(caught) if caught else None,
               "mechanism": next((r["mechanism"] for r in runs if r["mechanism"]), None),
               "caught_rounds": [r["caught_rounds"] for r in runs], "pushes": [r["pushes"] for r in runs],
               "delta_ce": statistics.mean(r["ce"] - honest[r["seed"]] for r in runs),
               "delta_ce_runs": [r["ce"] - honest[r["seed"]] for r in runs]}
        rows.append(row)
        print(f"[cheats] {rule} {cheat}: ΔCE {row['delta_ce']:+.4f}, caught round {row['caught_round']} "
              f"({row['mechanism']}), caught in {row['caught_rounds']} of {row['pushes']} rounds", flush=True)
    return {"honest_ce": list(honest.values()), "honest_dropped": dropped, "rows": rows}


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("cheats")
    ap.rounds(rounds=10, h=20, batch=16)
    ap.windows(64)
    ap.seeds(2, help="seeds (model init, data, delays) per swarm; each cheat is compared with the honest swarm "
                     "of the same seed")
    ap.quick(rounds=2, h=3, batch=4, windows=8, seeds=1)
    ap.add_argument("--rules", nargs="*", default=list(RULES), choices=ROBUST_MODES,
                    help="aggregation rules to measure; the first gives the rows (default: the shipped "
                         f"{OuterConfig.robust!r}, then the other candidates)")
    ap.add_argument("--cheats", nargs="*", default=list(CHEATS), choices=list(CHEATS), help="cheats to run (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="swarms simulated at once (one process and one thread each)")
    args = ap.parse_args()
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        candidates = {rule: measure(rule, "default", args, pool) for rule in args.rules}
    shipped = candidates[args.rules[0]]
    out = {"rule": args.rules[0], "rows": shipped["rows"], "honest_ce": shipped["honest_ce"],
           "false_positives": None, "audit_cost_share": None,  # the audit mode's, once it runs
           "candidates": {rule: {"honest_ce": c["honest_ce"], "honest_dropped": c["honest_dropped"],
                                 "delta_ce": {r["cheat"]: r["delta_ce"] for r in c["rows"]},
                                 "caught": {r["cheat"]: r["mechanism"] for r in c["rows"]}}
                          for rule, c in candidates.items()},
           "rounds": args.rounds, "h": args.h, "batch": args.batch, "windows": args.windows, "seeds": args.seeds,
           "model": SHAPE.to_dict(), "quick": args.quick}
    publish("cheats", out, render, out=args.results)


def _sybil_note(out: dict) -> str:
    sybil = next((r for r in out["rows"] if r["cheat"] == "sybil"), None)
    if sybil is None or sybil["mechanism"] is not None:
        return "The sybil pushes under ids that never joined."
    return "The sybil pushes under ids that never joined: accepted here (the aggregator does not refuse them yet)."


def render(out: dict) -> str:
    rows = [(r["cheat"], r["mode"], "—" if r["caught_round"] is None else r["caught_round"], r["mechanism"] or "—",
             f"{r['delta_ce']:+.4f}", " / ".join(f"{d:+.4f}" for d in r["delta_ce_runs"]))
            for r in out["rows"]]
    rules = list(out["candidates"])
    cand = [(cheat, *(f"{out['candidates'][rule]['delta_ce'].get(cheat, float('nan')):+.4f}" for rule in rules))
            for cheat in out["candidates"][rules[0]]["delta_ce"]]
    honest = [("honest CE", *(f"{statistics.mean(out['candidates'][rule]['honest_ce']):.4f}" for rule in rules)),
              ("honest updates dropped", *(str(out["candidates"][rule]["honest_dropped"]) for rule in rules))]
    return "\n".join([
        "## Cheats: one cheating replica in three (`bench/cheats.py`)", "",
        f"Command: `.venv/bin/python -m bench.cheats` (2 cores). One block × 3 replicas, d=32, L=1, N=32, "
        f"R = {out['rounds']} rounds of H = {out['h']} (batch {out['batch']}, int8 updates, claims checked), "
        f"aggregation `{out['rule']}`; replica {CHEATER} cheats (btnode/testing/cheats.py). ΔCE: SCE-1 at K = 1 on "
        f"{out['windows']} held-out windows against the all-honest swarm of the same seed (nats/byte), mean over "
        f"seeds {', '.join(map(str, range(out['seeds'])))}. Caught: the first round an update of the cheater was "
        "refused or dropped, and by what. A cheat dropped in every round leaves two honest replicas: its per-seed "
        f"ΔCE is what one replica's work is worth here, the table's noise floor. {_sybil_note(out)}", "",
        *table(["cheat", "mode", "caught round", "mechanism", "ΔCE", "per seed"], rows, "llrlrl"), "",
        "Every candidate rule (`--robust`), same command: the honest swarm's CE (mean over seeds), how many honest "
        "updates its screen dropped, and each cheat's ΔCE:", "",
        *table(["cheat", *rules], honest + cand, "l" + "r" * len(rules))])


if __name__ == "__main__":
    main()
