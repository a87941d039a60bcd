"""Continuous batching across the chain: `BatchingStage` sits at the entry and sends the segments
of every request waiting at that moment through the chain in one traversal; a request that arrives
while a traversal runs joins the next one. Each request keeps its own driver loop (serve/driver.py),
so its K, seed, temperature, readout and stop stay its own. `spec_steps` is a block's batched part:
the spec readout's drafting and scoring run as one (R, …) batch over requests of different context
lengths (`DiffusionBlock.extend_rows`, `RowLayout`), and so do the sweeps of the pool and last
readouts (one K, step count and tail); commit and spec-fill run request by request. The AR
chain's entry batches the same way: each stage runs the one new row of every request in plain
decoding as one batch (`LocalARStage.forward_batch`, `kvcache.extend_each`).

What limits a batch: max_batch (64 segments per traversal), the stage's threads (one per open
request), the CPU time of a batch (it grows with R · K once the matrices stop being tiny), and the
memory of a batch's caches, R · N · d · 2L floats per block (about 1 MiB at R = 64, N = 128, d = 128).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from btnode.errors import BtnodeError
from btnode.model.block import ContextCache, DiffusionBlock
from btnode.model.layout import row_layouts
from btnode.model.noise import generation_grid
from btnode.model.readout import Readout
from btnode.model.sampler import block_denoiser, context_logits, generation_spans, log_probs, run_span
from btnode.protocol import Meter
from btnode.seeding import generator
from btnode.serve.readouts import NO_CARRY, Carry, Evaluation, sample_bytes
from btnode.serve.stages import LocalBlockStage, SegmentResult, SegmentState, Stage

log = logging.getLogger(__name__)
MAX_BATCH = 64  # segments per traversal
# how long a traversal waits at most for the requests of the last one to send their next segment: it ends
# as soon as all of them are in, so the bound binds only on a request that left (or a driver held up)
GATHER_S = 0.010
_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="batch-hop")  # a batch to a stage without forward_batch

Outcome = SegmentResult | BtnodeError


def _one(stage: Stage, state: SegmentState) -> Outcome:
    try:
        return stage.forward(state)
    except BtnodeError as exc:
        return exc


def forward_batch(stage: Stage, states: Sequence[SegmentState]) -> list[Outcome]:
    """One traversal for all `states` from `stage` on: its own forward_batch when it has one, else
    (a remote stage, a failover set) one call per state, concurrently."""
    batched = getattr(stage, "forward_batch", None)
    if batched is not None:
        return batched(states)
    if len(states) == 1:
        return [_one(stage, states[0])]
    return list(_POOL.map(lambda s: _one(stage, s), states))


# the spec readout, batched over requests

def encode_rows(block: DiffusionBlock, windows: Sequence[bytes], device: torch.device) -> tuple[ContextCache, torch.Tensor]:
    """The clean streams of windows of different lengths in one call: right-padded, so that the
    causal stream leaves each row's valid positions as they would be alone. (cache, lengths (R,))."""
    lens = torch.tensor([len(w) for w in windows], device=device)
    ids = torch.zeros(len(windows), int(lens.max()), dtype=torch.long, device=device)
    for i, w in enumerate(windows):
        ids[i, :len(w)] = torch.tensor(list(w), dtype=torch.long, device=device)
    return block.encode_context(ids), lens


def draft_rows(block: DiffusionBlock, cache: ContextCache, lens: torch.Tensor, k: int,
               states: Sequence[SegmentState]) -> list[Carry]:
    """`readouts.draft` for R requests at once: K bytes each, one byte per step for all rows, each
    row sampled with its own temperature and its own ("spec-draft", seed, segment) stream."""
    gens = [generator("spec-draft", s.seed, s.segment) for s in states]
    drafted: list[list[int]] = [[] for _ in states]
    rows: list[torch.Tensor] = []
    for j in range(k):
        if j:
            last = torch.tensor([[d[-1]] for d in drafted], device=lens.device)
            cache = block.extend_rows(cache, last, lens + j - 1)
        lp = log_probs(context_logits(block, cache, row_layouts(lens + j, 1)))[:, 0]  # (R, V)
        rows.append(lp)
        for i, s in enumerate(states):
            drafted[i].append(int(sample_bytes(lp[i:i + 1], s.temperature, gens[i])[0]))
    q = torch.stack(rows, dim=1)  # (R, K, V)
    return [Carry(pool=q[i], draft=bytes(d), draft_logp=q[i]) for i, d in enumerate(drafted)]


