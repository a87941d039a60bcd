"""Text generation with the local block chain: one sweep of the sampler per segment of K bytes.

The context window slides: each segment sees the last N − K + 1 bytes (prompt plus output so far),
because its K noisy rows occupy positions c … c + K − 1 of the N-position noisy stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from btnode.errors import InputError
from btnode.model.block import DiffusionBlock
from btnode.model.layout import generation_layout
from btnode.model.noise import sigma_grid
from btnode.model.sampler import spans, sweep
from btnode.model.targets import target_table
from btnode.seeding import generator

EMPTY_PROMPT_CONTEXT = b"\n"  # WikiText paragraphs start after a newline


def max_prompt(context: int, k: int) -> int:
    return context - k + 1


def check_request(blocks: Sequence[DiffusionBlock], prompt: bytes, k: int, n_steps: int) -> None:
    """InputError for a request the chain cannot serve as asked."""
    cfg = blocks[0].cfg
    if k not in cfg.segments:
        raise InputError(f"segment length K={k} was not trained; this model serves K in {list(cfg.segments)}")
    if any(not span for span in spans(len(blocks), n_steps)) or n_steps < 2:
        raise InputError(f"{n_steps} sampler steps cannot visit all {len(blocks)} blocks; use at least {len(blocks)}")
    limit = max_prompt(cfg.context, k)
    if len(prompt) > limit:
        raise InputError(f"prompt is {len(prompt)} bytes; with context N={cfg.context} and K={k} "
                         f"it may be at most {limit} bytes")


def sample_bytes(logits: torch.Tensor, temperature: float, g: torch.Generator) -> torch.Tensor:
    """logits (T, V) → byte ids (T,): argmax at temperature 0, else sampling (on the CPU, seeded)."""
    if temperature <= 0:
        return logits.argmax(dim=-1).cpu()
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=g)[:, 0]


@torch.no_grad()
def generate(blocks: Sequence[DiffusionBlock], prompt: bytes, *, n_bytes: int, k: int, n_steps: int, seed: int,
             temperature: float, device: torch.device) -> Iterator[bytes]:
    """Yield the new bytes segment by segment (the last segment is cut to n_bytes)."""
    check_request(blocks, prompt, k, n_steps)
    cfg = blocks[0].cfg
    for blk in blocks:
        blk.eval()
    table = target_table(cfg).to(device)
    grid = sigma_grid(cfg, n_steps)
    text = bytearray(prompt or EMPTY_PROMPT_CONTEXT)
    produced, segment = 0, 0
    while produced < n_bytes:
        ctx = bytes(text[-max_prompt(cfg.context, k):])
        x = torch.tensor(list(ctx), dtype=torch.long, device=device)[None]
        caches = [blk.encode_context(x) for blk in blocks]
        layout = generation_layout(len(ctx), k).to(device)
        z = grid[0] * torch.randn(1, k, cfg.d_model, generator=generator("gen-noise", seed, segment)).to(device)
        logits = sweep(blocks, caches, z, grid, layout, table)[0]
        new = bytes(sample_bytes(logits, temperature, generator("gen-sample", seed, segment)).tolist())
        new = new[: n_bytes - produced]
        text += new
        produced += len(new)
        segment += 1
        yield new
