"""`btnode simulate`: the virtual async simulator (btnode/sim): the daemon's round and aggregation
code with the network and the clock replaced, to see what participation and delays do to CE."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from btnode.aggregate.round.config import AggregatorConfig
from btnode.model.config import ModelConfig
from btnode.node.aggregator import AggregatorNodeConfig
from btnode.node.settings import HostConfig
from btnode.settings import Section, build
from btnode.swarm.worker import WorkerConfig
from btnode.train.config import TrainConfig
from btnode_cli.options import device, takes


@takes(Section(WorkerConfig, only=("steps_per_round", "codec", "density", "density_warmup_rounds",
                                   "density_warmup_factor", "train_while_waiting", "schedule_by_version"),
               defaults={"steps_per_round": 20, "train_while_waiting": False},
               helps={"train_while_waiting": "Replicas keep training while they wait for a version.",
                      "schedule_by_version": "Inner LR schedule position: at least version × H, or each replica's "
                                             "own step count."}),
       Section(AggregatorConfig, only=("deadline", "max_staleness", "outer_lr", "outer_momentum", "keep", "publish_codec",
                                       "publish_density"),
               defaults={"deadline": 0.0},
               helps={"deadline": "τ in virtual seconds (default: 1.5 × H × step time).",
                      "keep": "Versions the aggregator keeps per block (for learning curves)."}),
       Section(AggregatorNodeConfig, only=("state_dir",),
               helps={"state_dir": "Aggregator state (default: a temporary folder)."}),
       Section(TrainConfig, omit=("steps",), defaults={"warmup": 20}), HostConfig, ModelConfig)
def simulate(participation: Annotated[float, typer.Option("--participation", help="Probability that a replica takes part in each attempt.")] = 1.0,
             rounds: Annotated[int, typer.Option("--rounds", help="R: attempts per replica.")] = 20,
             replicas: Annotated[int, typer.Option("--replicas", help="Replicas per block.")] = 2,
             step_time: Annotated[float, typer.Option("--step-time", help="Virtual seconds per local step.")] = 0.1,
             delay_ms: Annotated[str, typer.Option("--delay-ms", help="Mean one-way delay per replica in ms, comma-separated (cycled).")] = "20",
             delay_dist: Annotated[str, typer.Option("--delay-dist", help="fixed | exp | lognormal.")] = "exp",
             sim_seed: Annotated[int, typer.Option("--sim-seed", help="Seed of the participation and delay streams.")] = 0,
             eval_windows: Annotated[int, typer.Option("--eval-windows", help="Held-out windows for the CE (SCE-1 at K=1).")] = 64,
             eval_init: Annotated[bool, typer.Option("--eval-init", help="Also score the initial model.")] = False,
             json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the results here.")] = None,
             **flags: Any) -> None:
    """Train B blocks × replicas on a virtual clock with seeded participation and delays, then score
    the published model (SCE-1 at K = 1, nats/byte) on held-out windows. With --model ar: replicas of
    the whole AR model (DiLoCo), scored by teacher-forced CE on the same windows and rows."""
    from btnode.evaluation.metrics import swarm_ce as score
    from btnode.sim.simulator import SimConfig, Simulation
    from btnode_cli.options import parse_ints

    cfg = build(ModelConfig, flags)
    wcfg = build(WorkerConfig, flags)  # its H, codec, density and waiting policy; the simulator names the replicas
    scfg = SimConfig(participation=participation, rounds=rounds, replicas=replicas, steps_per_round=wcfg.steps_per_round,
                     step_time_s=step_time, delays_s=tuple(d / 1e3 for d in parse_ints(delay_ms, "--delay-ms")),
                     delay_dist=delay_dist, codec=wcfg.codec, density=wcfg.density, warmup=wcfg.warmup,
                     train_while_waiting=wcfg.train_while_waiting,
                     seed=sim_seed, schedule_by_version=wcfg.schedule_by_version)
    flags["deadline"] = flags["deadline"] or 1.5 * wcfg.steps_per_round * step_time
    acfg = build(AggregatorConfig, flags)
    total = rounds * wcfg.steps_per_round
    tc = build(TrainConfig, flags)
    tc = replace(tc, steps=total, warmup=min(tc.warmup, max(1, total // 10)))
    host, state_dir = build(HostConfig, flags), build(AggregatorNodeConfig, flags).state_dir
    data_ = host.load_corpus()
    dev = device(host.device)
    with tempfile.TemporaryDirectory(prefix="btnode-sim-") as tmp:
        sim = Simulation(cfg, tc, acfg, scfg, data_.train, state_dir or Path(tmp), device=dev)
        ce_init = score(sim.blocks(), data_.test, eval_windows, dev) if eval_init else None
        res = sim.run()
        ce = score(sim.blocks(), data_.test, eval_windows, dev)
    out = {"participation": participation, "rounds": rounds, "deadline_s": acfg.round.deadline_s, "ce": ce,
           "ce_init": ce_init, **asdict(res), "sim": {**asdict(scfg), "codec": scfg.codec.name},
           "model": cfg.to_dict(), "outer": asdict(acfg.outer),
           "data": data_.source, "split": data_.test.description}
    what = "teacher-forced CE" if cfg.kind == "ar" else "SCE-1"
    lines = [f"participation {participation:g}: {res.attempts - res.absent}/{res.attempts} attempts taken part, "
             f"versions {res.versions}, outcomes {res.outcomes}, rounds closed by {res.closed_by}, "
             f"{res.virtual_seconds:.1f} virtual s, utilisation {res.utilisation:.2f}",
             *([f"initial model: {what} {ce_init:.4f} nats/byte"] if ce_init is not None else []),
             f"after {rounds} rounds: {what} {ce:.4f} nats/byte ({'AR, ' if cfg.kind == 'ar' else 'K=1, '}"
             f"{eval_windows} held-out windows of {data_.test.description}; "
             f"outer step η={acfg.outer.lr:g}, μ={acfg.outer.momentum:g})"]
    typer.echo("\n".join(lines))
    if json_out is not None:
        json_out.write_text(json.dumps(out, indent=1) + "\n")


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)
