"""The one-sweep chain (design §4): a `Stage` takes the state of one segment, runs the grid
points its block owns on the whole segment, and hands the state to the next stage; the last
stage reads the bytes with the segment's readout (serve/readouts.py). `LocalBlockStage` computes;
`FailoverStage` tries the candidates for the next block in order (a spare takes over when the
primary is unavailable); rpc/ adds a remote stage.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from btnode.errors import BtnodeError, InputError, MalformedInput, PeerUnavailable, StageTimeout
from btnode.model.block import ContextCache, DiffusionBlock
from btnode.model.config import ModelConfig
from btnode.model.layout import generation_layout
from btnode.model.noise import generation_grid, sigma_grid
from btnode.model.readout import Readout, default_readout
from btnode.model.sampler import block_denoiser, generation_spans, run_span, spans
from btnode.model.targets import target_table
from btnode.seeding import generator
from btnode.store.files import state_sha256
from btnode.serve.context_cache import (MAX_REQUEST_ID, ContextCacheConfig, ContextCacheStore, check_chunks,
                                        encode_window)
from btnode.serve.defaults import ServingDefaults, serving_defaults
from btnode.serve.identity import Origin, Weights
from btnode.serve.readouts import (NO_CARRY, READERS, Carry, Evaluation, add_context_readout, check_carry, draft,
                                   score_draft)

log = logging.getLogger(__name__)
EMPTY_PROMPT_CONTEXT = b"\n"  # WikiText paragraphs start after a newline
MAX_STEPS = 256  # sampler grid points per segment: far above the default 2B + 1, and a bound on a request's work


@dataclass(frozen=True)
class SegmentState:
    """Everything a stage needs for one segment; z is the state at the stage's first grid point.
    `readout` may be given as its string: it is parsed (InputError for an unknown one)."""

    request_id: str
    context: bytes  # the clean context of this segment (already cut to the window)
    segment: int  # index within the request: keys the noise and sampling streams
    k: int
    n_steps: int
    seed: int
    temperature: float
    z: torch.Tensor  # (K, d) float32
    readout: Readout  # how the last stage turns the traversal into bytes (serve/readouts.py)
    want_logits: bool = False
    first_chunk: int = 0  # bytes of the window's first chunk, the rest being whole segments of K; 0: the window
    final: bool = False  # the request's last segment: stages drop its context cache after it
    use_cache: bool = True  # False: rebuild the clean stream from the window (same bits; for benchmarks)
    n_tail: int = 0  # grid points below σ_lo, run by the tail blocks (0: the sweep ends at σ_lo)
    carry: Carry = NO_CARRY  # the readout's payload from the earlier blocks (pooled sum, draft)

    def __post_init__(self) -> None:
        object.__setattr__(self, "readout", Readout.parse(self.readout))


@dataclass
class SegmentResult:
    new_bytes: bytes
    logits: torch.Tensor | None = None  # (K, V) the bytes were sampled from (pooled or last), when asked for
    route: list[str] = field(default_factory=list)  # the stages that ran this segment, in order
    accepted: int = 0  # readouts "spec…": draft bytes the pooled blocks kept (the rest was re-sampled or filled)


class Stage(Protocol):
    name: str

    def forward(self, state: SegmentState) -> SegmentResult: ...


def weights_of(stage: object) -> Weights | None:
    """The weights of the chain from `stage` on, when it can tell (a stage without `weights`, or a
    remote one that does not answer or is too old to say: None)."""
    weights = getattr(stage, "weights", None)
    return weights() if weights is not None else None


class UnitWeights:
    """A stage's own unit: where it came from, and its canonical state hash (computed once: a stage
    never changes its weights while it serves)."""

    def __init__(self, module: torch.nn.Module, origin: Origin):
        self.module, self.origin = module, origin
        self._sha256: str | None = None

    def own(self) -> Weights:
        if self._sha256 is None:
            self._sha256 = state_sha256(self.module.state_dict())
        return Weights(name=self.origin.name, version=self.origin.version, units=(self._sha256,))


def max_prompt(context: int, k: int) -> int:
    """Bytes of clean context a segment of k may see: its rows sit at positions c … c + k − 1 < N."""
    return context - k + 1


def check_request(cfg: ModelConfig, n_blocks: int, context: bytes, k: int, n_steps: int,
                  readout: Readout | None = None, n_tail: int = 0) -> None:
    """InputError for segment settings no chain of this model can serve as asked (readout None:
    `default_readout(n_tail)`)."""
    readout = readout or default_readout(n_tail)
    if n_tail:
        if not cfg.tail_blocks:
            raise InputError(f"{n_tail} tail steps asked, but this model has no tail blocks")
        if not cfg.tail_blocks <= n_tail <= MAX_STEPS:
            raise InputError(f"{n_tail} tail steps cannot visit the {cfg.tail_blocks} tail blocks within "
                             f"{MAX_STEPS} steps; use {cfg.tail_blocks} … {MAX_STEPS}")
        if readout.pools:
            raise InputError(f"readout {readout.value!r} reads the blocks' per-position context readouts; a sweep "
                             "through the tail reads its last evaluation (readout \"last\")")
    if readout.drafts:  # no noisy segment runs: K is only how many bytes block 0 drafts
        if not 1 <= k <= cfg.context // 2:
            raise InputError(f"a draft of K={k} bytes; readout {readout.value!r} drafts 1 … {cfg.context // 2} (N/2)")
    elif k not in cfg.segments:
        raise InputError(f"segment length K={k} was not trained; this model serves K in {list(cfg.segments)}")
    if n_steps > MAX_STEPS:
        raise InputError(f"{n_steps} sampler steps per segment is more than a stage runs (at most {MAX_STEPS})")
    if n_steps < 2 or any(not span for span in spans(n_blocks, n_steps)):
        raise InputError(f"{n_steps} sampler steps cannot visit all {n_blocks} blocks; use at least {n_blocks}")
    limit = max_prompt(cfg.context, k)
    if len(context) > limit:
        raise InputError(f"prompt is {len(context)} bytes; with context N={cfg.context} and K={k} "
                         f"it may be at most {limit} bytes")


def check_temperature(t: float) -> None:
    if not 0 <= t < 1e4 or not math.isfinite(t):
        raise InputError(f"temperature must be ≥ 0, got {t}")


def initial_state(cfg: ModelConfig, seed: int, segment: int, k: int, n_steps: int) -> torch.Tensor:
    """z at σ_hi for one segment: fresh noise keyed by (seed, segment), the same on every host."""
    grid = sigma_grid(cfg, n_steps)
    return grid[0] * torch.randn(k, cfg.d_model, generator=generator("gen-noise", seed, segment))


class LocalBlockStage:
    """Block `index` of the chain, running here: its block, its context cache and its next hop;
    what a readout does is serve/readouts.py's. `next` is None for the last block. With tail blocks
    the chain goes on past the last scoring block (B − 1), which then has a `next` (the first tail
    block) that only requests with tail steps reach; a tail block is reached only by those."""

    def __init__(self, block: DiffusionBlock, index: int, n_blocks: int, *, next: Stage | None = None,
                 device: torch.device = torch.device("cpu"), name: str | None = None,
                 context_cache: ContextCacheConfig = ContextCacheConfig(), defaults: ServingDefaults | None = None,
                 origin: Origin = Origin()):
        self.block = block.to(device).eval()
        self.unit = UnitWeights(self.block, origin)
        self.cfg: ModelConfig = block.cfg
        self.index, self.n_blocks = index, n_blocks
        self.next = next
        self.device = device
        self.table = target_table(self.cfg).to(device)
        self.name = name or f"block-{index}"
        self.contexts = ContextCacheStore(context_cache)  # per request: this block's clean stream of its window
        self.defaults = defaults or serving_defaults(self.cfg)  # what the entry fills into a request's unset fields
        last = self.cfg.total_blocks - 1 if index >= n_blocks - 1 else n_blocks - 1
        if next is None and index != n_blocks - 1 and index != last or next is not None and index == last:
            raise ValueError(f"block {index} of {n_blocks} (+{self.cfg.tail_blocks} tail): only the last block "
                             "has no next stage")

    def weights(self) -> Weights | None:
        """This block's weights followed by those of the blocks after it (None: some are unknown)."""
        own = self.unit.own()
        return own if self.next is None else own.then(weights_of(self.next))

    def validate(self, s: SegmentState) -> None:
        """Checks on a state from a peer: request settings first, then the tensor itself."""
        check_request(self.cfg, self.n_blocks, s.context, s.k, s.n_steps, s.readout, s.n_tail)
        if self.index >= self.n_blocks and not s.n_tail:
            raise InputError(f"tail block {self.index} runs only requests with tail steps")
        if s.n_tail and self.index == self.n_blocks - 1 and self.next is None:
            raise InputError("this chain has no tail stage: ask for 0 tail steps")
        if not s.context:
            raise InputError("a segment needs at least one byte of context")
        if len(s.request_id) > MAX_REQUEST_ID:
            raise InputError(f"request id of {len(s.request_id)} characters; at most {MAX_REQUEST_ID}")
        check_chunks(len(s.context), s.first_chunk or len(s.context), s.k)
        if tuple(s.z.shape) != (s.k, self.cfg.d_model) or s.z.dtype != torch.float32:
            raise MalformedInput("state", f"state tensor is {s.z.dtype} {tuple(s.z.shape)}, expected float32 "
                                          f"({s.k}, {self.cfg.d_model})")
        if not math.isfinite(float(s.z.sum())) or not bool(torch.isfinite(s.z).all()):
            raise MalformedInput("nonfinite", "state tensor contains NaN or Inf")
        check_temperature(s.temperature)
        check_carry(s.readout, self.index, s.k, self.cfg.vocab, s.carry)

    def context(self, s: SegmentState) -> ContextCache:
        """The clean stream of s.context in its canonical chunks: the cached prefix extended by the
        chunks it lacks (normally the previous segment's bytes), or every chunk replayed."""
        first = s.first_chunk or len(s.context)
        keep = self.contexts.enabled and s.use_cache and bool(s.request_id) and not s.readout.drafts  # canonical chunks only
        prefix = self.contexts.lookup(s.request_id, s.context, first, s.k) if keep else None
        cache = encode_window(self.block, s.context, first, s.k, self.device, prefix)
        if keep and s.final:
            self.contexts.drop(s.request_id)
        elif keep:
            self.contexts.store(s.request_id, s.context, first, s.k, cache)
        return cache

    def forward(self, s: SegmentState) -> SegmentResult:
        out = self.step(s)
        return out if isinstance(out, SegmentResult) else self.pass_on(out)

    def forward_batch(self, states: Sequence[SegmentState]) -> list[SegmentResult | BtnodeError]:
        """Several requests' segments in one traversal (serve/batching.py): this block's part for all
        of them (the spec readout's batched, the rest one by one), then one batch to the next stage.
        A request refused or failed here or further down gets its error; the others go on."""
        from btnode.serve.batching import forward_batch, spec_steps  # batching builds on this module

        outs: list[SegmentState | SegmentResult | BtnodeError] = spec_steps(self, states)
        onward = [i for i, o in enumerate(outs) if isinstance(o, SegmentState)]
        if onward:
            assert self.next is not None
            for i, r in zip(onward, forward_batch(self.next, [outs[i] for i in onward])):  # type: ignore[misc]
                if isinstance(r, SegmentResult):
                    r.route.insert(0, self.name)
                outs[i] = r
        return outs  # type: ignore[return-value]

    @torch.no_grad()
    def step(self, s: SegmentState) -> SegmentState | SegmentResult:
        """This block's part of one segment: the state for the next stage, or the segment's result."""
        self.validate(s)
        cache = self.context(s)  # reused by every step of the span
        if s.readout.drafts:  # no sweep: block 0 drafts the segment, every later block scores the draft
            carry = (draft(self.block, cache, s.k, s.temperature, generator("spec-draft", s.seed, s.segment))
                     if self.index == 0 else score_draft(self.block, cache, s.carry))
            if self.passes_drafts_on:
                return dataclasses.replace(s, carry=carry.cpu())
            ev = Evaluation(block=self.block, cache=cache, k=s.k, n_blocks=self.n_blocks, carry=carry)
        else:
            grid = generation_grid(self.cfg, s.n_steps, s.n_tail)
            span = generation_spans(self.cfg, s.n_steps, s.n_tail)[self.index]
            layout = generation_layout(len(s.context), s.k).to(self.device)
            z, logits = run_span(block_denoiser(self.block, cache, layout), s.z.to(self.device)[None], grid, span,
                                 self.table)
            carry = add_context_readout(self.block, cache, layout, s.carry) if s.readout is Readout.POOL else NO_CARRY
            if logits is None:
                return dataclasses.replace(s, z=z[0].cpu(), carry=carry.cpu())
            ev = Evaluation(block=self.block, cache=cache, k=s.k, n_blocks=self.n_blocks, carry=carry, z=z,
                            logits=logits, sigma=grid[span[-1]])
        return self.read(s, ev)

    @property
    def passes_drafts_on(self) -> bool:
        """A spec segment goes on from here (every scoring block but the last scores the draft)."""
        return self.next is not None and self.index < self.n_blocks - 1

    def read(self, s: SegmentState, ev: Evaluation) -> SegmentResult:
        """The last stage: the segment's bytes, read as its readout says."""
        reading = READERS[s.readout](ev, s.temperature, generator("gen-sample", s.seed, s.segment))
        return SegmentResult(new_bytes=reading.new_bytes, logits=reading.logits.cpu() if s.want_logits else None,
                             route=[self.name], accepted=reading.accepted)

    def pass_on(self, s: SegmentState) -> SegmentResult:
        """The segment's state to the next stage; its result, with this stage first on the route."""
        assert self.next is not None
        result = self.next.forward(s)
        result.route.insert(0, self.name)
        return result


