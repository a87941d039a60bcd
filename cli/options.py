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


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from exc
    if not values:
        raise ConfigError(f"{what} is empty")
    return values


def model_config(*, d_model: int, heads: int, layers: int, blocks: int, context: int, segments: str,
                 target_seed: int, tail_blocks: int = 0, sigma_gen: float = 0.1):  # -> ModelConfig (import deferred)
    from btnode.model.config import ModelConfig

    return ModelConfig(d_model=d_model, n_heads=heads, n_layers=layers, n_blocks=blocks, context=context,
                       segments=parse_ints(segments, "--segments"), target_seed=target_seed, tail_blocks=tail_blocks,
                       sigma_gen=sigma_gen)


def device(name: str):  # -> torch.device
    from btnode.device import resolve_device

    return resolve_device(name)
