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
from btnode.model.block import ContextCache, DiffusionBlock
from btnode.model.config import ModelConfig
from btnode.model.layout import generation_layout, window_layout
from btnode.model.noise import generation_grid, sigma_grid
from btnode.model.sampler import (READOUTS, block_denoiser, context_logits, generation_spans, log_probs, pool,
                                   run_span, spans)
from btnode.model.targets import target_table
from btnode.seeding import generator
from btnode.serve.context_cache import (MAX_REQUEST_ID, ContextCacheConfig, ContextCacheStore, check_chunks,
                                        encode_window)

log = logging.getLogger(__name__)
EMPTY_PROMPT_CONTEXT = b"\n"  # WikiText paragraphs start after a newline
MAX_STEPS = 256  # sampler grid points per segment: far above the default 2B + 1, and a bound on a request's work
# How the last stage turns its evaluation into bytes: sampler.READOUTS ("pool", "last"), and "commit":
# the last stage commits the segment byte by byte, each next row re-read by its own block with the
# bytes committed before it as clean context (see LocalBlockStage.commit). "spec": block 0 drafts
# the segment, every block scores the draft, the last stage keeps what the pooled blocks accept (1 … K
# bytes per traversal, exactly the pool's distribution); "spec-fill" also fills the rest of the
# segment with the last block alone (K bytes per traversal). Both run no sweep (LocalBlockStage.speculate).
SPEC_READOUTS = ("spec", "spec-fill")
SERVE_READOUTS = (*READOUTS, "commit", *SPEC_READOUTS)


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
    readout: str = "last"  # "pool": every stage adds its block's context readout (sampler.sweep); "commit"
    pool: torch.Tensor | None = None  # readout "pool": Σ log-probs of the earlier blocks' readouts, (K, V)
    first_chunk: int = 0  # bytes of the window's first chunk, the rest being whole segments of K; 0: the window
    final: bool = False  # the request's last segment: stages drop its context cache after it
    use_cache: bool = True  # False: rebuild the clean stream from the window (same bits; for benchmarks)
    n_tail: int = 0  # grid points below σ_lo, run by the tail blocks (0: the sweep ends at σ_lo)
    draft: bytes = b""  # readouts "spec…", past block 0: the K bytes block 0 drafted
    draft_logp: torch.Tensor | None = None  # readouts "spec…", past block 0: block 0's log-probs of each draft row (K, V)


@dataclass
class SegmentResult:
    new_bytes: bytes
    logits: torch.Tensor | None = None  # (K, V) the bytes were sampled from (pooled or last), when asked for
    route: list[str] = field(default_factory=list)  # the stages that ran this segment, in order
    accepted: int = 0  # readouts "spec…": draft bytes the pooled blocks kept (the rest was re-sampled or filled)


class Stage(Protocol):
    name: str

    def forward(self, state: SegmentState) -> SegmentResult: ...


def max_prompt(context: int, k: int) -> int:
    """Bytes of clean context a segment of k may see: its rows sit at positions c … c + k − 1 < N."""
    return context - k + 1


def check_request(cfg: ModelConfig, n_blocks: int, context: bytes, k: int, n_steps: int,
                  readout: str = "last", n_tail: int = 0) -> None:
    """InputError for a request no chain of this model can serve as asked."""
    if readout not in SERVE_READOUTS:
        raise InputError(f"readout must be one of {list(SERVE_READOUTS)}, got {readout!r}")
    if n_tail:
        if not cfg.tail_blocks:
            raise InputError(f"{n_tail} tail steps asked, but this model has no tail blocks")
        if not cfg.tail_blocks <= n_tail <= MAX_STEPS:
            raise InputError(f"{n_tail} tail steps cannot visit the {cfg.tail_blocks} tail blocks within "
                             f"{MAX_STEPS} steps; use {cfg.tail_blocks} … {MAX_STEPS}")
        if readout in ("pool", *SPEC_READOUTS):
            raise InputError(f"readout {readout!r} reads the blocks' per-position context readouts; a sweep "
                             "through the tail reads its last evaluation (readout \"last\")")
    if readout in SPEC_READOUTS:  # no noisy segment runs: K is only how many bytes block 0 drafts
        if not 1 <= k <= cfg.context // 2:
            raise InputError(f"a draft of K={k} bytes; readout {readout!r} drafts 1 … {cfg.context // 2} (N/2)")
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


