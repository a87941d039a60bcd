"""Cheats benchmark (issue #23): a simulated swarm (btnode/sim: the daemon's own aggregator and
workers, int8 updates through the real frame checks, claims checked) of one block × 3 replicas,
in which one replica cheats (lab/cheats.py), one cheat at a time. For each cheat: the
first round its update was refused or dropped, and by what, and the held-out CE after R rounds
against the all-honest swarm with the same seeds and the same aggregation rule.

    .venv/bin/python -m bench.cheats                    # every rule, the shipped one first (~10 min on 2 cores)
    .venv/bin/python -m bench.cheats --rules screened   # the shipped rule only
    .venv/bin/python -m bench.cheats --quick            # a smoke run

Mode `default` is the swarm as shipped. Mode `audit` adds replay audits (aggregate/trust/audit.py): the
aggregator replays a secretly drawn share P of updates (`--audit`, 0.25) and every update of a new
worker id until it has passed `--probation` (2) audits. Its rows say when the cheater's first failed
audit (or refusal) came; `draws` measures, over `--draw-seeds` (20) seeded swarms without probation,
how many rounds a cheater that cheats every round survives the draws alone (the situation of a worker
that turns after its probation); `audit_cost_share` is the replays' time over the honest workers'
training time in the honest audited swarms, `false_positives` the failed audits of honest workers there.
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
from bench.runs import Metric
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.sums.averaging import ROBUST_MODES, OuterConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.codec.frames import Frame
from btnode.data.corpus import bundled
from btnode.errors import PeerInputError
from btnode.evaluation.metrics import swarm_ce
from btnode.model.config import ModelConfig
from btnode.protocol import Judgement, Outcome, PushHeader
from btnode.sim.link import LocalLink
from btnode.sim.simulator import SimConfig, Simulation
from btnode.swarm.worker import BlockWorker
from btnode.train.config import TrainConfig
from lab.cheats import CHEATS, cheat_factory

SHAPE = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1, 8))
CHEATER, VICTIM = "b0r2", "b0r0"
STEP_S = 0.1
MODES = ("default", "audit")
DRAWN = "audit_"  # the mechanism of a failed audit: audit_<reason> (btnode.aggregate.service._punish)
NOT_CAUGHT = {Outcome.PENDING.value, Outcome.ACCEPTED.value, Outcome.PROBATION.value}  # answers that are not a refusal
_corpus = functools.cache(bundled)  # once per process
RULES = (OuterConfig.robust, *(r for r in ROBUST_MODES if r != OuterConfig.robust))  # the shipped rule first


@dataclass(frozen=True)
class Settings:
    """What every swarm of a run shares (small and picklable: it goes to the worker processes)."""

    rounds: int
    h: int
    batch: int
    windows: int
    audit: float = 0.0  # mode audit: the share drawn
    probation: int = 0  # mode audit: audits a new worker must pass first

    def mode(self, mode: str) -> dict:
        """The SimConfig fields a mode sets."""
        return {"audit": self.audit, "probation": self.probation} if mode == "audit" else {}

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


def run_swarm(rule: str, cheat: str | None, seed: int, mode: str, args: Settings, *, until_caught: bool = False) -> dict:
    """One simulated swarm; returns its CE and, with a cheat, when and how the cheater was caught.
    `until_caught`: stop once the cheater is revoked (the draws only need that round)."""
    torch.set_num_threads(1)  # a tiny model: more threads only contend (measured far slower with 2 on 2 cores)
    tc, corpus = args.tc, _corpus()
    sim: Simulation | None = None
    tap: Tap | None = None

    def cheater(cfg, tc_, wcfg, link, corpus, **kw) -> BlockWorker:  # type: ignore[no-untyped-def]
        nonlocal tap
        tap = Tap(link)
        make = cheat_factory(cheat, victim=lambda: sim.worker(VICTIM))  # type: ignore[arg-type,union-attr]
        return make(cfg, tc_, wcfg, tap, corpus, **kw)

    scfg = SimConfig(rounds=args.rounds, replicas=3, steps_per_round=args.h, step_time_s=STEP_S, seed=seed,
                     **args.mode(mode))
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=1.5 * args.h * STEP_S), outer=OuterConfig(robust=rule),
                            claims=ClaimConfig.of(tc, args.h, enforce=True), history=args.rounds)  # every round's drops
    with tempfile.TemporaryDirectory(prefix="btnode-cheats-") as tmp:
        sim = Simulation(SHAPE, replace(tc, seed=seed), acfg, scfg, corpus.train, Path(tmp),
                         device=torch.device("cpu"), workers={CHEATER: cheater} if cheat else None)
        stop = (lambda: sim.agg.identities.is_revoked(CHEATER)) if until_caught else None  # type: ignore[union-attr]
        res = sim.run(until=stop)
        ce = None if until_caught else swarm_ce(sim.blocks(), corpus.test, args.windows, torch.device("cpu"))
        dropped = [(s.info.base_version, wid, why) for s in sim.agg.block(0).recent for wid, why in s.dropped]
    honest_verdicts = [v for v in sim.verdicts if v.header.worker_id != CHEATER]
    out = {"cheat": cheat, "rule": rule, "mode": mode, "seed": seed, "ce": ce, "versions": res.versions[0],
           "outcomes": res.outcomes, "honest_dropped": sum(not wid.startswith(CHEATER) for _, wid, _ in dropped),
           "honest_failed": sum(not v.passed for v in honest_verdicts),
           "audit_s": sum(v.seconds for v in sim.verdicts if not v.probation),
           "probation_s": sum(v.seconds for v in sim.verdicts if v.probation),
           "train_s": sum(r.worker.stats.train_seconds for r in sim.replicas if r.worker.wcfg.worker_id != CHEATER)}
    if tap is not None:
        # (round, 0 on arrival / 1 at close, reason): within a round, a refusal or failed audit comes before a drop
        caught = sorted([(r, 0, why) for r, wid, outcome, why in tap.answers
                         if outcome not in NOT_CAUGHT and why != "revoked"] +
                        [(v.header.base_version, 0, DRAWN + v.reason) for v in sim.verdicts
                         if v.header.worker_id == CHEATER and not v.passed] +
                        [(r, 1, why) for r, wid, why in dropped if wid.startswith(CHEATER)])
        failed = [v.header.base_version for v in sim.verdicts if v.header.worker_id == CHEATER and not v.passed]
        out.update(caught_round=caught[0][0] if caught else None, mechanism=caught[0][2] if caught else None,
                   audit_round=min(failed) if failed else None,
                   caught_rounds=len({r for r, *_ in caught}), pushes=len({r for r, *_ in tap.answers}))
    return out


def settings(args: argparse.Namespace, **changes: object) -> Settings:
    return replace(Settings(args.rounds, args.h, args.batch, args.windows, args.audit, args.probation), **changes)


def measure(rule: str, mode: str, args: argparse.Namespace, pool: ProcessPoolExecutor) -> dict:
    """The honest CE per seed, and each cheat's runs, for one rule and mode."""
    settings_ = settings(args)
    seeds = range(args.seeds)
    honest_runs = {s: pool.submit(run_swarm, rule, None, s, mode, settings_) for s in seeds}
    cheat_runs = {c: [pool.submit(run_swarm, rule, c, s, mode, settings_) for s in seeds] for c in args.cheats}
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
    return {"honest_ce": list(honest.values()), "honest_dropped": dropped, "rows": rows,
            "honest_failed": sum(r["honest_failed"] for r in honest_done.values()),
            "audit_s": sum(r["audit_s"] for r in honest_done.values()),
            "probation_s": sum(r["probation_s"] for r in honest_done.values()),
            "train_s": sum(r["train_s"] for r in honest_done.values())}


