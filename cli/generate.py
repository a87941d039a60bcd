"""`btnode generate`: text from a local checkpoint or a serving chain: one sampler sweep per
segment of K bytes, or for an AR checkpoint one traversal per byte (with --draft, speculative
decoding: up to G + 1 bytes per traversal, the same bytes)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from btnode_cli.options import Device, device

if TYPE_CHECKING:
    from btnode.serve.request import GenerationRequest


def generate(prompt: Annotated[str, typer.Argument(help="Prompt text (UTF-8). Empty: start after a newline.")] = "",
             checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", help="Block or AR checkpoint folder (runs the chain here).")] = None,
             entry: Annotated[Optional[str], typer.Option("--entry", help="HOST:PORT of a serving chain's first stage.")] = None,
             n_bytes: Annotated[int, typer.Option("--bytes", help="New bytes to generate.")] = 256,
             segment: Annotated[Optional[int], typer.Option("--segment", help="K: bytes per sweep, or spec's draft length (default: the serving default, 16).")] = None,
             steps: Annotated[Optional[int], typer.Option("--steps", help="Sampler grid points N_s (default 2B+1).")] = None,
             seed: Annotated[int, typer.Option("--seed", help="Seed of the sampler noise.")] = 0,
             temperature: Annotated[float, typer.Option("--temperature", help="0 = argmax.")] = 0.0,
             readout: Annotated[Optional[str], typer.Option("--readout", help="pool: the sweep's last evaluation pooled with every block's context readout; last: the last evaluation alone; commit: the last stage commits the segment byte by byte, each byte read with the bytes before it as context, still one traversal; spec: block 0 drafts the segment, every block scores the draft in the same traversal, the last stage keeps the prefix the pooled blocks accept (1…K bytes per traversal, distributed as the pooled blocks'); spec-fill: the same, the rest of the segment filled by the last block alone (K bytes per traversal); neither runs the sweep (default: the checkpoint's serving.json, else spec, the best measured; last with --tail-steps).")] = None,
             tail_steps: Annotated[int, typer.Option("--tail-steps", help="Grid points below σ_lo run by the tail blocks (a model trained with --tail-blocks): joint multi-byte segments, still one sweep each.")] = 0,
             draft: Annotated[Optional[Path], typer.Option("--draft", help="[AR --checkpoint] Checkpoint of a small AR draft model: speculative decoding.")] = None,
             draft_len: Annotated[Optional[int], typer.Option("--draft-len", help="[AR] G: draft bytes verified per traversal (default 8 with --draft; with --entry, asks the entry's draft).")] = None,
             device_name: Device = "cpu") -> None:
    """Print the prompt's continuation, segment by segment, as the sweeps complete."""
    from btnode.errors import InputError
    from btnode.serve.request import GenerationRequest
    from btnode.store.models import kind_of

    if (checkpoint is None) == (entry is None):
        raise InputError("give --checkpoint DIR (run here) or --entry HOST:PORT (a serving chain)")
    if n_bytes < 1 or temperature < 0:
        raise InputError("--bytes must be ≥ 1 and --temperature ≥ 0")
    if draft is not None and entry is not None:
        raise InputError("--draft is for a local --checkpoint; a chain drafts with its entry's model (--draft-len G)")
    request = GenerationRequest(prompt.encode(), n_bytes, seed=seed, temperature=temperature, k=segment,
                                n_steps=steps or None, readout=readout or None, n_tail=tail_steps,
                                draft_len=draft_len if draft_len is not None else (8 if draft is not None else 0))
    if entry is not None:
        _generate_remote(entry, request)
    elif checkpoint.is_dir() and kind_of(checkpoint) == "ar":  # type: ignore[union-attr]
        _generate_ar(checkpoint, draft, request, device(device_name))  # type: ignore[arg-type]
    elif draft is not None or request.draft_len:
        raise InputError("--draft and --draft-len are for an AR checkpoint or chain")
    else:
        _generate_blocks(checkpoint, request, device(device_name))  # type: ignore[arg-type]


def _generate_remote(entry: str, request: GenerationRequest) -> None:
    from btnode.rpc.stages import generate_remote

    out = sys.stdout.buffer
    reply = None
    for reply in generate_remote(entry, request):
        out.write(reply.new_bytes)
        out.flush()
    out.write(b"\n")
    out.flush()
    if (request.draft_len or request.readout and request.readout.drafts) and reply is not None:
        _report_draft(request.n_bytes, reply.traversals, reply.drafted, reply.accepted)


def _generate_blocks(checkpoint: Path, request: GenerationRequest, dev) -> None:
    from btnode.serve.defaults import serving_defaults
    from btnode.serve.driver import generate
    from btnode.serve.stages import local_chain
    from btnode.store.models import load_blocks

    cfg, blocks = load_blocks(checkpoint)
    if not request.n_tail:
        blocks = blocks[:cfg.n_blocks]  # a sweep that ends at σ_lo never reaches the tail
    request = request.checked(cfg, cfg.n_blocks, serving_defaults(cfg, checkpoint))  # its defaults filled: K counts the draft bytes below
    out = sys.stdout.buffer
    traversals = accepted = 0
    for piece in generate(local_chain(blocks, dev), cfg, cfg.n_blocks, request):
        out.write(piece.new_bytes)
        out.flush()
        traversals, accepted = traversals + 1, accepted + piece.accepted
    out.write(b"\n")
    out.flush()
    if request.readout and request.readout.drafts:
        _report_draft(request.n_bytes, traversals, traversals * (request.k or 0), accepted)


def _generate_ar(checkpoint: Path, draft: Path | None, request: GenerationRequest, dev) -> None:
    from btnode.serve.ar import local_ar_chain
    from btnode.serve.draft import ARDrafter
    from btnode.serve.driver import generate_ar
    from btnode.store.models import load_ar

    model = load_ar(checkpoint).model
    drafter = ARDrafter(load_ar(draft).model, device=dev) if draft is not None else None  # type: ignore[arg-type]
    out = sys.stdout.buffer
    traversals = drafted = accepted = 0
    chain = local_ar_chain(model, 1, dev, drafter=drafter)  # type: ignore[arg-type]
    for piece in generate_ar(chain, model.cfg, request, draft=drafter):  # type: ignore[arg-type]
        out.write(piece.new_bytes)
        out.flush()
        traversals, drafted, accepted = traversals + 1, drafted + piece.drafted, accepted + len(piece.new_bytes) - 1
    out.write(b"\n")
    out.flush()
    if request.draft_len:
        _report_draft(request.n_bytes, traversals, drafted, accepted)


def _report_draft(n_bytes: int, traversals: int, drafted: int, accepted: int) -> None:
    typer.echo(f"{n_bytes} bytes in {traversals} traversals: {n_bytes / max(traversals, 1):.2f} bytes per traversal; "
               f"{accepted} of {drafted} draft bytes accepted", err=True)


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
