"""Cheats benchmark (issues #23, #38): a simulated swarm (btnode/sim: the daemon's own SwarmAggregator
and workers, int8 updates through the real frame checks, each replica its own identity) of one block ×
5 replicas in the shipped configuration: the aggregator holds a fresh AggregatorConfig() (mode
`default`) or the same with its open mode on (mode `open`); the simulator sets only what it must (the
claims' batch, lr and H from the training config, the audit state's timeout on the virtual clock: the
record lists both under `sim_sets`). One cheat per swarm: a single cheating replica (lab/cheats.py
CHEATS), or an attack of several identities acting as one (ATTACKS: a 3-of-5 Sybil, sleepers).

Per row: `delta_ce`, the held-out CE at the end minus the all-honest swarm's of the same seed and mode
(worst over seeds); `peak_delta_ce`, the worst version published during the run (every version scored
on the same `--windows` held-out windows, against the honest swarm's version of the same number);
`caught_round`, the first round in which a cheating update was refused, dropped or failed its audit
(worst over seeds; None when a seed never caught it); `revoked`, every cheating identity revoked at the
end of every seed. `false_positives`: honest identities that failed an audit or were revoked, over all
swarms (the honest ones included).

    .venv/bin/python -m bench.cheats                      # every row, 3 seeds (~40 min on 2 cores)
    .venv/bin/python -m bench.cheats --cheats sybil3 sleeper2 sleeper_sybil3 flip_once_sybil3
    .venv/bin/python -m bench.cheats --quick --modes default   # a smoke run (~2 min on 2 cores)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from bench.cheats_watch import watch_rows
from bench.flags import BenchParser
from bench.report import publish, table
from bench.runs import Metric
from btnode.aggregate.round.config import AggregatorConfig
from btnode.codec.frames import Frame
from btnode.aggregate.sums.averaging import ROBUST_MODES
from btnode.codec.profiles import CLI_LINK, LINKS, LinkCodecs, link_codecs
from btnode.codec.warmup import DensityWarmup
from btnode.data.corpus import bundled
from btnode.errors import PeerInputError
from btnode.evaluation.metrics import swarm_ce
from btnode.model.config import ModelConfig
from btnode.protocol import Judgement, Outcome, PushHeader, VersionInfo
from btnode.sim.link import LocalLink
from btnode.sim.simulator import SimConfig, Simulation
from btnode.swarm.worker import BlockWorker
from btnode.train.config import TrainConfig
from lab.cheats import ATTACKS, CHEATS, SLEEP, VERIFIER_CHEATS, attack_workers, cheat_factory, lied, verifier_workers

SHAPE = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1, 8))
REPLICAS = 5
IDS = tuple(f"b0r{r}" for r in range(REPLICAS))
VICTIM = IDS[0]  # whose updates the copying cheat copies: never a cheater
STEP_S = 0.1
AIM = 0.02  # issue #38: every row's final ΔCE at most this (nats/byte)
MODES = ("default", "open")
OPEN_FIELD = "open"  # AggregatorConfig's switch of the open mode (issue #38, anyone may join)
OPEN_CHEATS = tuple(c for c in ATTACKS if "sybil" in c)  # what the open mode changes: fresh ids' weight
DRAWN = "audit_"  # the mechanism of a failed audit: audit_<reason>
NOT_CAUGHT = {Outcome.PENDING.value, Outcome.ACCEPTED.value, Outcome.PROBATION.value}  # answers that are not a refusal
ALL = (*CHEATS, *ATTACKS, *VERIFIER_CHEATS)
_corpus = functools.cache(bundled)  # once per process

# Rows measured outside the simulator, by a function of the parsed arguments returning rows with
# ROW_FIELDS (plus "honest_flagged", counted into false_positives): a Watch stream held under a foreign,
# never-joined or revoked id needs real gRPC. A name of EXTERNAL not registered here is listed in the
# record's `unmeasured`, so that its absence shows.
EXTERNAL = ("watch",)
EXTERNAL_ROWS: dict[str, Callable[[argparse.Namespace], list[dict]]] = {"watch": watch_rows}
ROW_FIELDS = ("cheat", "mode", "delta_ce", "peak_delta_ce", "caught_round", "revoked")


def codecs_of(link: str, density: float | None = None, publish_density: float | None = None,
              warmup: DensityWarmup | None = None) -> LinkCodecs:
    """`link`'s codecs, with the sparse densities and their warm-up a run overrides (--density,
    --publish-density, --density-warmup-rounds and -factor)."""
    c = link_codecs(link, SHAPE.kind)
    return replace(c, density=density or c.density, publish_density=publish_density or c.publish_density,
                   warmup=warmup or c.warmup)


def config(mode: str, link: str = CLI_LINK, publish_density: float | None = None,
           robust: str | None = None, warmup: DensityWarmup | None = None) -> AggregatorConfig:
    """The aggregator's configuration in `mode`, as a fresh aggregator holds it, with `link`'s publish codec
    (the daemon's defaults: `btnode join` builds its AggregatorConfig from flags, and the link fills it);
    `robust` (--robust) replaces the robust rule, for a diagnosis (the screen off: mean)."""
    codecs = codecs_of(link, publish_density=publish_density, warmup=warmup)
    shipped = replace(AggregatorConfig(), link=link, publish_codec=codecs.publish_codec,
                      publish_density=codecs.publish_density, warmup=codecs.warmup)
    if robust:
        shipped = replace(shipped, outer=replace(shipped.outer, robust=robust))
    if mode == "default":
        return shipped
    if OPEN_FIELD not in {f.name for f in dataclasses.fields(AggregatorConfig)}:
        raise SystemExit(f"mode open needs AggregatorConfig.{OPEN_FIELD} (issue #38's open mode); this tree has "
                         "none: run --modes default")
    return replace(shipped, **{OPEN_FIELD: True})


def warmup_of(args: argparse.Namespace) -> DensityWarmup | None:
    """The density warm-up --density-warmup-rounds and -factor give over the link's; None when neither does."""
    values = {"density_warmup_rounds": getattr(args, "density_warmup_rounds", None),
              "density_warmup_factor": getattr(args, "density_warmup_factor", None)}
    return codecs_of(args.link).warmup.over(values) if any(v is not None for v in values.values()) else None


def cheaters(cheat: str) -> tuple[str, ...]:
    """The identities that cheat: the last replicas, never the victim."""
    if cheat in VERIFIER_CHEATS:
        return IDS[-VERIFIER_CHEATS[cheat]:]
    return IDS[-ATTACKS[cheat].ids:] if cheat in ATTACKS else IDS[-1:]


def cheating_in(cheat: str, version: int) -> bool:
    """Whether the cheat's update on `version` is a cheating one (a sleeper's honest rounds are not)."""
    return cheat not in ATTACKS or ATTACKS[cheat].turned(version)


@dataclass(frozen=True)
class Settings:
    """What every swarm of a run shares (small and picklable: it goes to the worker processes)."""

    rounds: int
    h: int
    batch: int
    windows: int
    link: str = CLI_LINK  # the codecs (codec/profiles.py): the daemon's default, wan
    density: float | None = None  # the link's sparse densities, unless set (--density, --publish-density)
    publish_density: float | None = None
    robust: str | None = None  # the aggregator's robust rule, unless set (--robust)
    warmup: DensityWarmup | None = None  # the link's density warm-up, unless set (--density-warmup-rounds)

    @property
    def tc(self) -> TrainConfig:
        total = self.rounds * self.h
        return TrainConfig(batch=self.batch, steps=total, warmup=min(20, max(1, total // 10)))  # as `btnode simulate`


@dataclass
class Tap:
    """A cheating identity's link: its own LocalLink, with the answer to each of its pushes recorded as
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


def tapped(make: Callable[..., BlockWorker], answers: list) -> Callable[..., BlockWorker]:
    def build(cfg, tc, wcfg, link, corpus, **kw) -> BlockWorker:  # type: ignore[no-untyped-def]
        return make(cfg, tc, wcfg, Tap(link, answers), corpus, **kw)
    return build


def jsonable(value: Any) -> Any:
    """A config as JSON holds it (enums by name, tuples as lists)."""
    return json.loads(json.dumps(value, default=lambda v: getattr(v, "name", str(v))))


def differences(a: Any, b: Any, path: str = "") -> dict[str, Any]:
    """The leaves of nested dicts in which `b` differs from `a`: dotted path → b's value."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: v for key in sorted(set(a) | set(b))
                for k, v in differences(a.get(key), b.get(key), f"{path}{key}.").items()}
    return {} if a == b else {path.rstrip("."): b}


def run_swarm(cheat: str | None, seed: int, mode: str, s: Settings, replicas: int = REPLICAS) -> dict:
    """One simulated swarm: its CE after every published version and at the end, and, with a cheat,
    when and how its identities were caught and whether they were revoked. `replicas` fewer than
    REPLICAS: the honest replicas alone (the cheaters are the last ones), what is left once an attack's
    ids are out: the compute an attack removes, told apart from the harm it does."""
    torch.set_num_threads(1)  # a tiny model: more threads only contend
    logging.getLogger("btnode").setLevel(logging.ERROR if not os.environ.get("BTNODE_BENCH_LOG") else logging.INFO)  # every drop is logged: the row says what counts
    t0 = time.perf_counter()
    tc, corpus, cpu = s.tc, _corpus(), torch.device("cpu")
    ids = cheaters(cheat) if cheat else ()
    answers: list[tuple[int, str, str, str]] = []
    curve: list[tuple[int, float]] = []
    sim: Simulation | None = None

    revoked_in: dict[str, int] = {}  # a cheating id → the round in which it was revoked (a lying verifier's catch)

    def score(_block: int, info: VersionInfo) -> None:
        curve.append((info.version, swarm_ce(sim.blocks(), corpus.test, s.windows, cpu)))  # type: ignore[union-attr]
        for w in ids:
            if w not in revoked_in and sim.agg.identities.is_revoked(w):  # type: ignore[union-attr]
                revoked_in[w] = info.base_version

    if cheat in ATTACKS:
        makers = attack_workers(cheat, ids)
    elif cheat in VERIFIER_CHEATS:
        makers = verifier_workers(cheat, ids)
    else:
        makers = {ids[0]: cheat_factory(cheat, victim=lambda: sim.worker(VICTIM))} if cheat else {}  # type: ignore[union-attr]
    codecs = codecs_of(s.link, s.density, s.publish_density, s.warmup)
    scfg = SimConfig(rounds=s.rounds, replicas=replicas, steps_per_round=s.h, step_time_s=STEP_S, seed=seed,
                     codec=codecs.codec, density=codecs.density, warmup=codecs.warmup)
    acfg = config(mode, s.link, s.publish_density, s.robust, s.warmup)
    acfg = replace(acfg, history=max(acfg.history, s.rounds + 1))  # every round's drops counted (a bench setting)
    with tempfile.TemporaryDirectory(prefix="btnode-cheats-") as tmp:
        sim = Simulation(SHAPE, replace(tc, seed=seed), acfg, scfg, corpus.train, Path(tmp), device=cpu,
                         workers={wid: tapped(make, answers) for wid, make in makers.items()}, on_publish=score)
        assert sim.agg.acfg.history >= s.rounds + 1, "every round's drops must stay in the block's history"
        res = sim.run()
        ce = swarm_ce(sim.blocks(), corpus.test, s.windows, cpu)
        dropped = [(i.info.base_version, wid, why) for i in sim.agg.block(0).recent for wid, why in i.dropped]
    def theirs(wid: str) -> bool:
        return wid.split("-")[0] in ids  # the old sybil's fake ids ("b0r4-sybil0") are its own

    honest = [w for w in IDS if w not in ids]
    flagged = {v.header.worker_id for v in sim.verdicts if not v.passed} | set(sim.agg.identities.revoked)
    out = {"cheat": cheat, "mode": mode, "seed": seed, "ce": ce, "curve": curve, "versions": res.versions[0],
           "outcomes": res.outcomes, "ids": list(ids), "honest_flagged": sorted(set(honest) & flagged),
           "honest_dropped": sum(not theirs(wid) for _, wid, _ in dropped),
           "honest_drop_reasons": sorted(why for _, wid, why in dropped if not theirs(wid)),
           "audits": len(sim.verdicts), "audit_s": sum(v.seconds for v in sim.verdicts),
           "train_s": sum(r.worker.stats.train_seconds for r in sim.replicas),
           "config": jsonable(dataclasses.asdict(sim.agg.acfg)), "wall_s": time.perf_counter() - t0}
    if cheat:
        # (round, 0 on arrival / 1 at close, reason): within a round, a refusal or failed audit comes before a drop
        caught = sorted([(r, 0, why) for r, _, outcome, why in answers
                         if outcome not in NOT_CAUGHT and why != "revoked" and cheating_in(cheat, r)] +
                        [(v.header.base_version, 0, DRAWN + v.reason) for v in sim.verdicts
                         if v.header.worker_id in ids and not v.passed] +
                        [(r, 1, why) for r, wid, why in dropped if theirs(wid) and cheating_in(cheat, r)] +
                        [(r, 2, "verifier") for r in revoked_in.values() if cheat in VERIFIER_CHEATS])
        out.update(caught_round=caught[0][0] if caught else None, mechanism=caught[0][2] if caught else None,
                   revoked=all(sim.agg.identities.is_revoked(w) for w in ids if lied(sim.worker(w))),
                   caught_rounds=len({r for r, *_ in caught}), pushes=len({r for r, *_ in answers}))
    return out


def peak(cheat: list[tuple[int, float]], honest: list[tuple[int, float]], final: float) -> float:
    """The worst published version's CE minus the honest swarm's version of the same number (its last
    when it published fewer); `final` (ΔCE at the end) when the cheat's swarm published nothing."""
    if not cheat or not honest:
        return final
    ref = dict(honest)
    return max(ce - ref.get(v, honest[-1][1]) for v, ce in cheat)


def row(cheat: str, mode: str, runs: list[dict], honest: dict[int, dict], alone: dict[int, dict]) -> dict:
    """One row: each seed's run against the honest swarm of its seed, worst over seeds; and against the
    honest replicas alone of its seed (`alone`: the attack's ids absent from the start)."""
    final = [r["ce"] - honest[r["seed"]]["ce"] for r in runs]
    vs_alone = [r["ce"] - alone[r["seed"]]["ce"] for r in runs]
    peaks = [peak(r["curve"], honest[r["seed"]]["curve"], d) for r, d in zip(runs, final)]
    caught = [r["caught_round"] for r in runs]
    return {"cheat": cheat, "mode": mode, "ids": len(runs[0]["ids"]), "seeds": [r["seed"] for r in runs],
            "delta_ce": max(final), "peak_delta_ce": max(peaks), "delta_ce_vs_alone": max(vs_alone),
            "delta_ce_vs_alone_runs": vs_alone, "alone_minus_honest_runs": [alone[r["seed"]]["ce"] - honest[r["seed"]]["ce"]
                                                                             for r in runs],
            "caught_round": None if None in caught else max(caught),
            "revoked": all(r["revoked"] for r in runs),
            "delta_ce_runs": final, "peak_delta_ce_runs": peaks, "caught_round_runs": caught,
            "mechanism_runs": [r["mechanism"] for r in runs], "revoked_runs": [r["revoked"] for r in runs],
            "caught_rounds": [r["caught_rounds"] for r in runs], "pushes": [r["pushes"] for r in runs],
            "honest_flagged": sum(len(r["honest_flagged"]) for r in runs),
            "honest_dropped": [r["honest_dropped"] for r in runs], "versions": [r["versions"] for r in runs],
            "wall_s": [r["wall_s"] for r in runs]}


def plan(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(cheat, mode) of every row: every chosen cheat in mode default, the Sybil attacks in mode open too."""
    return [(c, m) for m in args.modes for c in args.cheats if m == "default" or c in OPEN_CHEATS]


def measure(args: argparse.Namespace, pool: ProcessPoolExecutor) -> dict:
    s = Settings(args.rounds, args.h, args.batch, args.windows, args.link, args.density, args.publish_density,
                 args.robust, warmup_of(args))
    seeds = range(args.seeds)
    rows_planned = plan(args)
    honest_f = {(m, seed): pool.submit(run_swarm, None, seed, m, s) for m in args.modes for seed in seeds}
    cheat_f = {(c, m): [pool.submit(run_swarm, c, seed, m, s) for seed in seeds] for c, m in rows_planned}
    counts = {len(cheaters(c)) for c, _ in rows_planned}
    alone_f = {(m, seed, k): pool.submit(run_swarm, None, seed, m, s, REPLICAS - k)
               for m in args.modes for seed in seeds for k in counts}
    honest = {k: f.result() for k, f in honest_f.items()}
    alone = {k: f.result() for k, f in alone_f.items()}
    for m in args.modes:
        print(f"[cheats] {m}: honest CE {[honest[(m, seed)]['ce'] for seed in seeds]}, one swarm "
              f"{max(honest[(m, seed)]['wall_s'] for seed in seeds):.0f} s", flush=True)
    rows = []
    for (cheat, mode), futures in cheat_f.items():
        k = len(cheaters(cheat))
        r = row(cheat, mode, [f.result() for f in futures], {seed: honest[(mode, seed)] for seed in seeds},
                {seed: alone[(mode, seed, k)] for seed in seeds})
        rows.append(r)
        print(f"[cheats] {cheat} ({mode}): ΔCE {r['delta_ce']:+.4f} (vs the honest alone {r['delta_ce_vs_alone']:+.4f}), "
              f"peak {r['peak_delta_ce']:+.4f}, caught round "
              f"{r['caught_round_runs']} ({r['mechanism_runs']}), revoked {r['revoked_runs']}", flush=True)
    default = honest[(args.modes[0], 0)]["config"]
    return {"rows": rows, "honest": {m: {"ce": [honest[(m, seed)]["ce"] for seed in seeds],
                                         "dropped": sum(honest[(m, seed)]["honest_dropped"] for seed in seeds),
                                         "drop_reasons": sorted(x for seed in seeds for x in honest[(m, seed)]["honest_drop_reasons"]),
                                         "flagged": sum(len(honest[(m, seed)]["honest_flagged"]) for seed in seeds),
                                         "audit_s": sum(honest[(m, seed)]["audit_s"] for seed in seeds),
                                         "train_s": sum(honest[(m, seed)]["train_s"] for seed in seeds)}
                                     for m in args.modes},
            "sim_sets": differences(jsonable(dataclasses.asdict(config(args.modes[0], args.link, args.publish_density,
                                                                       args.robust, warmup_of(args)))), default),
            "swarm_s": max(r for x in rows for r in x["wall_s"]) if rows else None}


def external(args: argparse.Namespace) -> list[dict]:
    """The rows of EXTERNAL_ROWS, each checked for ROW_FIELDS."""
    rows = [r for make in EXTERNAL_ROWS.values() for r in make(args)]
    for r in rows:
        missing = [f for f in ROW_FIELDS if f not in r]
        assert not missing, f"external row {r.get('cheat')!r} lacks {missing}"
    return rows


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("cheats")
    ap.rounds(rounds=8, h=10, batch=16)
    ap.windows(32, help="held-out windows every published version is scored on")
    ap.seeds(3, help="seeds (model init, data, delays, audit draws) per swarm; each cheat is compared with the "
                     "honest swarm of the same seed and mode")
    ap.quick(rounds=SLEEP + 1, h=3, batch=4, windows=8, seeds=1)  # the sleepers turn in the last round
    ap.add_argument("--cheats", nargs="*", default=list(ALL), choices=list(ALL), help="cheats to run (default: all)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES,
                    help="default (a fresh AggregatorConfig), open (its open mode; the Sybil attacks only)")
    ap.add_argument("--jobs", type=int, default=2, help="swarms simulated at once (one process and one thread each)")
    ap.add_argument("--link", choices=LINKS, default=CLI_LINK,
                    help="the codecs of the swarms (codec/profiles.py; default the daemon's, wan)")
    ap.add_argument("--density", type=float, help="the workers' sparse density instead of the link's")
    ap.add_argument("--publish-density", type=float, help="the sparse publish density instead of the link's")
    ap.add_argument("--density-warmup-rounds", type=int, help="the sparse densities' warm-up length W instead of the "
                    "link's (codec/warmup.py; 0: none)")
    ap.add_argument("--density-warmup-factor", type=float, help="its start, × the final density (default: the link's, "
                    "else codec/warmup.py's FACTOR)")
    ap.add_argument("--robust", choices=ROBUST_MODES, help="the aggregator's robust rule instead of the shipped "
                    "one (a diagnosis: mean turns the screen off)")
    args = ap.parse_args()
    for mode in args.modes:
        config(mode)  # a mode this tree lacks fails now, not after the first swarms
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        res = measure(args, pool)
    out = record(args, res, res["rows"] + external(args), wall_s=time.perf_counter() - t0)
    publish("cheats", out, metrics(out), render, out=args.results)


def record(args: argparse.Namespace, res: dict, rows: list[dict], *, wall_s: float) -> dict:
    """What a run publishes: the configuration the rows ran under, the rows, and the false positives."""
    shipped = config("default", args.link, args.publish_density, args.robust, warmup_of(args))
    return {"default_config": jsonable(dataclasses.asdict(shipped)), "sim_sets": res["sim_sets"],
            "link": args.link, "codecs": jsonable(dataclasses.asdict(codecs_of(args.link, args.density,
                                                                               args.publish_density, warmup_of(args)))),
            "identities": "each replica joins and pushes as its own proven identity (SimConfig.identities)",
            "rows": rows, "false_positives": sum(r.get("honest_flagged", 0) for r in rows) +
            sum(h["flagged"] for h in res["honest"].values()), "honest": res["honest"],
            "unmeasured": [n for n in EXTERNAL if n not in EXTERNAL_ROWS],
            "replicas": REPLICAS, "rounds": args.rounds, "h": args.h, "batch": args.batch, "windows": args.windows,
            "seeds": args.seeds, "model": SHAPE.to_dict(), "quick": args.quick, "swarm_s": res["swarm_s"],
            "wall_s": wall_s, "jobs": args.jobs}


def metrics(out: dict) -> dict[str, Metric]:
    """Rows over the aim, the worst ΔCE at the end and at its peak, rows with a cheating identity left
    unrevoked, false positives, the honest swarms' worst CE and screen drops, and the shipped audit share."""
    if "default_config" not in out:
        return _metrics_before_38(out)
    rows = [r for r in out["rows"] if r["delta_ce"] is not None]
    honest = {"honest CE, worst seed": max(out["honest"]["default"]["ce"]) if "default" in out["honest"] else None,
              "honest updates dropped": sum(h["dropped"] for h in out["honest"].values())}
    if not any(r["cheat"] in ALL for r in rows):  # honest swarms only (--cheats with none): what they measure
        return {**honest, "false positives": out["false_positives"]}
    worst = max((r["delta_ce"] for r in rows), default=None)
    alone = {f"rows over ΔCE {AIM} against the honest replicas alone": sum(r.get("delta_ce_vs_alone", r["delta_ce"]) > AIM for r in rows)
             } if any("delta_ce_vs_alone" in r for r in rows) else {}  # (not measured before this run)
    return {f"rows over ΔCE {AIM}": sum(r["delta_ce"] > AIM for r in rows), **alone,
            "worst ΔCE (nats/byte)": worst,
            "worst peak ΔCE (nats/byte)": max((r["peak_delta_ce"] for r in rows), default=None),
            "rows with a cheating id not revoked": sum(not r["revoked"] for r in out["rows"]),
            "false positives": out["false_positives"], "rows run": len(out["rows"]),
            **honest,
            "audit share (default)": out["default_config"]["audit"]["share"]}


def _metrics_before_38(res: dict) -> dict[str, Metric]:
    """The headline of a run recorded before issue #38 (3 replicas, modes default and audit, `--audit`)."""
    def missed(mode: str) -> int:
        return sum(r["caught_round"] is None for r in res["rows"] if r["mode"] == mode)

    return {"cheats never caught (no audits)": missed("default"), "cheats never caught (audits)": missed("audit"),
            "cheats run": sum(r["mode"] == "default" for r in res["rows"]), "false positives": res["false_positives"],
            "audit cost share": res["audit_cost_share"]}


def render(out: dict) -> str:
    def runs(values: list) -> str:
        return " / ".join("—" if v is None else f"{v:+.3f}" if isinstance(v, float) else str(v) for v in values)

    rows = [(r["cheat"], r["mode"], r.get("ids", "—"), "—" if r["caught_round"] is None else r["caught_round"],
             runs(r.get("mechanism_runs", [])), "yes" if r["revoked"] else "no",
             "—" if r["delta_ce"] is None else f"{r['delta_ce']:+.4f}",
             "—" if r["peak_delta_ce"] is None else f"{r['peak_delta_ce']:+.4f}",
             "—" if r.get("delta_ce_vs_alone") is None else f"{r['delta_ce_vs_alone']:+.4f}",
             runs(r.get("delta_ce_runs", [])), runs(r.get("alone_minus_honest_runs", [])))
            for r in out["rows"]]
    a = out["default_config"]["audit"]
    lines = [
        "## Cheats in the shipped configuration (`bench/cheats.py`)", "",
        f"One block × {out['replicas']} replicas, d=32, L=1, R = {out['rounds']} rounds of H = {out['h']} "
        f"(batch {out['batch']}), a fresh AggregatorConfig (audit share {a['share']}, probation {a['probation']}); "
        f"the simulator sets {', '.join(out['sim_sets']) or 'nothing'}. Seeds 0–{out['seeds'] - 1}; ΔCE and peak "
        f"are the worst over seeds, nats/byte on {out['windows']} held-out windows. False positives: "
        f"{out['false_positives']}. Not measured here: {', '.join(out['unmeasured']) or 'none'}. ΔCE is against "
        f"the all-honest swarm of 5; \"vs alone\" against the honest replicas alone (the attack's ids absent from "
        f"the start), whose own gap to the swarm of 5 is \"lost compute\": what removing the attacker's replicas "
        f"costs, whatever they pushed.", "",
        *table(["cheat", "mode", "ids", "caught round", "first caught by (per seed)", "revoked", "ΔCE", "peak ΔCE",
                "ΔCE vs alone", "ΔCE per seed", "lost compute per seed"], rows, "llrrllrrrll")]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
