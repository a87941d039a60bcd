"""The readouts of the one-sweep chain (model/readout.py), as pure functions: what each block adds
to a segment's `Carry` on its way down the chain, and one reader per readout that turns what the
last stage holds (`Evaluation`) into the segment's bytes (`READERS`). A stage (serve/stages.py)
only runs its span and calls these; `accept_draft` is the speculative sampling the spec readouts use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from btnode.errors import MalformedInput
from btnode.model.block import ContextCache, DiffusionBlock
from btnode.model.layout import Layout, generation_layout, window_layout
from btnode.model.readout import Readout
from btnode.model.sampler import context_logits, log_probs, pool


@dataclass(frozen=True)
class Carry:
    """What a block hands the next one beside the state z, for the readouts that need it: nothing
    at block 0, nor ever for LAST and COMMIT."""

    pool: torch.Tensor | None = None  # POOL, SPEC…: Σ log-probs of the earlier blocks' readouts (K, V)
    draft: bytes = b""  # SPEC…: the K bytes block 0 drafted
    draft_logp: torch.Tensor | None = None  # SPEC…: block 0's log-probs of each draft row (K, V)

    def cpu(self) -> Carry:
        """The same carry with its tensors on the CPU, as it crosses to the next stage."""
        return Carry(pool=None if self.pool is None else self.pool.cpu(), draft=self.draft,
                     draft_logp=None if self.draft_logp is None else self.draft_logp.cpu())


NO_CARRY = Carry()


def check_log_probs(t: torch.Tensor, k: int, vocab: int, what: str) -> None:
    """A (K, V) float32 sum of log-probabilities from a peer: finite and ≤ 0 (a peer cannot push
    mass above certainty)."""
    if tuple(t.shape) != (k, vocab) or t.dtype != torch.float32:
        raise MalformedInput("state", f"{what} are {t.dtype} {tuple(t.shape)}, expected float32 ({k}, {vocab})")
    if not bool(torch.isfinite(t).all()) or bool((t > 0).any()):
        raise MalformedInput("nonfinite", f"{what} must be finite and ≤ 0")


def check_carry(readout: Readout, index: int, k: int, vocab: int, carry: Carry) -> None:
    """The carry block `index` may receive for this readout, and nothing else: the pooled sum past
    block 0 for POOL and SPEC…, the draft and its log-probs past block 0 for SPEC…."""
    wants_pool = readout.pools and index > 0
    if (carry.pool is not None) != wants_pool:
        raise MalformedInput("state", f"readout {readout.value!r} at block {index}: the pooled log-probs are "
                                      f"{'missing' if wants_pool else 'unexpected'}")
    if carry.pool is not None:
        check_log_probs(carry.pool, k, vocab, "pooled log-probs")
    wants_draft = readout.drafts and index > 0
    if bool(carry.draft) != wants_draft or (carry.draft_logp is not None) != wants_draft:
        raise MalformedInput("state", f"readout {readout.value!r} at block {index}: the draft is "
                                      f"{'missing' if wants_draft else 'unexpected'}")
    if carry.draft_logp is not None:
        if len(carry.draft) != k:
            raise MalformedInput("state", f"a draft of {len(carry.draft)} bytes for a segment of K={k}")
        check_log_probs(carry.draft_logp, k, vocab, "draft log-probs")


def sample_bytes(logits: torch.Tensor, temperature: float, g: torch.Generator) -> torch.Tensor:
    """logits (T, V) → byte ids (T,): argmax at temperature 0, else sampling (on the CPU, seeded)."""
    if temperature <= 0:
        return logits.argmax(dim=-1).cpu()
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=g)[:, 0]


# What each block adds on the way down.

def add_context_readout(block: DiffusionBlock, cache: ContextCache, layout: Layout, carry: Carry) -> Carry:
    """Readout POOL, at every block: its context readout's log-probs added to the sum so far (the
    same sum, in the same order, as sampler.pool)."""
    own = log_probs(context_logits(block, cache, layout))[0]
    return Carry(pool=own if carry.pool is None else carry.pool.to(own.device) + own)


def autoregress(block: DiffusionBlock, cache: ContextCache, count: int, temperature: float,
                g: torch.Generator) -> tuple[bytes, torch.Tensor]:
    """`count` bytes after the context of `cache`, one at a time from the block's context readout,
    each appended to the context before the next. Returns (bytes, (count, V) log-probs they were
    sampled from)."""
    device = cache.out.device
    rows: list[torch.Tensor] = []
    out: list[int] = []
    for j in range(count):
        if j:
            cache = block.extend_context(cache, torch.tensor([[out[-1]]], device=device))
        row = log_probs(context_logits(block, cache, generation_layout(cache.n_clean, 1).to(device)))[0]
        rows.append(row[0])
        out.append(int(sample_bytes(row, temperature, g)[0]))
    return bytes(out), torch.stack(rows)


def draft(block: DiffusionBlock, cache: ContextCache, k: int, temperature: float, g: torch.Generator) -> Carry:
    """Readouts SPEC…, block 0: the K bytes it drafts autoregressively from its context readout
    (at the request's temperature), its log-probs of each draft row, and those as the pool so far."""
    drafted, q = autoregress(block, cache, k, temperature, g)
    return Carry(pool=q, draft=drafted, draft_logp=q)


def read_draft(block: DiffusionBlock, cache: ContextCache, drafted: bytes) -> torch.Tensor:
    """The block's context readout of every draft row in one call: row j sees the context of
    `cache` and drafted[:j]. (K, V) log-probs."""
    n, k = cache.n_clean, len(drafted)
    device = cache.out.device
    if k > 1:
        cache = block.extend_context(cache, torch.tensor([list(drafted[:-1])], device=device))
    layout = window_layout(n + k - 1, 1, 0, start=n - 1).to(device)  # rows n − 1 … n + k − 2, K = 1 each
    return log_probs(context_logits(block, cache, layout))[0]


def score_draft(block: DiffusionBlock, cache: ContextCache, carry: Carry) -> Carry:
    """Readouts SPEC…, every block after block 0: its reading of the draft added to the pool."""
    assert carry.pool is not None and carry.draft_logp is not None
    device = cache.out.device
    return Carry(pool=carry.pool.to(device) + read_draft(block, cache, carry.draft), draft=carry.draft,
                 draft_logp=carry.draft_logp.to(device))


# What the last stage does with it: one reader per readout.

@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """What the last stage holds when a segment's traversal ends: the input of a reader."""

    block: DiffusionBlock  # the last stage's block (COMMIT and SPEC_FILL read more with it)
    cache: ContextCache  # its clean stream of the segment's context
    k: int  # bytes in the segment (SPEC…: the draft length)
    n_blocks: int  # B scoring blocks: the pool's divisor
    carry: Carry = NO_CARRY  # what the blocks handed down, this block's own term included
    z: torch.Tensor | None = None  # (1, K, d) the sweep's state at its last grid point; None: no sweep ran
    logits: torch.Tensor | None = None  # (1, K, V) the evaluation at that grid point
    sigma: float = 0.0  # σ of that grid point


class Reading(NamedTuple):
    new_bytes: bytes
    logits: torch.Tensor  # (K, V) the rows the bytes were sampled from
    accepted: int = 0  # SPEC…: draft bytes the pooled blocks kept


def read_last(ev: Evaluation, temperature: float, g: torch.Generator) -> Reading:
    """LAST: the segment sampled from the sweep's last evaluation."""
    assert ev.logits is not None
    rows = ev.logits[0]
    return Reading(bytes(sample_bytes(rows, temperature, g).tolist()), rows)


def read_pool(ev: Evaluation, temperature: float, g: torch.Generator) -> Reading:
    """POOL: the last evaluation pooled with every block's context readout (mean log-probability:
    the B terms summed hop by hop, then this one, divided once, as sampler.pool does)."""
    assert ev.logits is not None and ev.carry.pool is not None
    rows = (ev.carry.pool + log_probs(ev.logits[0])) / (ev.n_blocks + 1)
    return Reading(bytes(sample_bytes(rows, temperature, g).tolist()), rows)


def read_commit(ev: Evaluation, temperature: float, g: torch.Generator) -> Reading:
    """COMMIT: a joint sample of the segment, still inside one traversal. For j = 0 … K − 1 the
    last block reads rows j … K − 1 of the sweep's final state z at the last grid point with the j
    bytes committed so far appended to its clean context (the cache extended by one byte each time;
    j = 0 is the sweep's own last evaluation), pools row j with its own context readout at that
    context (mean log-probability, as POOL does with every block's), and samples byte j. Each byte
    thus sees the bytes before it, as in autoregressive decoding, and the extra evaluations run on
    this stage only: no traversal is added. Pooling with the context readout was measured better
    than the last evaluation alone (BENCHMARKS.md, commit notes)."""
    assert ev.z is not None and ev.logits is not None
    block, cache, logits = ev.block, ev.cache, ev.logits
    n, device = cache.n_clean, cache.out.device
    sig = torch.full((1,), ev.sigma, device=device)
    rows: list[torch.Tensor] = []
    out: list[int] = []
    for j in range(ev.k):
        if j:
            cache = block.extend_context(cache, torch.tensor([[out[-1]]], device=device))
            layout = generation_layout(n + j, ev.k - j).to(device)
            logits = block.denoise(ev.z[:, j:], sig, cache, layout)
        own = context_logits(block, cache, generation_layout(n + j, 1).to(device))
        row = pool([own[0], logits[0, :1]])
        rows.append(row[0])
        out.append(int(sample_bytes(row, temperature, g)[0]))
    return Reading(bytes(out), torch.stack(rows))


def read_spec(ev: Evaluation, temperature: float, g: torch.Generator) -> Reading:
    """SPEC: blockwise speculative decoding inside one traversal, no sweep. For every row the last
    stage has the draft's distribution q (block 0's) and the pooled distribution p of all B blocks'
    readings of the draft (the log-linear pool `pool` forms), and keeps the draft's longest prefix
    that speculative sampling accepts (`accept_draft`: exactly a sequential sample of p), then the
    replacement sampled at the first rejection: 1 … K bytes, each distributed as sampling the pool
    byte by byte would give."""
    assert ev.carry.pool is not None and ev.carry.draft_logp is not None
    pooled = ev.carry.pool / ev.n_blocks
    kept, fix = accept_draft(pooled, ev.carry.draft_logp, ev.carry.draft, temperature, g)
    return Reading(bytes(ev.carry.draft[:kept]) + (b"" if fix is None else bytes([fix])), pooled, kept)


def read_spec_fill(ev: Evaluation, temperature: float, g: torch.Generator) -> Reading:
    """SPEC_FILL: SPEC, then the bytes after a replacement filled by the last block's own context
    readout, byte by byte: K bytes per traversal, but the filled ones are one block's reading, not
    the pool's (what that costs is measured in BENCHMARKS.md)."""
    spec = read_spec(ev, temperature, g)
    if len(spec.new_bytes) == ev.k:  # the whole draft kept
        return spec
    grown = ev.block.extend_context(ev.cache, torch.tensor([list(spec.new_bytes)], device=ev.cache.out.device))
    rest, _ = autoregress(ev.block, grown, ev.k - len(spec.new_bytes), temperature, g)
    return spec._replace(new_bytes=spec.new_bytes + rest)


Reader = Callable[[Evaluation, float, torch.Generator], Reading]  # (evaluation, temperature, sampling stream)
READERS: dict[Readout, Reader] = {Readout.POOL: read_pool, Readout.LAST: read_last, Readout.COMMIT: read_commit,
                                  Readout.SPEC: read_spec, Readout.SPEC_FILL: read_spec_fill}
if set(READERS) != set(Readout):  # a readout added to the enum needs its reader here
    raise ImportError(f"readouts without a reader: {sorted(set(Readout) - set(READERS))}")


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
