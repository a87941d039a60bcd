"""What verification costs the aggregator as the swarm grows (issue #39): one block × N replicas in the
simulator (the daemon's SwarmAggregator and BlockWorkers in process, each replica its own identity), the
shipped configuration (audit share 0.25, probation 2, delegated verification), against the same swarm
with the aggregator replaying every audit itself (`--verify-min-workers 0`, the configuration before
#39) and with no audits at all.

Per run: `aggregator_cpu_s`, the aggregator's time in verification (its replay audits, draws, digest
checks and referee steps: every call into the audit desk and the delegated verifier, timed, less the
admission of a verified update into its round's sum, which every update pays audited or not), and apart
from it the workers' polls for duties (`duty_polls`, `duty_polls_s`: the simulator polls after every
event, a worker process once a second while it waits, so only the per-call cost carries over);
`verifier_cpu_s`, the workers' replays for each other; `swarm_train_cpu_s`, the workers' training;
`audits`, `disputes`, `tasks` (delegated), `local` (replayed by the aggregator). The simulator runs
compute without simulating its time, so a round's latency is given as what it would wait for: the
aggregator's verification work per round (one core) against a worker's training time per round. A
verifier's replay of a held update adds one replay (≈ one worker round) to its round in the delegated
mode; the aggregator-only mode adds its whole queue.

With `--relays R` the replicas push through R relays (the daemon's relay aggregators in the simulator:
btnode/sim/relays.py), recorded as the setting `relays`: the same columns, plus `relay_cpu_s` (the
relays' own time: their children's calls and their forwarding, less their calls to the root) and each
run's `virtual_round_s` (virtual time per published version, whose waits are the rounds' and the
audits', not the replays' compute). Workers behind relays verify as direct ones do: the root keeps
their duties for their relay, which fetches them and passes their calls on (aggregate/relay/duties.py).

    .venv/bin/python -m bench.verification                 # N = 64 and 256, 6 rounds (~10 min on 2 cores)
    .venv/bin/python -m bench.verification --quick         # N = 8 and 16
    .venv/bin/python -m bench.verification --workers 256 --relays 8
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.flags import BenchParser
from bench.report import publish, result_path, table
from bench.runs import Metric
from btnode.aggregate.replays import ReplayDesk
from btnode.aggregate.round.block import BlockAggregator
from btnode.aggregate.round.config import AggregatorConfig
from btnode.aggregate.trust.audit import AuditConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.delegate import DelegatedReplays, DelegationConfig, draw, share_draw
from btnode.data.corpus import bundled
from btnode.model.config import ModelConfig
from btnode.sim.simulator import SimConfig, Simulation
from btnode.train.config import TrainConfig

SHAPE = ModelConfig(d_model=32, n_heads=2, n_layers=1, n_blocks=1, context=32, segments=(1, 8))  # the cheats bench's
MODES = {
    "delegated": lambda a: a,  # the shipped configuration
    "aggregator_only": lambda a: replace(a, delegation=DelegationConfig(min_workers=0)),  # before issue #39
    "no_audits": lambda a: replace(a, audit=AuditConfig(share=0.0)),
}
TIMED = ((ReplayDesk, "run_audits"), (DelegatedReplays, "attest"), (DelegatedReplays, "submit_trace"),
         (DelegatedReplays, "submit_state"), (DelegatedReplays, "inputs"))
ADMITS = ((BlockAggregator, "admit_held"),)  # a verdict's admission of its update into the round's sum (and a
#   close it may trigger): every update pays that once, audited or not, so it is taken out of verification's time
#   (timed only inside verification's calls: a relay audit's admission of a combined push is none of its time)
POLLS = ((DelegatedReplays, "duties_of"),)  # workers asking for duties: timed apart (the simulator asks after
#   every event, where a worker process asks once a second while it waits)


class Stopwatch:
    """Sums the wall time of every call of `methods`, re-entrant calls once; counts the outer calls.
    `within`: only the calls made inside one that another stopwatch times."""

    def __init__(self, methods=TIMED, within: Stopwatch | None = None) -> None:  # type: ignore[no-untyped-def]
        self.methods, self.seconds, self.depth, self.calls, self.saved = methods, 0.0, 0, 0, []
        self.within = within

    def __enter__(self) -> Stopwatch:
        for cls, name in self.methods:
            fn = getattr(cls, name)
            self.saved.append((cls, name, fn))
            setattr(cls, name, self._timed(fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, fn in self.saved:
            setattr(cls, name, fn)

    def _timed(self, fn):  # type: ignore[no-untyped-def]
        @functools.wraps(fn)
        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            if self.within is not None and not self.within.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.perf_counter() - t0
                    self.calls += 1
        return timed


def run(n: int, mode: str, rounds: int, h: int, batch: int, seed: int, relays: int = 0) -> dict:
    torch.set_num_threads(1)
    logging.getLogger("btnode").setLevel(logging.ERROR)
    tc = TrainConfig(batch=batch, steps=rounds * h, warmup=h, seed=seed)
    acfg = MODES[mode](AggregatorConfig(claims=ClaimConfig.of(tc, h)))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="btnode-verification-") as tmp, Stopwatch() as watch, \
            Stopwatch(POLLS) as polls, Stopwatch(ADMITS, within=watch) as admits:
        sim = Simulation(SHAPE, tc, acfg, SimConfig(rounds=rounds, replicas=n, steps_per_round=h, seed=seed,
                                                    relays=relays), bundled().train, Path(tmp), device=torch.device("cpu"))
        result = sim.run()
    d = sim.agg.delegated
    stats = [r.worker.stats for r in sim.replicas]
    train = sum(s.train_seconds for s in stats)
    out = {"n_workers": n, "mode": mode, "rounds": rounds, "versions": sim.agg.block(0).info.version,
           "aggregator_cpu_s": watch.seconds - admits.seconds, "admit_s": admits.seconds, "duty_polls": polls.calls, "duty_polls_s": polls.seconds,
           "aggregator_replay_s": sim.agg.audits.seconds if sim.agg.audits else 0.0,
           "referee_s": d.referee_seconds if d is not None else 0.0, "verifier_cpu_s": sum(s.verify_seconds for s in stats),
           "swarm_train_cpu_s": train, "audits": len(sim.verdicts), "failed": sum(not v.passed for v in sim.verdicts),
           "revoked": sorted(sim.agg.identities.revoked), "counts": dict(d.counts) if d is not None else {},
           "disputes": d.counts.get("disputes", 0) if d is not None else 0,
           "worker_round_s": train / max(1, sum(s.pushes for s in stats)), "wall_s": time.perf_counter() - t0}
    out["aggregator_share"] = out["aggregator_cpu_s"] / train if train else 0.0
    out["replayed_at_aggregator"] = (sum(d.counts.get(k, 0) for k in ("local", "spot", "rechecks", "reassigned",
                                                                      "local_after_dispute")) if d is not None
                                     else len(sim.verdicts))
    out["aggregator_per_round_s"] = out["aggregator_cpu_s"] / max(1, out["versions"])
    out["virtual_round_s"] = result.virtual_seconds / max(1, out["versions"])
    out["relays"] = relays
    out["relay_cpu_s"] = sum(hop.relay.cpu_s() for hop in sim.relays)
    out["relay_lost"] = sum(hop.relay.lost() for hop in sim.relays)  # accepted child updates never forwarded
    out["relay_pushes"] = dict(sum((Counter(hop.relay.judged) for hop in sim.relays), Counter()))
    return out


def pass_formula(f_pool: int, pool: int, r: float, s: float) -> float:
    """The chance a cheating update drawn for audit passes: every verifier drawn is the attacker's (one,
    or two at share r, drawn without replacement from the author's `pool` others, `f_pool` of them its)
    and the aggregator does not spot-check it (share s)."""
    one = f_pool / pool
    two = f_pool * (f_pool - 1) / (pool * (pool - 1))
    return (1 - s) * ((1 - r) * one + r * two)


def detection(pool: int = 63, trials: int = 4000, secret: bytes = b"bench-verification" * 2) -> list[dict]:
    """The pass rate of a cheat against the real draws (delegate.py draw, share_draw) over `trials`
    update ids, for attacker shares of the verifier pool and (redundancy, spot) settings, beside the formula."""
    names = [f"w{i:03d}" for i in range(pool)]
    out = []
    for f in (0.1, 0.2, 1 / 3, 0.5):
        bad = set(names[:round(f * pool)])
        for r, s in ((DelegationConfig().redundancy, DelegationConfig().spot), (0.5, 0.04), (0.2, 0.2)):
            passed = 0
            for i in range(trials):
                uid = f"{i:032x}"
                chosen = draw(secret, uid, names, 2 if share_draw(secret, "redundant", uid) < r else 1)
                passed += all(c in bad for c in chosen) and not share_draw(secret, "spot", uid) < s
            out.append({"attacker_share": len(bad) / pool, "redundancy": r, "spot": s, "trials": trials,
                        "measured_pass": passed / trials, "formula_pass": pass_formula(len(bad), pool, r, s)})
    return out


def main() -> None:
    ap = BenchParser(__doc__)
    ap.result("verification")
    ap.rounds(rounds=6, h=10, batch=16)
    ap.quick(rounds=3, h=3, batch=4)
    ap.add_argument("--workers", type=int, nargs="*", default=[64, 256], help="swarm sizes N")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--relays", type=int, default=0, help="relays the replicas push through (0: all to the root); "
                                                          "recorded as the setting `relays` unless --setting says")
    args = ap.parse_args()
    if args.relays and args.setting == "default":
        args.results = result_path("verification", "relays", quick=args.quick, results=args.results_dir)
    sizes = [8, 16] if args.quick else args.workers
    runs = []
    for n in sizes:
        for mode in args.modes:
            r = run(n, mode, args.rounds, args.h, args.batch, args.seed, relays=args.relays)
            runs.append(r)
            print(f"N={n:4d} R={args.relays} {mode:16s} aggregator {r['aggregator_cpu_s']:7.2f} s "
                  f"({100 * r['aggregator_share']:5.2f} % of training {r['swarm_train_cpu_s']:7.1f} s), verifiers "
                  f"{r['verifier_cpu_s']:7.1f} s, relays {r['relay_cpu_s']:6.2f} s, audits {r['audits']}, disputes "
                  f"{r['disputes']}, round {r['virtual_round_s']:.2f} s (virtual), revoked {r['revoked']}", flush=True)
    out = {"runs": runs, "relays": args.relays, "detection": detection(trials=1000 if args.quick else 4000), "model": SHAPE.to_dict(), "h": args.h, "batch": args.batch, "rounds": args.rounds,
           "seed": args.seed, "quick": args.quick, "config": {"audit": AuditConfig().share,
                                                              "delegation": DelegationConfig().__dict__}}
    publish("verification", out, metrics(out), render, out=args.results)


def metrics(out: dict) -> dict[str, Metric]:
    by = {(r["n_workers"], r["mode"]): r for r in out["runs"]}
    m: dict[str, Metric] = {}
    through = f", R={out['relays']}" if out.get("relays") else ""
    for (n, mode), r in sorted(by.items()):
        if mode != "no_audits":
            m[f"aggregator verification / training, N={n}{through}, {mode}"] = r["aggregator_share"]
        if through and mode != "no_audits" and (n, "no_audits") in by:
            m[f"round time / without audits, N={n}{through}, {mode}"] = (
                r["virtual_round_s"] / max(1e-9, by[(n, "no_audits")]["virtual_round_s"]))
    m["honest revoked"] = sum(len(r["revoked"]) for r in out["runs"])
    return m


def render(out: dict) -> str:
    rows = [(r["n_workers"], r.get("relays", 0), r["mode"], f"{r['swarm_train_cpu_s']:.1f}", f"{r['verifier_cpu_s']:.1f}",
             f"{r['aggregator_cpu_s']:.2f}", f"{100 * r['aggregator_share']:.2f} %", f"{r['aggregator_per_round_s']:.2f}",
             f"{r['worker_round_s']:.3f}", f"{r.get('relay_cpu_s', 0.0):.2f}", f"{r.get('virtual_round_s', 0.0):.2f}",
             r["audits"], r["disputes"], r["replayed_at_aggregator"],
             f"{1e6 * r['duty_polls_s'] / max(1, r['duty_polls']):.0f}", len(r["revoked"]))
            for r in out["runs"]]
    return "\n".join([
        "## What verification costs the aggregator (`bench/verification.py`)", "",
        f"Command: `.venv/bin/python -m bench.verification`. One block (d={out['model']['d_model']}, "
        f"L={out['model']['n_layers']}) × N replicas in the simulator"
        f"{f' through {r} relays (their children verify through them)' if (r := out.get('relays')) else ''}"
        f", {out['rounds']} rounds of H = {out['h']} "
        f"(batch {out['batch']}), the shipped configuration (`delegated`) against the aggregator replaying every "
        "audit itself (`aggregator_only`, before issue #39) and no audits. Aggregator: its time in every call of "
        "verification (replays, draws, digests, referee steps). Per round: the aggregator's verification time per "
        "published version (on one core) against one worker's training time per round: above it, held updates "
        "wait on the aggregator's queue.", "",
        *table(["N", "relays", "mode", "training (s)", "verifiers (s)", "aggregator (s)", "aggregator / training",
                "aggregator per round (s)", "worker round (s)", "relays (s)", "round, virtual (s)", "audits", "disputes",
                "replayed at aggregator", "µs per duty poll", "revoked"], rows, "rrlrrrrrrrrrrrrr"), "",
        "A cheating update drawn for audit passes when every verifier drawn is the attacker's and no spot check "
        "falls on it: (1 − s)·[(1 − r)·a/P + r·a(a − 1)/(P(P − 1))] for a of the author's P others the attacker's. "
        "Measured: the real draws (`draw`, `share_draw`) over update ids, P = 63.", "",
        *table(["attacker share", "redundancy r", "spot s", "pass (measured)", "pass (formula)"],
               [(f"{d['attacker_share']:.2f}", d["redundancy"], d["spot"], f"{d['measured_pass']:.4f}",
                 f"{d['formula_pass']:.4f}") for d in out["detection"]], "rrrrr")])


if __name__ == "__main__":
    main()
