"""`btnode simulate`: the virtual async simulator (btnode/sim): the daemon's round and aggregation
code with the network and the clock replaced, to see what participation and delays do to CE."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer

from btnode_cli.options import (AdaRank, ArLayers, Blocks, Context, CtxShare, Data, Device, DModel, Heads, K1Share, Layers,
                                ModelKind, Seed, Segments, SigmaGen, TailBlocks, TargetSeed, device, model_config,
                                outer_config, shares)


def simulate(participation: Annotated[float, typer.Option("--participation", help="Probability that a replica takes part in each attempt.")] = 1.0,
             rounds: Annotated[int, typer.Option("--rounds", help="R: attempts per replica.")] = 20,
             replicas: Annotated[int, typer.Option("--replicas", help="Replicas per block.")] = 2,
             steps_per_round: Annotated[int, typer.Option("--steps-per-round", help="H: local steps per update.")] = 20,
             step_time: Annotated[float, typer.Option("--step-time", help="Virtual seconds per local step.")] = 0.1,
             delay_ms: Annotated[str, typer.Option("--delay-ms", help="Mean one-way delay per replica in ms, comma-separated (cycled).")] = "20",
             delay_dist: Annotated[str, typer.Option("--delay-dist", help="fixed | exp | lognormal.")] = "exp",
             deadline: Annotated[float, typer.Option("--deadline", help="τ in virtual seconds (default: 1.5 × H × step time).")] = 0.0,
             max_staleness: Annotated[int, typer.Option("--max-staleness", help="Accept updates this many versions old (weighted down).")] = 0,
             outer_lr: Annotated[Optional[float], typer.Option("--outer-lr", help="η of the outer step (default 1; 0.7 with --model ar, DiLoCo's).")] = None,
             outer_momentum: Annotated[Optional[float], typer.Option("--outer-momentum", help="μ of Nesterov outer momentum (default 0; 0.9 with --model ar).")] = None,
             model: ModelKind = "block", ar_layers: ArLayers = None,
             codec: Annotated[str, typer.Option("--codec", help="Update codec: fp32, bf16 or int8.")] = "int8",
             train_while_waiting: Annotated[bool, typer.Option("--train-while-waiting/--idle-while-waiting", help="Replicas keep training while they wait for a version.")] = False,
             schedule_by_version: Annotated[bool, typer.Option("--schedule-by-version/--schedule-by-own-steps", help="Inner LR schedule position: at least version × H, or each replica's own step count.")] = True,
             sim_seed: Annotated[int, typer.Option("--sim-seed", help="Seed of the participation and delay streams.")] = 0,
             batch: Annotated[int, typer.Option("--batch", help="Windows per step.")] = 32,
             lr: Annotated[float, typer.Option("--lr", help="Inner AdamW peak learning rate.")] = 2e-3,
             warmup: Annotated[int, typer.Option("--warmup", help="Inner warmup steps.")] = 20,
             eval_windows: Annotated[int, typer.Option("--eval-windows", help="Held-out windows for the CE (SCE-1 at K=1).")] = 64,
             eval_init: Annotated[bool, typer.Option("--eval-init", help="Also score the initial model.")] = False,
             state_dir: Annotated[Optional[Path], typer.Option("--state-dir", help="Aggregator state (default: a temporary folder).")] = None,
             keep: Annotated[int, typer.Option("--keep", help="Versions the aggregator keeps per block (for learning curves).")] = 3,
             k1_share: K1Share = None, ctx_share: CtxShare = None,
             json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the results here.")] = None,
             data: Data = None, device_name: Device = "cpu", seed: Seed = 0,
             d_model: DModel = 128, heads: Heads = 4, layers: Layers = 2, blocks: Blocks = 3, context: Context = 128,
             segments: Segments = "1,16", target_seed: TargetSeed = 0, tail_blocks: TailBlocks = 0, sigma_gen: SigmaGen = 0.1, ada_rank: AdaRank = 0) -> None:
    """Train B blocks × replicas on a virtual clock with seeded participation and delays, then score
    the published model (SCE-1 at K = 1, nats/byte) on held-out windows. With --model ar: replicas of
    the whole AR model (DiLoCo), scored by teacher-forced CE on the same windows and rows."""
    from btnode.aggregate.block import AggregatorConfig
    from btnode.aggregate.rounds import RoundConfig
    from btnode.codec.codecs import parse
    from btnode.data import corpus
    from btnode.errors import ConfigError
    from btnode.evaluation.metrics import swarm_ce as score
    from btnode.sim.simulator import SimConfig, Simulation
    from btnode.train.config import TrainConfig
    from btnode_cli.options import parse_ints

    cfg = model_config(d_model=d_model, heads=heads, layers=layers, blocks=blocks, context=context,
                       segments=segments, target_seed=target_seed,
                       tail_blocks=tail_blocks, sigma_gen=sigma_gen, ada_rank=ada_rank, model=model, ar_layers=ar_layers)
    try:
        update_codec = parse(codec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    scfg = SimConfig(participation=participation, rounds=rounds, replicas=replicas, steps_per_round=steps_per_round,
                     step_time_s=step_time, delays_s=tuple(d / 1e3 for d in parse_ints(delay_ms, "--delay-ms")),
                     delay_dist=delay_dist, codec=update_codec, train_while_waiting=train_while_waiting, seed=sim_seed,
                     schedule_by_version=schedule_by_version)
    tau = deadline or 1.5 * steps_per_round * step_time
    acfg = AggregatorConfig(round=RoundConfig(deadline_s=tau, max_staleness=max_staleness), keep=keep,
                            outer=outer_config(model, outer_lr, outer_momentum))
    total = rounds * steps_per_round
    tc = TrainConfig(steps=total, batch=batch, lr=lr, warmup=min(warmup, max(1, total // 10)), seed=seed,
                     **shares(k1_share, ctx_share))
    data_ = corpus.load(data)
    dev = device(device_name)
    with tempfile.TemporaryDirectory(prefix="btnode-sim-") as tmp:
        sim = Simulation(cfg, tc, acfg, scfg, data_.train, state_dir or Path(tmp), device=dev)
        ce_init = score(sim.blocks(), data_.test, eval_windows, dev) if eval_init else None
        res = sim.run()
        ce = score(sim.blocks(), data_.test, eval_windows, dev)
    out = {"participation": participation, "rounds": rounds, "deadline_s": tau, "ce": ce, "ce_init": ce_init,
           **asdict(res), "sim": {**asdict(scfg), "codec": scfg.codec.name}, "model": cfg.to_dict(),
           "outer": asdict(acfg.outer)}
    typer.echo(f"participation {participation:g}: {res.attempts - res.absent}/{res.attempts} attempts taken part, "
               f"versions {res.versions}, outcomes {res.outcomes}, rounds closed by {res.closed_by}, "
               f"{res.virtual_seconds:.1f} virtual s, utilisation {res.utilisation:.2f}")
    what = "teacher-forced CE" if cfg.kind == "ar" else "SCE-1"
    if ce_init is not None:
        typer.echo(f"initial model: {what} {ce_init:.4f} nats/byte")
    typer.echo(f"after {rounds} rounds: {what} {ce:.4f} nats/byte ({'AR, ' if cfg.kind == 'ar' else 'K=1, '}"
               f"{eval_windows} held-out windows; outer step η={acfg.outer.lr:g}, μ={acfg.outer.momentum:g})")
    if json_out is not None:
        json_out.write_text(json.dumps(out, indent=1) + "\n")


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)