def score_rows(block: DiffusionBlock, cache: ContextCache, lens: torch.Tensor, carries: Sequence[Carry]) -> list[Carry]:
    """`readouts.score_draft` for R requests at once (drafts of one length K)."""
    k = len(carries[0].draft)
    drafts = torch.tensor([list(c.draft) for c in carries], device=lens.device)  # (R, K)
    if k > 1:
        cache = block.extend_rows(cache, drafts[:, :-1], lens)
    lp = log_probs(context_logits(block, cache, row_layouts(lens, k, own_segments=True)))  # (R, K, V)
    out = []
    for i, c in enumerate(carries):
        assert c.pool is not None and c.draft_logp is not None
        out.append(Carry(pool=c.pool.to(lp.device) + lp[i], draft=c.draft, draft_logp=c.draft_logp.to(lp.device)))
    return out


SWEEP_READOUTS = (Readout.POOL, Readout.LAST)  # a sweep read from its last evaluation (and the pool): batched


def spec_steps(stage: LocalBlockStage, states: Sequence[SegmentState]) -> list[SegmentState | Outcome]:
    """`stage.step` for every state: spec segments of one K batched (two or more of them), and pool
    or last segments of one K, step count and tail batched as one sweep; every other one (commit,
    spec-fill: their readers extend one request's cache) alone. A state the stage refuses gets its error."""
    outs: list[SegmentState | Outcome | None] = [None] * len(states)
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(states):
        if s.readout is Readout.SPEC or s.readout in SWEEP_READOUTS:
            try:
                stage.validate(s)
            except BtnodeError as exc:
                outs[i] = exc
                continue
            key = (s.k,) if s.readout is Readout.SPEC else (s.k, s.n_steps, s.n_tail, "sweep")
            groups.setdefault(key, []).append(i)
        else:
            outs[i] = _step(stage, s)
    for key, idx in groups.items():
        if len(idx) == 1:  # alone: the unbatched path, bit for bit
            outs[idx[0]] = _step(stage, states[idx[0]])
            continue
        run = _spec_batch if len(key) == 1 else _sweep_batch
        try:
            with torch.no_grad():
                done = run(stage, [states[i] for i in idx])
        except Exception:  # noqa: BLE001 - a bug in the batched path must not fail its requests: serve them alone
            log.exception("a batched step of %d segments failed; serving them one by one", len(idx))
            done = [_step(stage, states[i]) for i in idx]
        for i, o in zip(idx, done):
            outs[i] = o
    return outs  # type: ignore[return-value]


def _step(stage: LocalBlockStage, s: SegmentState) -> SegmentState | Outcome:
    try:
        return stage.step(s)
    except BtnodeError as exc:
        return exc


class SpecContexts:
    """Per request, a block's clean stream of its last spec window, so that the next traversal
    encodes only the bytes the last one added (spec's windows grow by 1 … K bytes, not whole
    segments, so the canonical chunk caches of serve/context_cache.py do not hold them). Equal to
    encoding the window afresh up to float rounding; least recently used dropped past the bounds."""

    def __init__(self, max_bytes: int = 64 << 20, max_entries: int = 512):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.entries: OrderedDict[str, tuple[bytes, list[torch.Tensor], int]] = OrderedDict()
        self.nbytes = 0
        self.lock = threading.Lock()

    def get(self, rid: str, window: bytes) -> list[torch.Tensor] | None:
        """The stored tensors [k₀, v₀, k₁, v₁, …, out] of a prefix of `window`, or None."""
        with self.lock:
            hit = self.entries.get(rid)
            if hit is None or not window.startswith(hit[0]):
                return None
            self.entries.move_to_end(rid)
            return hit[1]

    def put(self, rid: str, window: bytes, tensors: list[torch.Tensor]) -> None:
        n = sum(t.numel() * t.element_size() for t in tensors)
        with self.lock:
            self.drop_locked(rid)
            if n > self.max_bytes or not self.max_entries:
                return
            self.entries[rid] = (window, tensors, n)
            self.nbytes += n
            while self.nbytes > self.max_bytes or len(self.entries) > self.max_entries:
                self.drop_locked(next(iter(self.entries)))

    def drop(self, rid: str) -> None:
        with self.lock:
            self.drop_locked(rid)

    def drop_locked(self, rid: str) -> None:
        old = self.entries.pop(rid, None)
        if old is not None:
            self.nbytes -= old[2]