def sample_bytes(logits: torch.Tensor, temperature: float, g: torch.Generator) -> torch.Tensor:
    """logits (T, V) → byte ids (T,): argmax at temperature 0, else sampling (on the CPU, seeded)."""
    if temperature <= 0:
        return logits.argmax(dim=-1).cpu()
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=g)[:, 0]


def default_readout(n_tail: int) -> str:
    """"pool" for a sweep that ends at σ_lo (the chain is then at least an ensemble of its blocks),
    "last" through the tail (its last evaluation is the joint sample)."""
    return "last" if n_tail else "pool"


def initial_state(cfg: ModelConfig, seed: int, segment: int, k: int, n_steps: int) -> torch.Tensor:
    """z at σ_hi for one segment: fresh noise keyed by (seed, segment), the same on every host."""
    grid = sigma_grid(cfg, n_steps)
    return grid[0] * torch.randn(k, cfg.d_model, generator=generator("gen-noise", seed, segment))


class LocalBlockStage:
    """Block `index` of the chain, running here. `next` is None for the last block. With tail blocks
    the chain goes on past the last scoring block (B − 1), which then has a `next` (the first tail
    block) that only requests with tail steps reach; a tail block is reached only by those."""

    def __init__(self, block: DiffusionBlock, index: int, n_blocks: int, *, next: Stage | None = None,
                 device: torch.device = torch.device("cpu"), name: str | None = None,
                 context_cache: ContextCacheConfig = ContextCacheConfig()):
        self.block = block.to(device).eval()
        self.cfg: ModelConfig = block.cfg
        self.index, self.n_blocks = index, n_blocks
        self.next = next
        self.device = device
        self.table = target_table(self.cfg).to(device)
        self.name = name or f"block-{index}"
        self.contexts = ContextCacheStore(context_cache)  # per request: this block's clean stream of its window
        last = self.cfg.total_blocks - 1 if index >= n_blocks - 1 else n_blocks - 1
        if next is None and index != n_blocks - 1 and index != last or next is not None and index == last:
            raise ValueError(f"block {index} of {n_blocks} (+{self.cfg.tail_blocks} tail): only the last block "
                             "has no next stage")

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
        if not 0 <= s.temperature < 1e4 or not math.isfinite(s.temperature):
            raise InputError(f"temperature must be ≥ 0, got {s.temperature}")
        wants_pool = s.readout in ("pool", *SPEC_READOUTS) and self.index > 0
        if (s.pool is not None) != wants_pool:
            raise MalformedInput("state", f"readout {s.readout!r} at block {self.index}: the pooled log-probs are "
                                          f"{'missing' if wants_pool else 'unexpected'}")
        if s.pool is not None:
            self.check_log_probs(s.pool, s.k, "pooled log-probs")
        wants_draft = s.readout in SPEC_READOUTS and self.index > 0
        if bool(s.draft) != wants_draft or (s.draft_logp is not None) != wants_draft:
            raise MalformedInput("state", f"readout {s.readout!r} at block {self.index}: the draft is "
                                          f"{'missing' if wants_draft else 'unexpected'}")
        if wants_draft:
            if len(s.draft) != s.k:
                raise MalformedInput("state", f"a draft of {len(s.draft)} bytes for a segment of K={s.k}")
            self.check_log_probs(s.draft_logp, s.k, "draft log-probs")  # type: ignore[arg-type]

    def check_log_probs(self, t: torch.Tensor, k: int, what: str) -> None:
        """A (K, V) float32 sum of log-probabilities from a peer: finite and ≤ 0 (a peer cannot push
        mass above certainty)."""
        if tuple(t.shape) != (k, self.cfg.vocab) or t.dtype != torch.float32:
            raise MalformedInput("state", f"{what} are {t.dtype} {tuple(t.shape)}, expected float32 ({k}, {self.cfg.vocab})")
        if not bool(torch.isfinite(t).all()) or bool((t > 0).any()):
            raise MalformedInput("nonfinite", f"{what} must be finite and ≤ 0")

    def context(self, s: SegmentState) -> ContextCache:
        """The clean stream of s.context in its canonical chunks: the cached prefix extended by the
        chunks it lacks (normally the previous segment's bytes), or every chunk replayed."""
        first = s.first_chunk or len(s.context)
        keep = self.contexts.enabled and s.use_cache and bool(s.request_id)
        prefix = self.contexts.lookup(s.request_id, s.context, first, s.k) if keep else None
        cache = encode_window(self.block, s.context, first, s.k, self.device, prefix)
        if keep and s.final:
            self.contexts.drop(s.request_id)
        elif keep:
            self.contexts.store(s.request_id, s.context, first, s.k, cache)
        return cache

    @torch.no_grad()
    def forward(self, s: SegmentState) -> SegmentResult:
        self.validate(s)
        cache = self.context(s)  # reused by every step of the span
        if s.readout in SPEC_READOUTS:
            return self.speculate(s, cache)
        grid = generation_grid(self.cfg, s.n_steps, s.n_tail)
        span = generation_spans(self.cfg, s.n_steps, s.n_tail)[self.index]
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
        if s.readout == "commit":
            new, rows = self.commit(s, z, logits, cache, grid[span[-1]])
            return SegmentResult(new_bytes=new, logits=rows.cpu() if s.want_logits else None, route=[self.name])
        if pooled is not None:
            logits = ((pooled + log_probs(logits[0])) / (self.n_blocks + 1))[None]
        ids = sample_bytes(logits[0], s.temperature, generator("gen-sample", s.seed, s.segment))
        return SegmentResult(new_bytes=bytes(ids.tolist()), logits=logits[0].cpu() if s.want_logits else None,
                             route=[self.name])

    def commit(self, s: SegmentState, z: torch.Tensor, logits: torch.Tensor, cache: ContextCache,
               sigma: float) -> tuple[bytes, torch.Tensor]:
        """Readout "commit": a joint sample of the segment, still inside one traversal. For
        j = 0 … K − 1 this block reads rows j … K − 1 of the sweep's final state z at the last grid
        point with the j bytes committed so far appended to its clean context (the cache extended by
        one byte each time; j = 0 is the sweep's own last evaluation), pools row j with its own
        context readout at that context (mean log-probability, as readout "pool" does with every
        block's), and samples byte j. Each byte thus sees the bytes before it, as in autoregressive
        decoding, and the extra evaluations run on this stage only: no traversal is added.
        Pooling with the context readout was measured better than the last evaluation alone
        (BENCHMARKS.md, commit notes). Returns (bytes, the (K, V) log-probs they were sampled from)."""
        g = generator("gen-sample", s.seed, s.segment)
        n = len(s.context)
        sig = torch.full((1,), sigma, device=self.device)
        rows: list[torch.Tensor] = []
        out: list[int] = []
        for j in range(s.k):
            if j:
                cache = self.block.extend_context(cache, torch.tensor([[out[-1]]], device=self.device))
                layout = generation_layout(n + j, s.k - j).to(self.device)
                logits = self.block.denoise(z[:, j:], sig, cache, layout)
            own = context_logits(self.block, cache, generation_layout(n + j, 1).to(self.device))
            row = pool([own[0], logits[0, :1]])
            rows.append(row[0])
            out.append(int(sample_bytes(row, s.temperature, g)[0]))
        return bytes(out), torch.stack(rows)

    def speculate(self, s: SegmentState, cache: ContextCache) -> SegmentResult:
        """Readouts "spec" and "spec-fill": blockwise speculative decoding inside one traversal, no sweep.

        Block 0 drafts the K bytes autoregressively from its own context readout (sampling at the
        request's temperature) and sends them on with its log-probs of each draft row. Every later
        block reads the draft in one batched call, its context readout of row j seeing the
        context and draft bytes < j, and adds its log-probs to the pool. The last stage then has,
        for every row, the draft's distribution q and the pooled distribution p of all B blocks
        (the same log-linear pool `pool` forms), and keeps the draft's longest prefix that
        speculative sampling accepts (`accept_draft`: exactly a sequential sample of p). At the
        first rejection it samples the replacement from the residual. "spec" stops there: 1 … K
        bytes per traversal, every one of them distributed as sampling the pool byte by byte would
        give. "spec-fill" fills the bytes after the replacement with its own block's context
        readout, byte by byte: K bytes per traversal, but those filled bytes are one block's
        reading, not the pool's (what that costs is measured in BENCHMARKS.md)."""
        n = len(s.context)
        if self.index == 0:
            draft, q = self.autoregress(cache, n, s.k, s.temperature, generator("spec-draft", s.seed, s.segment))
            total = q
        else:
            assert s.pool is not None and s.draft_logp is not None
            draft, q = s.draft, s.draft_logp.to(self.device)
            total = s.pool.to(self.device) + self.read_draft(cache, n, draft)
        if self.next is not None and self.index < self.n_blocks - 1:
            result = self.next.forward(dataclasses.replace(s, draft=draft, draft_logp=q.cpu(), pool=total.cpu()))
            result.route.insert(0, self.name)
            return result
        g = generator("gen-sample", s.seed, s.segment)
        pooled = total / self.n_blocks
        kept, fix = accept_draft(pooled, q, draft, s.temperature, g)
        out = bytes(draft[:kept])
        if fix is not None:
            out += bytes([fix])
            if s.readout == "spec-fill" and len(out) < s.k:
                grown = self.block.extend_context(cache, torch.tensor([list(out)], device=self.device))
                rest, _ = self.autoregress(grown, n + len(out), s.k - len(out), s.temperature, g)
                out += rest
        return SegmentResult(new_bytes=out, logits=pooled.cpu() if s.want_logits else None, route=[self.name],
                             accepted=kept)

    def autoregress(self, cache: ContextCache, n: int, count: int, temperature: float,
                    g: torch.Generator) -> tuple[bytes, torch.Tensor]:
        """`count` bytes after the n bytes of `cache`, one at a time from this block's context
        readout, each appended to the context before the next. Returns (bytes, (count, V) log-probs
        they were sampled from)."""
        rows: list[torch.Tensor] = []
        out: list[int] = []
        for j in range(count):
            if j:
                cache = self.block.extend_context(cache, torch.tensor([[out[-1]]], device=self.device))
            row = log_probs(context_logits(self.block, cache, generation_layout(n + j, 1).to(self.device)))[0]
            rows.append(row[0])
            out.append(int(sample_bytes(row, temperature, g)[0]))
        return bytes(out), torch.stack(rows)

    def read_draft(self, cache: ContextCache, n: int, draft: bytes) -> torch.Tensor:
        """This block's context readout of every draft row in one call: row j sees the n context
        bytes and draft[:j]. (K, V) log-probs."""
        k = len(draft)
        if k > 1:
            cache = self.block.extend_context(cache, torch.tensor([list(draft[:-1])], device=self.device))
        layout = window_layout(n + k - 1, 1, 0, start=n - 1).to(self.device)  # rows n − 1 … n + k − 2, K = 1 each
        return log_probs(context_logits(self.block, cache, layout))[0]


