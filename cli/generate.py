"""`btnode generate`: text from a local checkpoint, one sampler sweep per segment of K bytes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from btnode_cli.options import Device, device


def generate(prompt: Annotated[str, typer.Argument(help="Prompt text (UTF-8). Empty: start after a newline.")] = "",
             checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", help="Block checkpoint folder.")] = None,
             n_bytes: Annotated[int, typer.Option("--bytes", help="New bytes to generate.")] = 256,
             segment: Annotated[Optional[int], typer.Option("--segment", help="K: bytes per sweep (default: largest trained).")] = None,
             steps: Annotated[Optional[int], typer.Option("--steps", help="Sampler grid points N_s (default 2B+1).")] = None,
             seed: Annotated[int, typer.Option("--seed", help="Seed of the sampler noise.")] = 0,
             temperature: Annotated[float, typer.Option("--temperature", help="0 = argmax.")] = 0.0,
             device_name: Device = "cpu") -> None:
    """Print the prompt's continuation, segment by segment, as the sweeps complete."""
    from btnode.errors import InputError
    from btnode.model.generation import generate as run
    from btnode.model.noise import default_steps
    from btnode.store.models import load_blocks

    if checkpoint is None:
        raise InputError("give --checkpoint DIR (a folder written by train-local)")
    if n_bytes < 1 or temperature < 0:
        raise InputError("--bytes must be ≥ 1 and --temperature ≥ 0")
    dev = device(device_name)
    cfg, blocks = load_blocks(checkpoint)
    blocks = [b.to(dev) for b in blocks]
    k = segment if segment is not None else max(cfg.segments)
    out = sys.stdout.buffer
    for piece in run(blocks, prompt.encode(), n_bytes=n_bytes, k=k, n_steps=steps or default_steps(cfg), seed=seed,
                     temperature=temperature, device=dev):
        out.write(piece)
        out.flush()
    out.write(b"\n")
    out.flush()


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
