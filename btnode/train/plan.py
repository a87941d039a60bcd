"""Capacity planning (`btnode plan`): the peak memory of a process training one block (a worker)
against one training the whole model end to end (the B·L-layer AR model: what a lab trains
instead, and what every DiLoCo worker holds a replica of), and what a round costs on the wire.

A process's peak resident memory is predicted from its parts, each checked against measured peak
RSS at the widths bench/memory.py runs (BENCHMARKS.md, "Memory at scale"):
- runtime: Python, torch and btnode with a training step's code loaded, measured as this process's
  resident set after a tiny warm-up step (so it is this host's and this torch's);
- training state, counted from the real module's parameters (fp32, 4 bytes each): parameters,
  gradients and AdamW's two moments, 16 bytes per parameter, alive from the first step on;
- within a step, the larger of the tensors autograd saves for backward at the batch (measured) and
  foreach AdamW's one parameter-sized temporary (√v̂);
- heap that glibc keeps: once its dynamic mmap threshold has risen, tensors under its ceiling
  (32 MiB) come from the heap, and freed heap stays resident; see HEAP_KEPT;
- writing a checkpoint with optimizer state (train-local and train-ar do at the end), see
  CHECKPOINT_BYTES_PER_PARAM.
Saved activations are measured, not estimated from a formula: real training steps of 1- and
2-layer models at the real width, at batch 1 and 2, under `saved_tensors_hooks`, counting every
distinct storage autograd keeps (parameters excluded); they are linear in layers and in batch.
The probes never build the whole model, so planning a model that does not fit still works.
"""

from __future__ import annotations

import dataclasses
import resource
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from btnode.codec.codecs import Codec, raw_size
from btnode.data.windows import WindowSampler
from btnode.model.ar import ByteTransformer
from btnode.model.block import DiffusionBlock
from btnode.model.config import ModelConfig
from btnode.model.targets import target_table
from btnode.store.models import init_ar, init_block
from btnode.train.config import TrainConfig
from btnode.train.trainers import ARTrainer, BlockTrainer

F32 = 4
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, each one fp32 value per parameter
# Writing a checkpoint (store/files.py) serializes the optimizer group into safetensors' buffer and
# copies that into `bytes` (2 × 8 bytes per parameter) while the model group's `bytes` (4 per
# parameter) is still referenced by the loop: 20 bytes per parameter on top of the training state.
CHECKPOINT_BYTES_PER_PARAM = 2 * 2 * 4 + 4
GLIBC_MMAP_MAX = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: larger tensors are always mmapped, and unmapped when freed
# Share of the larger transient (the AdamW temporary's tensors under that ceiling, or the saved
# activations) that glibc's heap keeps resident after it is freed, from the second step on. Fitted
# on bench/memory.py's 16 measurements (widths 128–1792, batch 2 and 32); with the threshold
# pinned (MALLOC_MMAP_THRESHOLD_=65536) that excess vanishes, so it is the allocator's, not torch's.
HEAP_KEPT = 0.5
# A swarm worker (swarm/worker.py) holds fp32 copies of its unit beside the trainer: the base version
# θ^v and the error-feedback residual all along; during a round's exchange θ at the push, the
# published delta (its decompressed bytes and the writable copy decode makes), the next version
# built from it and the clone _adopt keeps; the fold's θ_now and carry; plus the encoded update kept
# for a re-push (its codec's bytes, counted apart). Not all at once, and the heap keeps some freed
# ones: 9 copies' worth is fitted on real workers' peak RSS (`join --role worker`, 3 rounds of H=2 at
# batch 2, int8 updates): block and 8-layer AR worker at d=512 and a block worker at d=1024; how close
# the plan comes is bench/memory.py's `plan error` (BENCHMARKS.md, memory), the largest size in --capped.
SWARM_COPIES = 9