def accept_draft(target: torch.Tensor, draft_logp: torch.Tensor, draft: bytes, temperature: float,
                 g: torch.Generator) -> tuple[int, int | None]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) of a whole draft: row j's
    draft byte, drawn from q_j = softmax(draft_logp_j / T), is kept with probability
    min(1, p_j / q_j) for the target p_j = softmax(target_j / T); at the first rejection the
    replacement is drawn from the residual max(0, p_j − q_j). The kept prefix plus the
    replacement is then distributed exactly as bytes drawn one by one from p. At temperature 0,
    a byte is kept iff it is p_j's argmax, and the replacement is that argmax.
    Returns (bytes kept, replacement or None when the whole draft is kept)."""
    if temperature <= 0:
        for j, byte in enumerate(draft):
            best = int(target[j].argmax())
            if best != byte:
                return j, best
        return len(draft), None
    p = torch.softmax(target.double().cpu() / temperature, dim=-1)
    q = torch.softmax(draft_logp.double().cpu() / temperature, dim=-1)
    u = torch.rand(len(draft), generator=g, dtype=torch.float64)  # one draw per row, used or not
    for j, byte in enumerate(draft):
        if u[j] * q[j, byte] < p[j, byte]:
            continue
        residual = (p[j] - q[j]).clamp(min=0)
        if float(residual.sum()) <= 0:  # p_j = q_j to the last bit: a rejection has probability 0
            residual = p[j]
        return j, int(torch.multinomial(residual / residual.sum(), 1, generator=g)[0])
    return len(draft), None


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


def local_chain(blocks: Sequence[DiffusionBlock], device: torch.device,
                context_cache: ContextCacheConfig = ContextCacheConfig()) -> LocalBlockStage:
    """All blocks in this process, linked: returns the first stage. `blocks` are the B scoring
    blocks, or all B + T blocks of a model with a tail."""
    cfg = blocks[0].cfg
    if len(blocks) not in (cfg.n_blocks, cfg.total_blocks):
        raise ValueError(f"a chain of {len(blocks)} blocks for a model of {cfg.n_blocks} (+{cfg.tail_blocks} tail)")
    nxt: Stage | None = None
    for index in reversed(range(len(blocks))):
        nxt = LocalBlockStage(blocks[index], index, cfg.n_blocks, next=nxt, device=device, context_cache=context_cache)
    assert isinstance(nxt, LocalBlockStage)
    return nxt
