"""Options shared by several commands, and the builders that turn them into frozen configs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from btnode.errors import ConfigError

Device = Annotated[str, typer.Option("--device", help="Torch device: cpu, cuda or cuda:N.")]
Data = Annotated[Optional[Path], typer.Option(
    "--data", help="Corpus: a file (training corpus) or a folder with wiki.{train,valid,test}.raw. "
                   "Default: the bundled WikiText-2 copy.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed for initialisation, windows, σ and noise.")]
K1Share = Annotated[Optional[float], typer.Option(
    "--k1-share", help="Probability of a K=1 batch (default 0.9; the rest spread over the other trained K).")]
CtxShare = Annotated[Optional[float], typer.Option(
    "--ctx-share", help="Share of samples trained as the block's context readout, z = 0 at σ_hi (default 0.25).")]


def shares(k1_share: float | None, ctx_share: float | None) -> dict:
    """TrainConfig keyword arguments for the flags given; absent flags keep TrainConfig's defaults."""
    out: dict = {}
    if k1_share is not None:
        out["k1_share"] = k1_share
    if ctx_share is not None:
        out["ctx_share"] = ctx_share
    return out
DModel = Annotated[int, typer.Option("--d-model", help="Model width d (swarm-wide).")]
Heads = Annotated[int, typer.Option("--heads", help="Attention heads (swarm-wide).")]
Layers = Annotated[int, typer.Option("--layers", help="Layers per block L (swarm-wide).")]
Blocks = Annotated[int, typer.Option("--blocks", help="Number of blocks B (swarm-wide).")]
Context = Annotated[int, typer.Option("--context", help="Context length N in bytes (swarm-wide).")]
Segments = Annotated[str, typer.Option("--segments", help="Comma-separated segment lengths K to train (swarm-wide); must include 1.")]
TargetSeed = Annotated[int, typer.Option("--target-seed", help="Seed of the fixed target table E (swarm-wide).")]
TailBlocks = Annotated[int, typer.Option("--tail-blocks", help="T: tail blocks trained below σ_lo for joint multi-byte generation (swarm-wide; default 0).")]
SigmaGen = Annotated[float, typer.Option("--sigma-gen", help="σ the tail blocks end at (swarm-wide; used only with --tail-blocks).")]
AdaRank = Annotated[int, typer.Option("--ada-rank", help="Rank r of the blocks' σ-conditioning (swarm-wide): 0 gives every layer a full-rank AdaLN map (6d² parameters each); r > 0 a shared r-wide σ-embedding and r × 6d maps, fewer bytes per round.")]
ModelKind = Annotated[str, typer.Option("--model", help="What the swarm trains (swarm-wide): block (BlockTrain: B blocks, a worker trains one) or ar (DiLoCo: every worker trains a full replica of the AR model, the swarm's one unit).")]
ArLayers = Annotated[Optional[int], typer.Option("--ar-layers", help="Depth of the AR model of a --model ar run (swarm-wide; default B·L).")]


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from exc
    if not values:
        raise ConfigError(f"{what} is empty")
    return values


def model_config(*, d_model: int, heads: int, layers: int, blocks: int, context: int, segments: str,
                 target_seed: int, tail_blocks: int = 0, sigma_gen: float = 0.1, model: str = "block",
                 ar_layers: int | None = None, ada_rank: int = 0):  # -> ModelConfig (import deferred)
    from btnode.model.config import KINDS, ModelConfig

    if model not in KINDS:
        raise ConfigError(f"--model must be one of {', '.join(KINDS)}, got {model!r}")
    if ar_layers is not None and model != "ar":
        raise ConfigError("--ar-layers is the depth of a --model ar run; this is a block run")
    depth = (ar_layers if ar_layers is not None else blocks * layers) if model == "ar" else 0
    return ModelConfig(d_model=d_model, n_heads=heads, n_layers=layers, n_blocks=blocks, context=context,
                       segments=parse_ints(segments, "--segments"), target_seed=target_seed, tail_blocks=tail_blocks,
                       sigma_gen=sigma_gen, kind=model, ar_layers=depth, ada_rank=ada_rank)


def outer_config(model: str, lr: float | None, momentum: float | None, robust: str = "mean"):  # -> OuterConfig
    """The aggregator's outer step: plain averaging (η = 1, μ = 0) for a block run, DiLoCo's outer
    Nesterov step (η = 0.7, μ = 0.9) for --model ar; --outer-lr / --outer-momentum override either."""
    from btnode.aggregate.averaging import DILOCO_OUTER, OuterConfig

    base = DILOCO_OUTER if model == "ar" else OuterConfig()
    return OuterConfig(lr=base.lr if lr is None else lr, momentum=base.momentum if momentum is None else momentum,
                       robust=robust)


def device(name: str):  # -> torch.device
    from btnode.device import resolve_device

    return resolve_device(name)
