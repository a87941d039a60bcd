"""`btnode train-local` and `btnode train-ar`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from btnode_cli.options import (AdaRank, Blocks, Context, CtxShare, Data, Device, DModel, Heads, K1Share, Layers, Seed, Segments,
                                SigmaGen, TailBlocks, TargetSeed, device, model_config, shares)

Out = Annotated[Path, typer.Option("--out", help="Checkpoint folder (created if missing).")]
Steps = Annotated[int, typer.Option("--steps", help="Optimizer steps per model (length of the LR schedule).")]
Batch = Annotated[int, typer.Option("--batch", help="Windows per step.")]
Lr = Annotated[float, typer.Option("--lr", help="Peak AdamW learning rate.")]
Warmup = Annotated[int, typer.Option("--warmup", help="Warmup steps.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue from the checkpoints in --out.")]
Every = Annotated[int, typer.Option("--checkpoint-every", help="Checkpoint every N steps of a model.")]
StopAfter = Annotated[Optional[int], typer.Option("--stop-after", help="Stop (with a checkpoint) after this many steps; resume later.")]
LogEvery = Annotated[Optional[int], typer.Option(
    "--log-every", help="Also log a progress line every N steps when not on a terminal (default: only at the end).")]


def _train_config(steps: int, batch: int, lr: float, warmup: int, seed: int, **extra: float):
    from btnode.train.config import TrainConfig

    return TrainConfig(steps=steps, batch=batch, lr=lr, warmup=warmup, seed=seed, **extra)


def train_local(out: Out, steps: Steps = 1000, batch: Batch = 32, lr: Lr = 2e-3, warmup: Warmup = 100,
                seed: Seed = 0, data: Data = None, device_name: Device = "cpu", resume: Resume = False,
                checkpoint_every: Every = 200, stop_after: StopAfter = None, log_every: LogEvery = None,
                d_model: DModel = 128, heads: Heads = 4, layers: Layers = 2, blocks: Blocks = 3,
                context: Context = 128, segments: Segments = "1,16", target_seed: TargetSeed = 0, tail_blocks: TailBlocks = 0, sigma_gen: SigmaGen = 0.1, ada_rank: AdaRank = 0,
                k1_share: K1Share = None, ctx_share: CtxShare = None,
                block: Annotated[Optional[list[int]], typer.Option(
                    "--block", help="Train only this block (repeatable). Default: all B blocks (and the T tail blocks).")] = None) -> None:
    """Train all B blocks in one process, each with its own optimizer; one checkpoint per block."""
    from btnode.data import corpus
    from btnode.train.loops import train_blocks
    from btnode_cli.progress import ProgressPrinter

    cfg = model_config(d_model=d_model, heads=heads, layers=layers, blocks=blocks, context=context,
                       segments=segments, target_seed=target_seed,
                       tail_blocks=tail_blocks, sigma_gen=sigma_gen, ada_rank=ada_rank)
    tc = _train_config(steps, batch, lr, warmup, seed, **shares(k1_share, ctx_share))
    train_blocks(cfg, tc, corpus.load(data).train, out, device=device(device_name), resume=resume, blocks=block,
                 checkpoint_every=checkpoint_every, stop_after=stop_after,
                 on_step=ProgressPrinter(log_every, len(block) if block else cfg.total_blocks))
    typer.echo(f"wrote {len(block) if block else cfg.total_blocks} block checkpoints to {out}")


def train_ar(out: Out, ar_layers: Annotated[Optional[int], typer.Option(
                 "--ar-layers", help="Depth of the baseline (default B·L, the blockwise model's total depth).")] = None,
             steps: Steps = 1000, batch: Batch = 32, lr: Lr = 2e-3, warmup: Warmup = 100, seed: Seed = 0,
             data: Data = None, device_name: Device = "cpu", resume: Resume = False, checkpoint_every: Every = 200,
             stop_after: StopAfter = None, log_every: LogEvery = None, d_model: DModel = 128, heads: Heads = 4,
             layers: Layers = 2, blocks: Blocks = 3, context: Context = 128, segments: Segments = "1,16",
             target_seed: TargetSeed = 0, tail_blocks: TailBlocks = 0, sigma_gen: SigmaGen = 0.1, ada_rank: AdaRank = 0) -> None:
    """Train the autoregressive byte-transformer baseline on the same windows."""
    from btnode.data import corpus
    from btnode.train.loops import train_ar as run
    from btnode_cli.progress import ProgressPrinter

    cfg = model_config(d_model=d_model, heads=heads, layers=layers, blocks=blocks, context=context,
                       segments=segments, target_seed=target_seed,
                       tail_blocks=tail_blocks, sigma_gen=sigma_gen, ada_rank=ada_rank)
    n_layers = ar_layers if ar_layers is not None else cfg.n_blocks * cfg.n_layers
    if n_layers < 1:
        raise typer.BadParameter("--ar-layers must be ≥ 1")
    tc = _train_config(steps, batch, lr, warmup, seed)
    run(cfg, tc, corpus.load(data).train, out, n_layers=n_layers, device=device(device_name), resume=resume,
        checkpoint_every=checkpoint_every, stop_after=stop_after, on_step=ProgressPrinter(log_every, 1))
    typer.echo(f"wrote a {n_layers}-layer autoregressive checkpoint to {out}")


def register(app: typer.Typer) -> None:
    app.command("train-local")(train_local)
    app.command("train-ar")(train_ar)
