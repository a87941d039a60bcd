"""`btnode train-local` and `btnode train-ar`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from btnode.model.config import ModelConfig
from btnode.node.settings import HostConfig
from btnode.settings import Section, build
from btnode.train.config import TrainConfig
from btnode_cli.options import device, takes

Out = Annotated[Path, typer.Option("--out", help="Checkpoint folder (created if missing).")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue from the checkpoints in --out.")]
Every = Annotated[int, typer.Option("--checkpoint-every", help="Checkpoint every N steps of a model.")]
StopAfter = Annotated[Optional[int], typer.Option("--stop-after", help="Stop (with a checkpoint) after this many steps; resume later.")]
LogEvery = Annotated[Optional[int], typer.Option(
    "--log-every", help="Also log a progress line every N steps when not on a terminal (default: only at the end).")]
SHAPE = Section(ModelConfig, omit=("model", "ar_layers"))  # a single-process run trains blocks; train-ar its own depth


@takes(TrainConfig, HostConfig, SHAPE)
def train_local(out: Out, resume: Resume = False, checkpoint_every: Every = 200, stop_after: StopAfter = None,
                log_every: LogEvery = None,
                block: Annotated[Optional[list[int]], typer.Option(
                    "--block", help="Train only this block (repeatable). Default: all B blocks (and the T tail blocks).")] = None,
                **flags: Any) -> None:
    """Train all B blocks in one process, each with its own optimizer; one checkpoint per block."""
    from btnode.train.loops import train_blocks
    from btnode_cli.progress import ProgressPrinter

    cfg, tc, host = build(ModelConfig, flags), build(TrainConfig, flags), build(HostConfig, flags)
    train_blocks(cfg, tc, host.load_corpus().train, out, device=device(host.device), resume=resume, blocks=block,
                 checkpoint_every=checkpoint_every, stop_after=stop_after,
                 on_step=ProgressPrinter(log_every, len(block) if block else cfg.total_blocks))
    typer.echo(f"wrote {len(block) if block else cfg.total_blocks} block checkpoints to {out}")


@takes(Section(TrainConfig, omit=("k1_share", "ctx_share")), HostConfig,
       Section(ModelConfig, omit=("model",),
               helps={"ar_layers": "Depth of the baseline (default B·L, the blockwise model's total depth)."}))
def train_ar(out: Out, resume: Resume = False, checkpoint_every: Every = 200, stop_after: StopAfter = None,
             log_every: LogEvery = None, **flags: Any) -> None:
    """Train the autoregressive byte-transformer baseline on the same windows."""
    from btnode.train.loops import train_ar as run
    from btnode_cli.progress import ProgressPrinter

    ar_layers = flags.pop("ar_layers")  # the baseline's depth, not a swarm's kind
    cfg, tc, host = build(ModelConfig, flags), build(TrainConfig, flags), build(HostConfig, flags)
    n_layers = ar_layers if ar_layers is not None else cfg.n_blocks * cfg.n_layers
    if n_layers < 1:
        raise typer.BadParameter("--ar-layers must be ≥ 1")
    run(cfg, tc, host.load_corpus().train, out, n_layers=n_layers, device=device(host.device), resume=resume,
        checkpoint_every=checkpoint_every, stop_after=stop_after, on_step=ProgressPrinter(log_every, 1))
    typer.echo(f"wrote a {n_layers}-layer autoregressive checkpoint to {out}")


def register(app: typer.Typer) -> None:
    app.command("train-local")(train_local)
    app.command("train-ar")(train_ar)