class FailoverStage:
    """The candidates for one block, primary first: a spare takes the segment when the primary is
    unavailable. Only PeerUnavailable moves on; a refused request is refused by all alike."""

    def __init__(self, candidates: Sequence[Stage]):
        if not candidates:
            raise ValueError("a failover stage needs at least one candidate")
        self.candidates = list(candidates)
        self.name = "|".join(c.name for c in self.candidates)

    def weights(self) -> Weights | None:
        """The weights of the first candidate that can tell."""
        for stage in self.candidates:
            try:
                if (w := weights_of(stage)) is not None:
                    return w
            except PeerUnavailable as exc:
                log.info("stage %s did not say which weights it serves: %s", stage.name, exc)
        return None

    def forward(self, state: SegmentState) -> SegmentResult:
        errors, timeouts = [], 0
        for i, stage in enumerate(self.candidates):
            try:
                result = stage.forward(state)
            except PeerUnavailable as exc:
                errors.append(f"{stage.name}: {exc}")
                timeouts += isinstance(exc, StageTimeout)
                log.warning("stage %s unavailable (%s); %s", stage.name, exc,
                            "trying the next candidate" if i + 1 < len(self.candidates) else "no candidate left")
                continue
            if i:  # keep using the one that answered
                self.candidates.insert(0, self.candidates.pop(i))
            return result
        message = "no stage for the next block answered: " + "; ".join(errors)
        raise StageTimeout(message) if timeouts == len(errors) else PeerUnavailable(message)

    def forward_batch(self, states: Sequence[SegmentState]) -> list[SegmentResult | BtnodeError]:
        """The batch to the first candidate that answers; segments it answers unavailable (a stage
        further down gone) go on to the next candidate, as one segment would."""
        from btnode.serve.batching import forward_batch

        out: list[SegmentResult | BtnodeError | None] = [None] * len(states)
        errors: list[list[PeerUnavailable]] = [[] for _ in states]
        todo = list(range(len(states)))
        for i, stage in enumerate(self.candidates):
            try:
                results: list[SegmentResult | BtnodeError] = forward_batch(stage, [states[j] for j in todo])
            except PeerUnavailable as exc:
                log.warning("stage %s unavailable (%s) for a batch of %d", stage.name, exc, len(todo))
                results = [exc] * len(todo)
            retry = []
            for j, r in zip(todo, results):
                if isinstance(r, PeerUnavailable):
                    errors[j].append(r)
                    retry.append(j)
                else:
                    out[j] = r
            if i and len(retry) < len(todo):  # keep using the one that answered
                self.candidates.insert(0, self.candidates.pop(i))
            todo = retry
            if not todo:
                break
        for j in todo:
            message = "no stage for the next block answered: " + "; ".join(str(e) for e in errors[j])
            timeouts = all(isinstance(e, StageTimeout) for e in errors[j])
            out[j] = StageTimeout(message) if timeouts else PeerUnavailable(message)
        return out  # type: ignore[return-value]


def local_chain(blocks: Sequence[DiffusionBlock], device: torch.device,
                context_cache: ContextCacheConfig = ContextCacheConfig(), origin: Origin = Origin()) -> LocalBlockStage:
    """All blocks in this process, linked: returns the first stage. `blocks` are the B scoring
    blocks, or all B + T blocks of a model with a tail."""
    cfg = blocks[0].cfg
    if len(blocks) not in (cfg.n_blocks, cfg.total_blocks):
        raise ValueError(f"a chain of {len(blocks)} blocks for a model of {cfg.n_blocks} (+{cfg.tail_blocks} tail)")
    nxt: Stage | None = None
    for index in reversed(range(len(blocks))):
        nxt = LocalBlockStage(blocks[index], index, cfg.n_blocks, next=nxt, device=device, context_cache=context_cache,
                              origin=origin)
    assert isinstance(nxt, LocalBlockStage)
    return nxt
