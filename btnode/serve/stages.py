"""The one-sweep chain (design §4): a `Stage` takes the state of one segment, runs the grid
points its block owns on the whole segment, and hands the state to the next stage; the last
stage samples the bytes. `LocalBlockStage` computes; `FailoverStage` tries the candidates for the
next block in order (a spare takes over when the primary is unavailable); rpc/ adds a remote stage.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from btnode.errors import InputError, MalformedInput, PeerUnavailable
from btnode.model.block import DiffusionBlock
from btnode.model.config import ModelConfig
from btnode.model.layout import generation_layout
from btnode.model.noise import sigma_grid
from btnode.model.sampler import READOUTS, block_denoiser, context_logits, log_probs, run_span, spans
from btnode.model.targets import target_table
from btnode.seeding import generator

log = logging.getLogger(__name__)
EMPTY_PROMPT_CONTEXT = b"\n"  # WikiText paragraphs start after a newline


@dataclass(frozen=True)
class SegmentState:
    """Everything a stage needs for one segment; z is the state at the stage's first grid point."""

    request_id: str
    context: bytes  # the clean context of this segment (already cut to the window)
    segment: int  # index within the request: keys the noise and sampling streams
    k: int
    n_steps: int
    seed: int
    temperature: float
    z: torch.Tensor  # (K, d) float32
    want_logits: bool = False
    readout: str = "last"  # "pool": every stage adds its block's context readout (sampler.sweep)
    pool: torch.Tensor | None = None  # readout "pool": Σ log-probs of the earlier blocks' readouts, (K, V)


@dataclass
class SegmentResult:
    new_bytes: bytes
    logits: torch.Tensor | None = None  # (K, V) the bytes were sampled from (pooled or last), when asked for
    route: list[str] = field(default_factory=list)  # the stages that ran this segment, in order


class Stage(Protocol):
    name: str

    def forward(self, state: SegmentState) -> SegmentResult: ...


def max_prompt(context: int, k: int) -> int:
    """Bytes of clean context a segment of k may see: its rows sit at positions c … c + k − 1 < N."""
    return context - k + 1


def check_request(cfg: ModelConfig, n_blocks: int, context: bytes, k: int, n_steps: int,
                  readout: str = "last") -> None:
    """InputError for a request no chain of this model can serve as asked."""
    if readout not in READOUTS:
        raise InputError(f"readout must be one of {list(READOUTS)}, got {readout!r}")
    if k not in cfg.segments:
        raise InputError(f"segment length K={k} was not trained; this model serves K in {list(cfg.segments)}")
    if n_steps < 2 or any(not span for span in spans(n_blocks, n_steps)):
        raise InputError(f"{n_steps} sampler steps cannot visit all {n_blocks} blocks; use at least {n_blocks}")
    limit = max_prompt(cfg.context, k)
    if len(context) > limit:
        raise InputError(f"prompt is {len(context)} bytes; with context N={cfg.context} and K={k} "
                         f"it may be at most {limit} bytes")


def sample_bytes(logits: torch.Tensor, temperature: float, g: torch.Generator) -> torch.Tensor:
    """logits (T, V) → byte ids (T,): argmax at temperature 0, else sampling (on the CPU, seeded)."""
    if temperature <= 0:
        return logits.argmax(dim=-1).cpu()
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=g)[:, 0]


def initial_state(cfg: ModelConfig, seed: int, segment: int, k: int, n_steps: int) -> torch.Tensor:
    """z at σ_hi for one segment: fresh noise keyed by (seed, segment), the same on every host."""
    grid = sigma_grid(cfg, n_steps)
    return grid[0] * torch.randn(k, cfg.d_model, generator=generator("gen-noise", seed, segment))


