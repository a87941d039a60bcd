"""`btnode generate`: text from a local checkpoint, one sampler sweep per segment of K bytes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from btnode_cli.options import Device, device


def generate(prompt: Annotated[str, typer.Argument(help="Prompt text (UTF-8). Empty: start after a newline.")] = "",
             checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", help="Block checkpoint folder (runs the chain here).")] = None,
             entry: Annotated[Optional[str], typer.Option("--entry", help="HOST:PORT of a serving chain's first stage.")] = None,
             n_bytes: Annotated[int, typer.Option("--bytes", help="New bytes to generate.")] = 256,
             segment: Annotated[Optional[int], typer.Option("--segment", help="K: bytes per sweep (default: largest trained).")] = None,
             steps: Annotated[Optional[int], typer.Option("--steps", help="Sampler grid points N_s (default 2B+1).")] = None,
             seed: Annotated[int, typer.Option("--seed", help="Seed of the sampler noise.")] = 0,
             temperature: Annotated[float, typer.Option("--temperature", help="0 = argmax.")] = 0.0,
             readout: Annotated[str, typer.Option("--readout", help="pool: the sweep's last evaluation pooled with every block's context readout; last: the last evaluation alone.")] = "pool",
             device_name: Device = "cpu") -> None:
    """Print the prompt's continuation, segment by segment, as the sweeps complete."""
    from btnode.errors import InputError
    from btnode.model.noise import default_steps
    from btnode.serve.driver import generate as run
    from btnode.serve.stages import local_chain
    from btnode.store.models import load_blocks

    if (checkpoint is None) == (entry is None):
        raise InputError("give --checkpoint DIR (run here) or --entry HOST:PORT (a serving chain)")
    if n_bytes < 1 or temperature < 0:
        raise InputError("--bytes must be ≥ 1 and --temperature ≥ 0")
    out = sys.stdout.buffer
    if entry is not None:
        from btnode.rpc.stages import generate_remote

        for reply in generate_remote(entry, prompt.encode(), n_bytes=n_bytes, k=segment or 0, n_steps=steps or 0,
                                     seed=seed, temperature=temperature, readout=readout):
            out.write(reply.new_bytes)
            out.flush()
        out.write(b"\n")
        out.flush()
        return
    dev = device(device_name)
    cfg, blocks = load_blocks(checkpoint)
    k = segment if segment is not None else max(cfg.segments)
    for piece in run(local_chain(blocks, dev), cfg, cfg.n_blocks, prompt.encode(), n_bytes=n_bytes, k=k,
                     n_steps=steps or default_steps(cfg), seed=seed, temperature=temperature,
                     readout=readout):
        out.write(piece.new_bytes)
        out.flush()
    out.write(b"\n")
    out.flush()


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
