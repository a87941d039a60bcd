"""`btnode join --role aggregator|worker` (the daemon) and `btnode swarm` (a local swarm)."""

from __future__ import annotations

import logging
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from btnode_cli.options import (AdaRank, ArLayers, Blocks, Context, CtxShare, Data, Device, DModel, Heads, K1Share, Layers,
                                ModelKind, Seed, Segments, SigmaGen, TailBlocks, TargetSeed, device, model_config,
                                outer_config, parse_ints, shares)

log = logging.getLogger("btnode.cli")


class Role(str, Enum):
    aggregator = "aggregator"
    worker = "worker"
    stage = "stage"


Codecs = ("fp32", "bf16", "int8")


def join(role: Annotated[Role, typer.Option("--role", help="What this node does.")],
         # aggregator
         listen: Annotated[str, typer.Option("--listen", help="[aggregator] HOST:PORT to serve on (port 0 picks one).")] = "0.0.0.0:7070",
         state_dir: Annotated[Optional[Path], typer.Option("--state-dir", help="[aggregator] Where versions are stored.")] = None,
         own_blocks: Annotated[Optional[str], typer.Option("--blocks-owned", help="[aggregator] Comma-separated blocks to own (default all).")] = None,
         deadline: Annotated[float, typer.Option("--deadline", help="[aggregator] τ: seconds a round stays open before it may close.")] = 30.0,
         min_updates: Annotated[int, typer.Option("--min-updates", help="[aggregator] Accepted updates needed to close at the deadline.")] = 1,
         max_staleness: Annotated[int, typer.Option("--max-staleness", help="[aggregator] Accept updates this many versions old (weighted down).")] = 0,
         outer_lr: Annotated[Optional[float], typer.Option("--outer-lr", help="[aggregator] η of the outer step (default 1; 0.7 with --model ar, DiLoCo's).")] = None,
         outer_momentum: Annotated[Optional[float], typer.Option("--outer-momentum", help="[aggregator] μ of Nesterov outer momentum, 0 = none (default 0; 0.9 with --model ar). Plain averaging: --outer-lr 1 --outer-momentum 0.")] = None,
         robust: Annotated[str, typer.Option("--robust", help="[aggregator] mean | trimmed | median.")] = "mean",
         publish_codec: Annotated[str, typer.Option("--publish-codec", help="[aggregator] Codec of published deltas.")] = "fp32",
         keep: Annotated[int, typer.Option("--keep", help="[aggregator] Versions kept on disk per block.")] = 3,
         max_streams_per_peer: Annotated[int, typer.Option("--max-streams-per-peer", help="[aggregator] Concurrent Push/Pull/FetchDelta streams one IP may hold.")] = 8,
         max_joins_per_minute: Annotated[int, typer.Option("--max-joins-per-minute", help="[aggregator] Join attempts one IP may make per minute.")] = 30,
         port_file: Annotated[Optional[Path], typer.Option("--port-file", help="Write the bound port here once serving.")] = None,
         metrics_listen: Annotated[Optional[str], typer.Option("--metrics-listen", help="HOST:PORT to serve Prometheus /metrics on (default: off).")] = None,
         drain_notice: Annotated[float, typer.Option("--drain-notice", min=0.0, help="[aggregator, stage] Seconds between gRPC Health turning NOT_SERVING on SIGTERM and the server refusing new calls (time for probes and load balancers to notice).")] = 0.0,
         # worker
         block: Annotated[Optional[int], typer.Option("--block", help="[worker, stage] The block to train or serve (a --model ar worker: 0, the default).")] = None,
         peer: Annotated[Optional[str], typer.Option("--peer", help="[worker, stage] HOST:PORT of the aggregator.")] = None,
         worker_id: Annotated[Optional[str], typer.Option("--worker-id", help="[worker, stage] Unique name (default host-pid; a stage: block-B).")] = None,
         steps_per_round: Annotated[int, typer.Option("--steps-per-round", help="[worker] H: local steps per update.")] = 50,
         codec: Annotated[str, typer.Option("--codec", help="[worker] Update codec: fp32, bf16 or int8.")] = "int8",
         no_error_feedback: Annotated[bool, typer.Option("--no-error-feedback", help="[worker] Drop the codec's rounding error.")] = False,
         train_while_waiting: Annotated[bool, typer.Option("--train-while-waiting/--idle-while-waiting", help="[worker] Keep training while the next version is on its way, and fold that work into the next update.")] = True,
         schedule_by_version: Annotated[bool, typer.Option("--schedule-by-version/--schedule-by-own-steps", help="[worker] Inner LR schedule position: at least version × H (catch up after an absence), or its own step count.")] = True,
         rounds: Annotated[Optional[int], typer.Option("--rounds", help="[worker] Stop after this many pushes.")] = None,
         batch: Annotated[int, typer.Option("--batch", help="[worker] Windows per step.")] = 32,
         lr: Annotated[float, typer.Option("--lr", help="[worker] Inner AdamW peak learning rate.")] = 2e-3,
         warmup: Annotated[int, typer.Option("--warmup", help="[worker] Inner warmup steps.")] = 100,
         schedule_steps: Annotated[Optional[int], typer.Option("--schedule-steps", help="[worker] Inner cosine length (default rounds × H).")] = None,
         stats_file: Annotated[Optional[Path], typer.Option("--stats-file", help="[worker] Write transfer and timing stats here on exit.")] = None,
         memory_limit: Annotated[Optional[str], typer.Option("--memory-limit", help="[worker] Memory this worker may use, e.g. 6G or 512M (K/M/G/T = 1024^n, as systemd's MemoryMax=). The worker refuses to start when btnode plan's estimate of its peak exceeds the smallest of this, its cgroup's limit and MemAvailable.")] = None,
         memory_check: Annotated[bool, typer.Option("--memory-check/--no-memory-check", help="[worker] Check the estimate against the limits before training (off: start anyway, e.g. with swap, and risk the kernel's OOM killer).")] = True,
         # stage
         next_stage: Annotated[Optional[str], typer.Option("--next", help="[stage] HOST:PORT of the next stage; a comma-separated list adds spares, tried in order.")] = None,
         checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", help="[stage] Load the block (or AR model) from this folder instead of --peer.")] = None,
         model: Annotated[str, typer.Option("--model", help="block or ar. [aggregator, worker] What the swarm trains (swarm-wide): block (BlockTrain) or ar (DiLoCo: full replicas of an --ar-layers AR model, one unit). [stage] What it serves: a block of the one-sweep chain, or a slice of an AR model.")] = "block",
         layers_range: Annotated[Optional[str], typer.Option("--layers-range", help="[stage, --model ar] Layers LO:HI of the AR model this stage holds.")] = None,
         stage_timeout: Annotated[float, typer.Option("--stage-timeout", help="[stage] Seconds to wait for the next stage before trying a spare.")] = 60.0,
         context_cache_mb: Annotated[float, typer.Option("--context-cache-mb", help="[stage, block] Memory for per-request clean-stream caches (0 = off: every segment rebuilds its window).")] = 256.0,
         context_cache_entries: Annotated[int, typer.Option("--context-cache-entries", help="[stage, block] Requests whose caches are kept (least recently used go first).")] = 1024,
         draft: Annotated[Optional[Path], typer.Option("--draft", help="[stage, --model ar, first stage] AR checkpoint folder of a small draft model: lets requests ask for speculative decoding.")] = None,
         kv_cache_mb: Annotated[float, typer.Option("--kv-cache-mb", help="[stage, --model ar] Memory for per-request KV caches, all requests together (least recently used go first).")] = 256.0,
         k1_share: K1Share = None, ctx_share: CtxShare = None,
         data: Data = None, device_name: Device = "cpu", seed: Seed = 0,
         d_model: DModel = 128, heads: Heads = 4, layers: Layers = 2, blocks: Blocks = 3, context: Context = 128,
         segments: Segments = "1,16", target_seed: TargetSeed = 0, tail_blocks: TailBlocks = 0, sigma_gen: SigmaGen = 0.1, ada_rank: AdaRank = 0,
         ar_layers: ArLayers = None) -> None:
    """Run a swarm node until stopped (SIGTERM/SIGINT) or, for a worker, until --rounds are done.

    With --model ar the swarm is DiLoCo on the same daemon: each worker trains a full replica of
    the AR model and pushes its delta through the same rounds, codecs and versions; the outer step
    defaults to DiLoCo's Nesterov η = 0.7, μ = 0.9. A stage serves one block of the one-sweep
    chain (or, with --model ar, a slice of an AR model); requests enter at block 0
    (`btnode generate --entry`)."""
    from btnode.codec.codecs import parse
    from btnode.errors import ConfigError

    try:
        update_codec, pub_codec = parse(codec), parse(publish_codec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if role is Role.stage:
        import threading

        from btnode.node.aggregator import install_stop_signals
        from btnode.node.stage import build_stage, run_stage
        from btnode.serve.context_cache import ContextCacheConfig

        lo_hi = None
        if layers_range:
            parsed = parse_ints(layers_range.replace(":", ","), "--layers-range")
            if len(parsed) != 2:
                raise ConfigError(f"--layers-range takes LO:HI, got {layers_range!r}")
            lo_hi = (parsed[0], parsed[1])
        if model not in ("block", "ar"):
            raise ConfigError(f"--model must be block or ar, got {model!r}")
        nexts = [a.strip() for a in next_stage.split(",") if a.strip()] if next_stage else []
        name = worker_id or (f"block-{block}" if model == "block" else f"ar-{layers_range}")
        contexts = ContextCacheConfig(max_bytes=int(context_cache_mb * 2**20), max_entries=context_cache_entries)
        stage = build_stage(kind=model, block=block, layers=lo_hi, checkpoint=checkpoint, peer=peer,
                            next_stages=nexts, device=device(device_name), timeout_s=stage_timeout, name=name,
                            context_cache=contexts, draft=draft, kv_bytes=int(kv_cache_mb * 2**20))
        stop = threading.Event()
        install_stop_signals(stop)
        run_stage(stage, listen=listen, port_file=port_file, metrics_listen=metrics_listen, stop=stop,
                  drain_notice_s=drain_notice)
        return
    cfg = model_config(d_model=d_model, heads=heads, layers=layers, blocks=blocks, context=context, segments=segments,
                       target_seed=target_seed, tail_blocks=tail_blocks, sigma_gen=sigma_gen, ada_rank=ada_rank, model=model,
                       ar_layers=ar_layers)
    if role is Role.aggregator:
        from btnode.aggregate.block import AggregatorConfig
        from btnode.aggregate.rounds import RoundConfig
        from btnode.node.aggregator import install_stop_signals, run_aggregator
        from btnode.rpc.limits import PeerLimits
        import threading

        if state_dir is None:
            raise ConfigError("the aggregator needs --state-dir")
        acfg = AggregatorConfig(round=RoundConfig(deadline_s=deadline, min_updates=min_updates, max_staleness=max_staleness),
                                outer=outer_config(model, outer_lr, outer_momentum, robust),
                                publish_codec=pub_codec, keep=keep)
        stop = threading.Event()
        install_stop_signals(stop)
        run_aggregator(cfg, acfg, state_dir=state_dir, listen=listen, seed=seed, port_file=port_file, stop=stop,
                       metrics_listen=metrics_listen, drain_notice_s=drain_notice,
                       limits=PeerLimits(max_streams=max_streams_per_peer, joins_per_minute=max_joins_per_minute),
                       blocks=list(parse_ints(own_blocks, "--blocks-owned")) if own_blocks else None)
        return
    import os
    import socket
    import threading

    from btnode.data import corpus
    from btnode.node.aggregator import install_stop_signals
    from btnode.node.memory import setting
    from btnode.node.worker import run_worker
    from btnode.swarm.worker import WorkerConfig
    from btnode.train.config import TrainConfig

    if block is None and cfg.kind == "ar":
        block = 0  # the whole AR model is the swarm's one unit
    if block is None or peer is None:
        raise ConfigError("a worker needs --block and --peer")
    if not 0 <= block < cfg.total_blocks:
        raise ConfigError(f"--block {block} out of range for {cfg.total_blocks} blocks" if cfg.kind == "block" else
                          f"--block {block}: a --model ar run has one unit, block 0 (the whole AR model)")
    cap = setting(memory_limit) if memory_limit is not None else None
    wid = worker_id or f"{socket.gethostname()}-{os.getpid()}"
    total = schedule_steps or (rounds * steps_per_round if rounds else 100_000)
    tc = TrainConfig(steps=total, batch=batch, lr=lr, warmup=min(warmup, max(1, total // 10)), seed=seed,
                     **shares(k1_share, ctx_share))
    wcfg = WorkerConfig(worker_id=wid, block=block, steps_per_round=steps_per_round, codec=update_codec,
                        error_feedback=not no_error_feedback, rounds=rounds, train_while_waiting=train_while_waiting,
                        schedule_by_version=schedule_by_version)
    stop = threading.Event()
    install_stop_signals(stop)
    stats = run_worker(cfg, tc, wcfg, peer=peer, corpus=corpus.load(data).train, device=device(device_name),
                       stats_file=stats_file, metrics_listen=metrics_listen, stop=stop, memory_limit=cap,
                       memory_check=memory_check)
    log.info("worker %s done: %d pushes %s", wid, stats.pushes, stats.outcomes)


def swarm(state_dir: Annotated[Path, typer.Option("--state-dir", help="Aggregator state and logs.")] = Path("runs/swarm"),
          replicas: Annotated[int, typer.Option("--replicas", help="R: workers per block.")] = 2,
          rounds: Annotated[int, typer.Option("--rounds", help="Pushes per worker.")] = 5,
          steps_per_round: Annotated[int, typer.Option("--steps-per-round", help="H: local steps per update.")] = 50,
          codec: Annotated[str, typer.Option("--codec", help="Update codec: fp32, bf16 or int8.")] = "int8",
          deadline: Annotated[float, typer.Option("--deadline", help="τ in seconds.")] = 60.0,
          keep: Annotated[int, typer.Option("--keep", help="Versions the aggregator keeps per block.")] = 3,
          batch: Annotated[int, typer.Option("--batch", help="Windows per step.")] = 32,
          lr: Annotated[float, typer.Option("--lr", help="Inner learning rate.")] = 2e-3,
          threads: Annotated[int, typer.Option("--threads", help="Torch threads per worker.")] = 1,
          outer_lr: Annotated[Optional[float], typer.Option("--outer-lr", help="η of the outer step (default 1; 0.7 with --model ar).")] = None,
          outer_momentum: Annotated[Optional[float], typer.Option("--outer-momentum", help="μ of Nesterov outer momentum (default 0; 0.9 with --model ar).")] = None,
          model: ModelKind = "block", ar_layers: ArLayers = None,
          seed: Seed = 0, d_model: DModel = 128, heads: Heads = 4, layers: Layers = 2, blocks: Blocks = 3,
          context: Context = 128, segments: Segments = "1,16", target_seed: TargetSeed = 0, tail_blocks: TailBlocks = 0, sigma_gen: SigmaGen = 0.1, ada_rank: AdaRank = 0) -> None:
    """Start an aggregator and B × R workers as separate processes on loopback and train for --rounds
    (with --model ar: R workers, each training a full replica of the AR model, DiLoCo)."""
    import os

    from btnode.node.swarm import run_swarm

    cfg = model_config(d_model=d_model, heads=heads, layers=layers, blocks=blocks, context=context, segments=segments,
                       target_seed=target_seed, tail_blocks=tail_blocks, sigma_gen=sigma_gen, ada_rank=ada_rank, model=model,
                       ar_layers=ar_layers)  # validate first
    shape = ["--d-model", str(d_model), "--heads", str(heads), "--layers", str(layers), "--blocks", str(blocks),
             "--context", str(context), "--segments", segments, "--target-seed", str(target_seed), "--seed", str(seed),
             "--tail-blocks", str(tail_blocks), "--sigma-gen", str(sigma_gen), "--ada-rank", str(ada_rank), "--model", model,
             *(["--ar-layers", str(cfg.ar_layers)] if cfg.kind == "ar" else [])]
    outer = [*(["--outer-lr", str(outer_lr)] if outer_lr is not None else []),
             *(["--outer-momentum", str(outer_momentum)] if outer_momentum is not None else [])]
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    units = [cfg.unit_name(b) for b in range(cfg.total_blocks)]
    result = run_swarm(state_dir=state_dir, units=units, replicas=replicas, rounds=rounds, shape_args=shape,
                       aggregator_args=["--deadline", str(deadline), "--min-updates", "1", "--keep", str(keep), *outer],
                       worker_args=["--steps-per-round", str(steps_per_round), "--codec", codec, "--batch", str(batch),
                                    "--lr", str(lr)],
                       echo=typer.echo)
    typer.echo(f"done: versions {dict(sorted(result.versions.items()))}; state in {state_dir}")


def register(app: typer.Typer) -> None:
    app.command("join")(join)
    app.command("swarm")(swarm)