def draws(args: argparse.Namespace, pool: ProcessPoolExecutor) -> dict:
    """Rounds each cheat survives the draws alone: `--draw-seeds` swarms per cheat, no probation,
    stopped at the cheater's revocation or after `--draw-rounds` rounds. A cheat refused at arrival
    (the bound) is never applied, so never drawn: it is left out."""
    s = settings(args, rounds=args.draw_rounds, h=args.draw_h, probation=0)
    cheats = [c for c in args.cheats if c != "scaled"]
    runs = {c: [pool.submit(run_swarm, OuterConfig.robust, c, seed, "audit", s, until_caught=True)
                for seed in range(args.draw_seeds)] for c in cheats}
    out = {}
    for cheat, futures in runs.items():
        rounds = [None if r["audit_round"] is None else r["audit_round"] + 1 for r in (f.result() for f in futures)]
        within = sum(r is not None and r <= args.within for r in rounds) / len(rounds)
        out[cheat] = {"rounds_until_caught": rounds, "caught_within": within}
        print(f"[cheats] draws {cheat}: rounds until caught {rounds}; within {args.within}: {within:.2f}", flush=True)
    return out


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("cheats")
    ap.rounds(rounds=10, h=20, batch=16)
    ap.windows(64)
    ap.seeds(2, help="seeds (model init, data, delays) per swarm; each cheat is compared with the honest swarm "
                     "of the same seed")
    ap.quick(rounds=2, h=3, batch=4, windows=8, seeds=1, draw_seeds=2, draw_rounds=4, draw_h=2)
    ap.add_argument("--rules", nargs="*", default=list(RULES), choices=ROBUST_MODES,
                    help="aggregation rules to measure; the first gives the rows (default: the shipped "
                         f"{OuterConfig.robust!r}, then the other candidates)")
    ap.add_argument("--cheats", nargs="*", default=list(CHEATS), choices=list(CHEATS), help="cheats to run (default: all)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES, help="default, audit (default: both)")
    ap.add_argument("--audit", type=float, default=0.25, help="mode audit: the share p of updates replayed")
    ap.add_argument("--probation", type=int, default=2, help="mode audit: audits a new worker id must pass first")
    ap.add_argument("--draw-seeds", type=int, default=20, help="seeded swarms per cheat for the rounds until caught")
    ap.add_argument("--draw-rounds", type=int, default=40, help="rounds a draw swarm runs at most")
    ap.add_argument("--draw-h", type=int, default=10, help="H of the draw swarms (the draws do not depend on it; "
                                                         "above the lazy cheat's 5 steps)")
    ap.add_argument("--within", type=int, default=17, help="the rounds the aim allows (1 − 0.75^17 ≈ 0.99 at p = 0.25)")
    ap.add_argument("--jobs", type=int, default=2, help="swarms simulated at once (one process and one thread each)")
    args = ap.parse_args()
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        candidates = {rule: measure(rule, "default", args, pool) for rule in args.rules} if "default" in args.modes else {}
        audited = measure(RULES[0], "audit", args, pool) if "audit" in args.modes else None
        drawn = draws(args, pool) if audited is not None else None
    shipped = candidates.get(args.rules[0], {"rows": [], "honest_ce": []})
    out = {"rule": args.rules[0], "rows": shipped["rows"] + (audited["rows"] if audited else []),
           "honest_ce": shipped["honest_ce"],
           "candidates": {rule: {"honest_ce": c["honest_ce"], "honest_dropped": c["honest_dropped"],
                                 "delta_ce": {r["cheat"]: r["delta_ce"] for r in c["rows"]},
                                 "caught": {r["cheat"]: r["mechanism"] for r in c["rows"]}}
                          for rule, c in candidates.items()},
           "rounds": args.rounds, "h": args.h, "batch": args.batch, "windows": args.windows, "seeds": args.seeds,
           "model": SHAPE.to_dict(), "quick": args.quick, "false_positives": None, "audit_cost_share": None}
    if audited is not None:
        out.update(false_positives=audited["honest_failed"],
                   audit_cost_share=audited["audit_s"] / audited["train_s"],
                   audit_cost_share_with_probation=(audited["audit_s"] + audited["probation_s"]) / audited["train_s"],
                   audit={"p": args.audit, "probation": args.probation, "honest_ce": audited["honest_ce"]},
                   draws={"p": args.audit, "seeds": args.draw_seeds, "max_rounds": args.draw_rounds, "h": args.draw_h,
                          "within": args.within, "cheats": drawn})
    publish("cheats", out, metrics(out), render, out=args.results)


def _sybil_note(out: dict) -> str:
    sybil = next((r for r in out["rows"] if r["cheat"] == "sybil"), None)
    if sybil is None or sybil["mechanism"] is not None:
        return "The sybil pushes under ids that never joined."
    return "The sybil pushes under ids that never joined: accepted here (the aggregator does not refuse them yet)."


def metrics(res: dict) -> dict[str, Metric]:
    """Cheats never caught, without and with replay audits, false positives, and what audits cost."""
    def missed(mode: str) -> int:
        return sum(r["caught_round"] is None for r in res["rows"] if r["mode"] == mode)

    return {"cheats never caught (no audits)": missed("default"), "cheats never caught (audits)": missed("audit"),
            "cheats run": sum(r["mode"] == "default" for r in res["rows"]), "false positives": res["false_positives"],
            "audit cost share": res["audit_cost_share"]}


def render(out: dict) -> str:
    rows = [(r["cheat"], r["mode"], "—" if r["caught_round"] is None else r["caught_round"], r["mechanism"] or "—",
             f"{r['delta_ce']:+.4f}", " / ".join(f"{d:+.4f}" for d in r["delta_ce_runs"]))
            for r in out["rows"]]
    rules = list(out["candidates"])
    cand = [(cheat, *(f"{out['candidates'][rule]['delta_ce'].get(cheat, float('nan')):+.4f}" for rule in rules))
            for cheat in (out["candidates"][rules[0]]["delta_ce"] if rules else [])]
    honest = [("honest CE", *(f"{statistics.mean(out['candidates'][rule]['honest_ce']):.4f}" for rule in rules)),
              ("honest updates dropped", *(str(out["candidates"][rule]["honest_dropped"]) for rule in rules))]
    lines = [
        "## Cheats: one cheating replica in three (`bench/cheats.py`)", "",
        f"Command: `.venv/bin/python -m bench.cheats` (2 cores). One block × 3 replicas, d=32, L=1, N=32, "
        f"R = {out['rounds']} rounds of H = {out['h']} (batch {out['batch']}, int8 updates, claims checked), "
        f"aggregation `{out['rule']}`; replica {CHEATER} cheats (lab/cheats.py). ΔCE: SCE-1 at K = 1 on "
        f"{out['windows']} held-out windows against the all-honest swarm of the same seed and mode (nats/byte), mean "
        f"over seeds {', '.join(map(str, range(out['seeds'])))}. Caught: the first round an update of the cheater was "
        "refused, failed its audit (`audit_…`) or was dropped, and by what. A cheat dropped in every round leaves two "
        f"honest replicas: its per-seed ΔCE is what one replica's work is worth here, the table's noise floor. "
        f"{_sybil_note(out)}", ""]
    if "runs" in out:
        lines += ["Runs: " + "; ".join(f"mode {m}: `{c}`" for m, c in out["runs"].items()) + ".", ""]
    if "audit" in out:
        a = out["audit"]
        lines += [f"Mode `audit`: p = {a['p']}, probation {a['probation']} (every cheat here cheats from its first "
                  f"update, so probation catches it before anything of it is applied). Honest audited swarms: "
                  f"{out['false_positives']} failed audits of honest workers; the replays took "
                  f"{out['audit_cost_share']:.3f} of the honest workers' training time "
                  f"({out['audit_cost_share_with_probation']:.3f} with the probation replays).", ""]
    lines += table(["cheat", "mode", "caught round", "mechanism", "ΔCE", "per seed"], rows, "llrlrl")
    if "draws" in out:
        d = out["draws"]
        lines += ["", f"Rounds until caught by the draws alone (no probation: a worker that turns after passing it), "
                      f"p = {d['p']}, {d['seeds']} seeded swarms per cheat (H = {d['h']}, at most {d['max_rounds']} "
                      f"rounds; `scaled` is refused at arrival and never drawn). Expected share within {d['within']} "
                      f"rounds: 1 − (1 − p)^{d['within']} = {1 - (1 - d['p']) ** d['within']:.3f}.", "",
                  *table(["cheat", "rounds until caught (per seed)", "median", f"caught within {d['within']}"],
                         [(c, " ".join("—" if r is None else str(r) for r in v["rounds_until_caught"]),
                           _median(v["rounds_until_caught"]), f"{v['caught_within']:.2f}")
                          for c, v in d["cheats"].items()], "llrr")]
    if rules:
        lines += ["", "Every candidate rule (`--robust`), same command: the honest swarm's CE (mean over seeds), how "
                      "many honest updates its screen dropped, and each cheat's ΔCE:", "",
                  *table(["cheat", *rules], honest + cand, "l" + "r" * len(rules))]
    return "\n".join(lines)


def _median(rounds: list[int | None]) -> str:
    caught = sorted(r for r in rounds if r is not None)
    return str(statistics.median(caught)) if len(caught) == len(rounds) else "—"


if __name__ == "__main__":
    main()