@dataclass(frozen=True)
class Memory:
    """One training process's memory by what holds it, in bytes (`parameters` is a count)."""

    parameters: int
    runtime_bytes: int  # Python + torch + btnode with a step's code loaded, nothing built
    param_bytes: int
    grad_bytes: int
    adam_bytes: int
    activation_bytes: int  # saved for backward at the batch
    step_bytes: int  # foreach AdamW's temporary: one fp32 buffer per parameter
    retained_bytes: int  # freed transients that glibc's heap keeps resident (HEAP_KEPT)
    checkpoint_bytes: int  # transient of writing a checkpoint with optimizer state

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and AdamW moments: what the process holds from the first step on."""
        return self.param_bytes + self.grad_bytes + self.adam_bytes

    @property
    def train_peak_bytes(self) -> int:
        """Peak RSS of training steps alone (a swarm worker's steps, which write no checkpoint)."""
        return self.runtime_bytes + self.state_bytes + max(self.activation_bytes, self.step_bytes) + self.retained_bytes

    @property
    def peak_bytes(self) -> int:
        """Peak RSS of `btnode train-local` / `train-ar`, which also write checkpoints with optimizer state."""
        return max(self.train_peak_bytes,
                   self.runtime_bytes + self.state_bytes + self.retained_bytes + self.checkpoint_bytes)

    def to_dict(self) -> dict:
        return {**asdict(self), "state_bytes": self.state_bytes, "train_peak_bytes": self.train_peak_bytes,
                "peak_bytes": self.peak_bytes}


def swarm_worker_peak_bytes(m: Memory, codec: Codec) -> int:
    """Peak RSS of a swarm worker (`btnode join --role worker`) training the unit `m` describes with
    `codec` updates: plan's training peak plus the worker's copies of the unit (SWARM_COPIES)."""
    return m.train_peak_bytes + SWARM_COPIES * F32 * m.parameters + raw_size(codec, m.parameters)


def parameter_sizes(build: Callable[[], nn.Module]) -> list[int]:
    """Element count of each parameter of the module `build()` makes, built on the meta device:
    no memory and no initialisation time, at any size."""
    with torch.device("meta"):
        return [p.numel() for p in build().parameters()]


def memory_of(sizes: list[int], *, runtime: int, activations: int) -> Memory:
    """The arithmetic: every part from the parameters' sizes, the runtime and the saved activations."""
    n = sum(sizes)
    heap = sum(s for s in sizes if F32 * s < GLIBC_MMAP_MAX)
    return Memory(parameters=n, runtime_bytes=runtime, param_bytes=F32 * n, grad_bytes=F32 * n,
                  adam_bytes=ADAM_MOMENTS * F32 * n, activation_bytes=activations, step_bytes=F32 * n,
                  retained_bytes=int(HEAP_KEPT * max(F32 * heap, activations)),
                  checkpoint_bytes=CHECKPOINT_BYTES_PER_PARAM * n)


def _stateless(trainer: BlockTrainer | ARTrainer) -> BlockTrainer | ARTrainer:
    """A probe needs the saved tensors of a step, not AdamW's state: give it an optimizer that keeps none."""
    trainer.opt = torch.optim.SGD(trainer.model.parameters(), lr=0.0)
    return trainer


def _probe(cfg: ModelConfig, kind: str, n_layers: int) -> BlockTrainer | ARTrainer:
    cpu = torch.device("cpu")
    # every noisy row: the most a step saves (under --noisy-rows F < 1 a step saves less, by how many rows
    # the segments drawn for it hold, which varies step to step with K), so the plan is an upper bound
    tc = TrainConfig(noisy_rows=1.0)
    if kind == "block":
        c = dataclasses.replace(cfg, n_layers=n_layers)
        return _stateless(BlockTrainer(init_block(c, 0, 0), tc, block=0, table=target_table(c), device=cpu))
    return _stateless(ARTrainer(init_ar(cfg, n_layers, 0), tc, cpu))


def saved_bytes(trainer: BlockTrainer | ARTrainer, context: int, batch: int) -> int:
    """Bytes autograd saves for backward in one real training step of `trainer` at `batch`."""
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() != 0:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    x = WindowSampler(bytes(range(256)) * (context // 64 + 8), context).batch(0, 0, 0, batch)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train_step(x, 0)
    return sum(seen.values())


def activations(cfg: ModelConfig, kind: str, n_layers: int, batch: int) -> int:
    """Saved bytes of block 0 (kind "block", cfg.n_layers layers) or of an `n_layers`-layer AR model
    (kind "ar") at `batch`, from probes of 1 and 2 layers at batch 1 and 2: linear in each."""
    at = {}
    for n in (1, 2):
        trainer = _probe(cfg, kind, n)
        for b in (1, 2):
            at[n, b] = saved_bytes(trainer, cfg.context, b)
        del trainer

    def at_batch(n: int) -> float:
        return at[n, 1] + (at[n, 2] - at[n, 1]) * (batch - 1)

    per_layer = max(0.0, at_batch(2) - at_batch(1))
    return int(max(0.0, at_batch(1) - per_layer) + per_layer * n_layers)


def resident_bytes() -> int:
    """This process's resident set now (Linux); elsewhere its peak so far."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def runtime_bytes() -> int:
    """Resident set after a warm-up step of tiny models of both kinds: the interpreter, torch,
    btnode, the optimizer's modules and the kernels a step touches, but no model to speak of."""
    tiny = ModelConfig(d_model=16, n_heads=2, n_layers=1, n_blocks=1, context=16, segments=(1,))
    for kind in ("block", "ar"):
        saved_bytes(_probe(tiny, kind, 1), tiny.context, 1)
    return resident_bytes()


def block_memory(cfg: ModelConfig, batch: int, *, runtime: int | None = None) -> Memory:
    """A process training one block alone (`btnode train-local --block`, a swarm worker's steps); every
    block has the same shape, so block 0 stands for any."""
    sizes = parameter_sizes(lambda: DiffusionBlock(cfg))
    rt = runtime_bytes() if runtime is None else runtime
    return memory_of(sizes, runtime=rt, activations=activations(cfg, "block", cfg.n_layers, batch))


def ar_memory(cfg: ModelConfig, batch: int, n_layers: int | None = None, *, runtime: int | None = None) -> Memory:
    """A process training the whole model end to end: the AR model of `n_layers` layers (default
    B·L, the blocks' total depth; `btnode train-ar`, a DiLoCo worker's replica)."""
    n_layers = cfg.n_blocks * cfg.n_layers if n_layers is None else n_layers
    sizes = parameter_sizes(lambda: ByteTransformer(cfg, n_layers))
    rt = runtime_bytes() if runtime is None else runtime
    return memory_of(sizes, runtime=rt, activations=activations(cfg, "ar", n_layers, batch))


def unit_bytes(cfg: ModelConfig) -> dict[str, int]:
    """Every unit a swarm of this configuration trains, together, in each codec (as block_bytes):
    the B (+ tail) blocks, or the one --ar-layers AR model of a DiLoCo run."""
    if cfg.kind == "ar":
        sizes = parameter_sizes(lambda: ByteTransformer(cfg, cfg.ar_layers))
        return {codec.name.lower(): sum(raw_size(codec, n) for n in sizes) for codec in Codec}
    one = block_bytes(cfg)
    return {codec: n * cfg.total_blocks for codec, n in one.items()}


def block_bytes(cfg: ModelConfig) -> dict[str, int]:
    """One block's tensors in each codec, before zstd: what one pushed update costs, and what the
    published delta pulled back each round costs in the aggregator's --publish-codec (fp32 by
    default). An upper bound: zstd takes ~10 % off fp32 and int8, more off bf16."""
    sizes = parameter_sizes(lambda: DiffusionBlock(cfg))
    return {codec.name.lower(): sum(raw_size(codec, n) for n in sizes) for codec in Codec}
