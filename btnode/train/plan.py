"""Capacity planning (`btnode plan`): what a worker holding one block needs, against training the
whole model end to end, and what a round costs on the wire per codec.

Parameters, gradients and AdamW state are counted exactly from a real block (fp32: 4 bytes per
value; AdamW keeps two moments). Activations are *measured*, not estimated from a formula: one
real training step runs at batch 1 and at batch 2 under `saved_tensors_hooks`, counting every
distinct storage autograd keeps for the backward pass (parameters excluded); memory at batch b is
then intercept + slope × b. End to end means all B blocks in one process with backpropagation
through the stack, so every block's activations are alive at once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from btnode.codec.codecs import Codec, raw_size
from btnode.data.windows import WindowSampler
from btnode.model.config import ModelConfig
from btnode.model.targets import target_table
from btnode.store.models import init_block
from btnode.train.config import TrainConfig
from btnode.train.trainers import BlockTrainer

F32 = 4


@dataclass(frozen=True)
class Memory:
    parameters: int  # count
    param_bytes: int
    grad_bytes: int
    adam_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.adam_bytes + self.activation_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


def saved_bytes(cfg: ModelConfig, block: int, batch: int) -> int:
    """Bytes autograd saves for backward in one real training step of `block` at `batch`."""
    trainer = BlockTrainer(init_block(cfg, block, 0), TrainConfig(batch=batch), block=block,
                           table=target_table(cfg), device=torch.device("cpu"))
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() != 0:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    x = WindowSampler(bytes(range(256)) * (cfg.context // 64 + 8), cfg.context).batch(0, 0, 0, batch)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train_step(x, 0)
    return sum(seen.values())


def block_memory(cfg: ModelConfig, batch: int, block: int = 0) -> Memory:
    n = sum(p.numel() for p in init_block(cfg, block, 0).parameters())
    one, two = saved_bytes(cfg, block, 1), saved_bytes(cfg, block, 2)
    slope = max(0, two - one)
    acts = max(0, one - slope) + slope * batch
    return Memory(parameters=n, param_bytes=F32 * n, grad_bytes=F32 * n, adam_bytes=2 * F32 * n,
                  activation_bytes=acts)


def end_to_end(per_block: Memory, n_blocks: int) -> Memory:
    return Memory(**{k: v * n_blocks for k, v in asdict(per_block).items()})


def block_bytes(cfg: ModelConfig) -> dict[str, int]:
    """One block's tensors in each codec, before zstd: what one pushed update costs, and what the
    published delta pulled back each round costs in the aggregator's --publish-codec (fp32 by
    default). An upper bound: zstd takes ~10 % off fp32 and int8, more off bf16."""
    shapes = [tuple(p.shape) for p in init_block(cfg, 0, 0).parameters()]
    return {codec.name.lower(): sum(raw_size(codec, math.prod(s)) for s in shapes) for codec in Codec}