class LocalBlockStage:
    """Block `index` of the chain, running here. `next` is None for the last block."""

    def __init__(self, block: DiffusionBlock, index: int, n_blocks: int, *, next: Stage | None = None,
                 device: torch.device = torch.device("cpu"), name: str | None = None):
        self.block = block.to(device).eval()
        self.cfg: ModelConfig = block.cfg
        self.index, self.n_blocks = index, n_blocks
        self.next = next
        self.device = device
        self.table = target_table(self.cfg).to(device)
        self.name = name or f"block-{index}"
        if (next is None) != (index == n_blocks - 1):
            raise ValueError(f"block {index} of {n_blocks}: only the last block has no next stage")

    def validate(self, s: SegmentState) -> None:
        """Checks on a state from a peer: request settings first, then the tensor itself."""
        check_request(self.cfg, self.n_blocks, s.context, s.k, s.n_steps, s.readout)
        if not s.context:
            raise InputError("a segment needs at least one byte of context")
        if tuple(s.z.shape) != (s.k, self.cfg.d_model) or s.z.dtype != torch.float32:
            raise MalformedInput("state", f"state tensor is {s.z.dtype} {tuple(s.z.shape)}, expected float32 "
                                          f"({s.k}, {self.cfg.d_model})")
        if not math.isfinite(float(s.z.sum())) or not bool(torch.isfinite(s.z).all()):
            raise MalformedInput("nonfinite", "state tensor contains NaN or Inf")
        if not 0 <= s.temperature < 1e4 or not math.isfinite(s.temperature):
            raise InputError(f"temperature must be ≥ 0, got {s.temperature}")
        wants_pool = s.readout == "pool" and self.index > 0
        if (s.pool is not None) != wants_pool:
            raise MalformedInput("state", f"readout {s.readout!r} at block {self.index}: the pooled log-probs are "
                                          f"{'missing' if wants_pool else 'unexpected'}")
        if s.pool is not None:
            if tuple(s.pool.shape) != (s.k, self.cfg.vocab) or s.pool.dtype != torch.float32:
                raise MalformedInput("state", f"pooled log-probs are {s.pool.dtype} {tuple(s.pool.shape)}, expected "
                                              f"float32 ({s.k}, {self.cfg.vocab})")
            # a sum of log-probabilities: finite and ≤ 0 (a peer cannot push mass above certainty)
            if not bool(torch.isfinite(s.pool).all()) or bool((s.pool > 0).any()):
                raise MalformedInput("nonfinite", "pooled log-probs must be finite and ≤ 0")

    @torch.no_grad()
    def forward(self, s: SegmentState) -> SegmentResult:
        self.validate(s)
        grid = sigma_grid(self.cfg, s.n_steps)
        span = spans(self.n_blocks, s.n_steps)[self.index]
        x = torch.tensor(list(s.context), dtype=torch.long, device=self.device)[None]
        cache = self.block.encode_context(x)  # once per segment, reused by every step of the span
        layout = generation_layout(len(s.context), s.k).to(self.device)
        z, logits = run_span(block_denoiser(self.block, cache, layout), s.z.to(self.device)[None], grid, span, self.table)
        pooled = None
        if s.readout == "pool":  # the same sum, in the same order, as sampler.pool
            own = log_probs(context_logits(self.block, cache, layout))[0]
            pooled = own if s.pool is None else s.pool.to(self.device) + own
        if logits is None:
            assert self.next is not None
            result = self.next.forward(dataclasses.replace(s, z=z[0].cpu(), pool=None if pooled is None else pooled.cpu()))
            result.route.insert(0, self.name)
            return result
        if pooled is not None:
            logits = ((pooled + log_probs(logits[0])) / (self.n_blocks + 1))[None]
        ids = sample_bytes(logits[0], s.temperature, generator("gen-sample", s.seed, s.segment))
        return SegmentResult(new_bytes=bytes(ids.tolist()), logits=logits[0].cpu() if s.want_logits else None,
                             route=[self.name])


class FailoverStage:
    """The candidates for one block, primary first: a spare takes the segment when the primary is
    unavailable. Only PeerUnavailable moves on; a refused request is refused by all alike."""

    def __init__(self, candidates: Sequence[Stage]):
        if not candidates:
            raise ValueError("a failover stage needs at least one candidate")
        self.candidates = list(candidates)
        self.name = "|".join(c.name for c in self.candidates)

    def forward(self, state: SegmentState) -> SegmentResult:
        errors = []
        for i, stage in enumerate(self.candidates):
            try:
                result = stage.forward(state)
            except PeerUnavailable as exc:
                errors.append(f"{stage.name}: {exc}")
                log.warning("stage %s unavailable (%s); %s", stage.name, exc,
                            "trying the next candidate" if i + 1 < len(self.candidates) else "no candidate left")
                continue
            if i:  # keep using the one that answered
                self.candidates.insert(0, self.candidates.pop(i))
            return result
        raise PeerUnavailable("no stage for the next block answered: " + "; ".join(errors))


def local_chain(blocks: Sequence[DiffusionBlock], device: torch.device) -> LocalBlockStage:
    """All blocks in this process, linked: returns the first stage."""
    nxt: Stage | None = None
    for index in reversed(range(len(blocks))):
        nxt = LocalBlockStage(blocks[index], index, len(blocks), next=nxt, device=device)
    assert isinstance(nxt, LocalBlockStage)
    return nxt
