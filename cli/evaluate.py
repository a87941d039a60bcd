"""`btnode eval`: SCE-1 and SCE-S per segment length for a block checkpoint, or the teacher-forced
CE of an autoregressive checkpoint (a train-ar folder, or the state folder of a DiLoCo run's
aggregator), on the same held-out windows and positions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from btnode.model.readout import DEFAULT_READOUT, SWEEP_READOUTS, Readout
from btnode.node.settings import HostConfig
from btnode.settings import build
from btnode_cli.options import device, parse_ints, takes


@takes(HostConfig)
def evaluate(checkpoint: Annotated[Path, typer.Option("--checkpoint", help="Checkpoint folder (blocks or AR).")],
             segments: Annotated[Optional[str], typer.Option(
                 "--segments", help="Segment lengths K to score (default: every trained K).")] = None,
             seeds: Annotated[int, typer.Option("--seeds", help="S: seeds averaged for SCE-S (seeds 0..S-1).")] = 8,
             steps: Annotated[Optional[int], typer.Option("--steps", help="Sampler grid points N_s (default 2B+1).")] = None,
             windows: Annotated[int, typer.Option("--windows", help="Held-out windows (evenly spread over the test file).")] = 256,
             readout: Annotated[str, typer.Option("--readout", help="pool (the blocks' context readouts pooled with the sweep's last evaluation) or last.")] = DEFAULT_READOUT.value,
             version: Annotated[Optional[int], typer.Option("--version", help="Score this version of every block, or of a DiLoCo run's AR model (aggregator state folders).")] = None,
             alone: Annotated[bool, typer.Option("--alone/--no-alone", help="Also read each block alone at K=1.")] = True,
             json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the results here.")] = None,
             **flags: Any) -> None:
    """Score a checkpoint on held-out bytes (nats/byte; bits/byte = nats/ln 2)."""
    import torch

    from btnode.data.source import unigram_entropy
    from btnode.data.windows import eval_windows
    from btnode.errors import InputError
    from btnode.evaluation.metrics import ar_ce, blocks_alone, sampler_ce
    from btnode.model.noise import default_steps
    from btnode.store.models import kind_of, load_ar, load_blocks

    host = build(HostConfig, flags)
    dev = device(host.device)
    if seeds < 1 or windows < 1:
        raise InputError("--seeds and --windows must be ≥ 1")
    if readout not in SWEEP_READOUTS:
        raise InputError(f"--readout must be one of {', '.join(r.value for r in SWEEP_READOUTS)}, got {readout!r}")
    data = host.load_corpus()
    test = data.test
    kind = kind_of(checkpoint)
    result: dict = {"checkpoint": str(checkpoint), "kind": kind, "data": data.source, "split": test.description,
                    "unigram": unigram_entropy(test)}
    typer.echo(f"scored on {test.description}, {len(test):,} bytes ({data.source})")
    if kind == "ar":
        loaded = load_ar(checkpoint, version=version)
        w = eval_windows(test, loaded.cfg.context, windows)
        ce = ar_ce(loaded.model.to(dev), w, device=dev)  # type: ignore[arg-type]
        result.update(n_layers=loaded.meta["n_layers"], windows=len(w), ce=ce, version=version)
        typer.echo(f"autoregressive ({loaded.meta['n_layers']} layers): teacher-forced CE {ce:.4f} nats/byte "
                   f"on {len(w)} windows (unigram entropy {result['unigram']:.4f})")
    else:
        cfg, blocks = load_blocks(checkpoint, version)
        blocks = [b.to(dev) for b in blocks[:cfg.n_blocks]]  # scoring never runs the tail blocks
        ks = parse_ints(segments, "--segments") if segments else cfg.segments
        bad = [k for k in ks if k not in cfg.segments]
        if bad:
            raise InputError(f"segment lengths {bad} were not trained; this checkpoint has K in {list(cfg.segments)}")
        n_steps = steps or default_steps(cfg)
        w = eval_windows(test, cfg.context, windows)
        result.update(windows=len(w), n_steps=n_steps, seeds=list(range(seeds)), readout=readout, version=version,
                      per_k={})
        typer.echo(f"{len(w)} held-out windows, N_s={n_steps}, seeds 0..{seeds - 1}, readout {readout}; "
                   f"unigram entropy {result['unigram']:.4f} nats/byte")
        for k in ks:
            r = sampler_ce(blocks, w, k=k, seeds=range(seeds), n_steps=n_steps, device=dev, readout=Readout(readout))
            result["per_k"][str(k)] = {"sce1": r.sce1, f"sce{seeds}": r.sce, "positions": r.positions}
            typer.echo(f"K={k:<4d} SCE-1 {r.sce1:.4f}  SCE-{seeds} {r.sce:.4f} nats/byte "
                       f"({r.bits:.3f} bits/byte) over {r.positions} positions")
        if alone and 1 in cfg.segments:
            # Composition: nobody should read a chain number without its best block beside it.
            reads = blocks_alone(blocks, w, seeds=range(seeds), device=dev)
            best = min(reads, key=lambda a: a.best)
            result["alone"] = [{"block": a.block, f"noise_sce{seeds}": a.noise, "context": a.context, "best": a.best}
                               for a in reads]
            result["best_block"] = {"block": best.block, "ce": best.best}
            for a in reads:
                typer.echo(f"block {a.block} alone, K=1: from noise at σ_hi SCE-{seeds} {a.noise:.4f}, "
                           f"context readout {a.context:.4f} nats/byte")
            if "1" in result["per_k"]:
                chain = result["per_k"]["1"][f"sce{seeds}"]
                result["chain_minus_best_block"] = chain - best.best
                verdict = "beats" if chain < best.best else "does NOT beat"
                typer.echo(f"the chain (SCE-{seeds} {chain:.4f}) {verdict} its best block (block {best.block}, "
                           f"{best.best:.4f}) by {best.best - chain:+.4f} nats/byte")
        del torch
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=1) + "\n")


def register(app: typer.Typer) -> None:
    app.command("eval")(evaluate)