_SPEC_CONTEXTS: dict[int, SpecContexts] = {}  # per stage (by id), made on its first batched spec traversal
_SPEC_LOCK = threading.Lock()


def spec_contexts(stage: LocalBlockStage) -> SpecContexts | None:
    if not stage.contexts.enabled:
        return None
    with _SPEC_LOCK:
        return _SPEC_CONTEXTS.setdefault(id(stage), SpecContexts())


def encode_cached(stage: LocalBlockStage, states: Sequence[SegmentState]) -> tuple[ContextCache, torch.Tensor]:
    """The batch's clean streams: each row from its stored prefix extended by its new bytes (one
    ragged extend_rows for all), rows without one encoded afresh; then each row's stream stored
    for the next traversal (dropped after the request's last segment)."""
    store = spec_contexts(stage)
    block, device = stage.block, stage.device
    lens = torch.tensor([len(s.context) for s in states], device=device)
    stored = [store.get(s.request_id, s.context) if store is not None and s.use_cache else None for s in states]
    fresh = [i for i, t in enumerate(stored) if t is None]
    if len(fresh) == len(states):
        cache, _ = encode_rows(block, [s.context for s in states], device)
    else:
        n_layers, cap = len(block.layers), block.cfg.context
        ref = next(t for t in stored if t is not None)
        kv = [[ref[2 * j + h].new_zeros(len(states), *ref[2 * j + h].shape[:-2], cap, ref[2 * j + h].shape[-1])
               for h in (0, 1)] for j in range(n_layers)]
        out = ref[-1].new_zeros(len(states), cap, ref[-1].shape[-1])
        if fresh:
            enc, _ = encode_rows(block, [states[i].context for i in fresh], device)
        starts, new = [], []
        for i, s in enumerate(states):
            t = stored[i]
            if t is None:
                row, n = fresh.index(i), len(s.context)
                tensors = [enc.kv[j][h][row, :, :n] for j in range(n_layers) for h in (0, 1)] + [enc.out[row, :n]]
            else:
                tensors, n = t, t[-1].shape[0]
            for j in range(n_layers):
                for h in (0, 1):
                    kv[j][h][i, :, :n] = tensors[2 * j + h]
            out[i, :n] = tensors[-1]
            starts.append(n)
            new.append(s.context[n:])
        cache = ContextCache(kv=[(k, v) for k, v in kv], out=out, n_clean=cap)
        width = max(len(b) for b in new)
        if width:
            ids = torch.zeros(len(states), width, dtype=torch.long, device=device)
            for i, b in enumerate(new):
                ids[i, :len(b)] = torch.tensor(list(b), dtype=torch.long, device=device)
            cache = block.extend_rows(cache, ids, torch.tensor(starts, device=device))
    if store is not None:
        for i, s in enumerate(states):
            n = len(s.context)
            if s.final or not s.use_cache:
                store.drop(s.request_id)
                continue
            store.put(s.request_id, s.context, [x[i, :, :n].clone() for kv in cache.kv for x in kv]
                      + [cache.out[i, :n].clone()])
    return cache, lens


def _spec_batch(stage: LocalBlockStage, states: Sequence[SegmentState]) -> list[SegmentState | Outcome]:
    cache, lens = encode_cached(stage, states)
    if stage.index == 0:
        carries = draft_rows(stage.block, cache, lens, states[0].k, states)
    else:
        carries = score_rows(stage.block, cache, lens, [s.carry for s in states])
    if stage.passes_drafts_on:
        return [dataclasses.replace(s, carry=c.cpu()) for s, c in zip(states, carries)]
    out: list[SegmentState | Outcome] = []
    for s, c in zip(states, carries):
        ev = Evaluation(block=stage.block, cache=cache, k=s.k, n_blocks=stage.n_blocks, carry=c)
        try:
            out.append(stage.read(s, ev))
        except BtnodeError as exc:
            out.append(exc)
    return out


def _sweep_batch(stage: LocalBlockStage, states: Sequence[SegmentState]) -> list[SegmentState | Outcome]:
    """This block's span of the sweep for R pool or last segments of one K, step count and tail, as
    one (R, K, d) batch over their contexts of different lengths (RowLayout); pool adds each row's
    context readout to its carry. The last stage reads each row (pool and last read only the
    evaluation and the carry, never the batch's padded cache)."""
    cache, lens = encode_cached(stage, states)
    s0, cfg = states[0], stage.cfg
    grid = generation_grid(cfg, s0.n_steps, s0.n_tail)
    span = generation_spans(cfg, s0.n_steps, s0.n_tail)[stage.index]
    layout = row_layouts(lens, s0.k)
    z, logits = run_span(block_denoiser(stage.block, cache, layout), torch.stack([s.z for s in states]).to(stage.device),
                         grid, span, stage.table)
    pooled = any(s.readout is Readout.POOL for s in states)
    own = log_probs(context_logits(stage.block, cache, layout)) if pooled else None  # (R, K, V)
    out: list[SegmentState | Outcome] = []
    for i, s in enumerate(states):
        carry = NO_CARRY
        if s.readout is Readout.POOL:
            assert own is not None
            carry = Carry(pool=own[i] if s.carry.pool is None else s.carry.pool.to(own.device) + own[i])
        if logits is None:
            out.append(dataclasses.replace(s, z=z[i].cpu(), carry=carry.cpu()))
            continue
        ev = Evaluation(block=stage.block, cache=cache, k=s.k, n_blocks=stage.n_blocks, carry=carry, z=z[i:i + 1],
                        logits=logits[i:i + 1], sigma=grid[span[-1]])
        try:
            out.append(stage.read(s, ev))
        except BtnodeError as exc:
            out.append(exc)
    return out


def _rid(state: Any) -> str:
    return state.request_id


class BatchingStage:
    """The entry's first stage seen through a traversal scheduler: `forward` (one request's
    segment, from its driver loop's thread) waits for the next traversal, which carries every
    segment waiting when it starts (up to max_batch). One scheduler thread runs the traversals."""

    def __init__(self, first: Any, *, max_batch: int = MAX_BATCH, gather_s: float = GATHER_S,
                 meter: Meter | None = None, chain: str = "block"):
        self.first = first  # a block chain's first stage, or an AR chain's (LocalARStage.forward_batch)
        self.chain = chain
        self.meter = meter  # ("traversals", chain) and ("batched_segments", chain): their ratio, the mean batch
        self.name = first.name
        self.max_batch = max_batch
        self.gather_s = gather_s
        self.pending: deque[tuple[Any, Future]] = deque()  # SegmentState, or ARState
        self.cond = threading.Condition()
        self.expected: set[str] = set()  # requests of the last traversal that go on: the next one waits for them
        self.traversals = 0  # traversals run, and the segments they carried: their mean batch size
        self.segments = 0
        self.largest = 0
        self.thread: threading.Thread | None = None

    def forward(self, state: Any) -> SegmentResult:
        done: Future = Future()
        with self.cond:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="traversals", daemon=True)
                self.thread.start()
            self.pending.append((state, done))
            self.cond.notify()
        return done.result()

    def stats(self) -> dict[str, Any]:
        with self.cond:
            return {"traversals": self.traversals, "segments": self.segments, "largest": self.largest,
                    "mean_batch": self.segments / self.traversals if self.traversals else 0.0}

    def _take(self) -> list[tuple[Any, Future]]:
        with self.cond:
            while not self.pending:
                self.cond.wait()
            # the requests of the last traversal that go on send their next segment at once: wait for each
            # of them (not for as many segments as it had: a straggler already waiting would count for one of
            # them and leave another behind, which then misses every later traversal by a hair)
            deadline = time.monotonic() + self.gather_s
            while len(self.pending) < self.max_batch and not self.expected <= {_rid(s) for s, _ in self.pending}:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            n = min(len(self.pending), self.max_batch)
            return [self.pending.popleft() for _ in range(n)]

    def _run(self) -> None:
        while True:
            batch = self._take()
            try:
                results: list[Any] = forward_batch(self.first, [s for s, _ in batch])
            except BaseException as exc:  # a bug, not a refusal: every request of the batch fails with it
                log.exception("a batched traversal of %d segments failed", len(batch))
                results = [exc] * len(batch)
            with self.cond:
                self.expected = {_rid(s) for (s, _), r in zip(batch, results)
                                 if not isinstance(r, BaseException) and not getattr(s, "final", False)}
                self.traversals += 1
                self.segments += len(batch)
                self.largest = max(self.largest, len(batch))
            if self.meter is not None:
                self.meter.count(("traversals", self.chain))
                self.meter.count(("batched_segments", self.chain), len(batch))
            for (_, done), r in zip(batch, results):
                if isinstance(r, BaseException):
                    done.set_exception(r)
                else:
                    done.set_result(r)
