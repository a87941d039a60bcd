"""Single-process training loops with checkpoints and exact resume.

`train_blocks` trains B blocks side by side (block b as worker b, its own optimizer, nothing
shared); `train_ar` trains one autoregressive baseline on the same windows. Both append one JSON
line per optimizer step to FOLDER/train-log.jsonl and checkpoint every `checkpoint_every` steps.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from btnode.data.source import ByteSource
from btnode.data.windows import WindowSampler
from btnode.errors import ConfigError
from btnode.model.config import ModelConfig
from btnode.model.targets import target_table
from btnode.store import files
from btnode.store.models import AR_STEM, block_stem, init_ar, init_block, load_ar, load_block, model_meta
from btnode.train.config import TrainConfig
from btnode.train.trainers import ARTrainer, BlockTrainer, StepStats, _Trainer

LOG_NAME = "train-log.jsonl"


@dataclass(frozen=True)
class Progress:
    name: str  # "block-0", "ar"
    step: int  # completed steps of that model
    total: int
    stats: StepStats
    elapsed: float  # seconds since the loop started
    tokens: int  # target positions trained so far, all models of the loop


ProgressFn = Callable[[Progress], None]


def _save(trainer: _Trainer, folder: Path, stem: str, meta: dict[str, Any]) -> None:
    optim, groups = files.optimizer_tensors(trainer.opt)
    files.save(folder, stem, tensors=trainer.model.state_dict(), optim=optim,
               meta={**meta, "step": trainer.step, "train": dataclasses.asdict(trainer.tc), "optim_groups": groups})


def _restore(trainer: _Trainer, optim: dict[str, torch.Tensor] | None, meta: dict[str, Any]) -> None:
    assert optim is not None
    files.load_optimizer(trainer.opt, optim, meta["optim_groups"])
    trainer.step = int(meta["step"])


def _run(trainers: Sequence[tuple[str, _Trainer, int, dict[str, Any]]], sampler: WindowSampler, tc: TrainConfig,
         folder: Path, *, checkpoint_every: int, stop_after: int | None, on_step: ProgressFn | None) -> None:
    """Round-robin one step per model until each reaches tc.steps (or stop_after)."""
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    started, tokens = time.perf_counter(), 0
    with open(folder / LOG_NAME, "a") as log:
        while any(tr.step < end for _, tr, _, _ in trainers):
            for name, tr, worker, meta in trainers:
                if tr.step >= end:
                    continue
                step = tr.step
                x = sampler.batch(tc.seed, worker, step, tc.batch)
                stats = tr.train_step(x, worker)
                tokens += x.shape[0] * (x.shape[1] - 1)
                log.write(json.dumps({"model": name, "step": step, "loss": stats.loss, "ce": stats.ce, "k": stats.k}) + "\n")
                if tr.step % checkpoint_every == 0 or tr.step == end:
                    log.flush()
                    _save(tr, folder, name, meta)
                if on_step is not None:
                    on_step(Progress(name, tr.step, end, stats, time.perf_counter() - started, tokens))


def train_blocks(cfg: ModelConfig, tc: TrainConfig, corpus: ByteSource | bytes, folder: Path, *, device: torch.device,
                 blocks: Sequence[int] | None = None, resume: bool = False, checkpoint_every: int = 200,
                 stop_after: int | None = None, on_step: ProgressFn | None = None) -> None:
    blocks = list(range(cfg.total_blocks)) if blocks is None else list(blocks)
    if any(not 0 <= b < cfg.total_blocks for b in blocks):
        raise ConfigError(f"blocks {blocks} out of range for {cfg.total_blocks} blocks")
    sampler = WindowSampler(corpus, cfg.context)
    folder.mkdir(parents=True, exist_ok=True)
    table, meta = target_table(cfg), model_meta(cfg)
    trainers = []
    for b in blocks:
        loaded = load_block(folder, b, expected=cfg, with_optim=True) if resume else None
        model = loaded.model if loaded else init_block(cfg, b, tc.seed)
        tr = BlockTrainer(model, tc, block=b, table=table, device=device)  # type: ignore[arg-type]
        if loaded:
            _restore(tr, loaded.optim, loaded.meta)
        trainers.append((block_stem(b), tr, b, {**meta, "kind": "block", "block": b}))
    _run(trainers, sampler, tc, folder, checkpoint_every=checkpoint_every, stop_after=stop_after, on_step=on_step)


def train_ar(cfg: ModelConfig, tc: TrainConfig, corpus: ByteSource | bytes, folder: Path, *, n_layers: int,
             device: torch.device, resume: bool = False, checkpoint_every: int = 200, stop_after: int | None = None,
             on_step: ProgressFn | None = None) -> None:
    """The baseline sees worker 0's windows, the same stream block 0 trains on."""
    sampler = WindowSampler(corpus, cfg.context)
    folder.mkdir(parents=True, exist_ok=True)
    loaded = load_ar(folder, expected=cfg, with_optim=True) if resume else None
    if loaded and loaded.meta.get("n_layers") != n_layers:
        raise ConfigError(f"{folder} holds a {loaded.meta.get('n_layers')}-layer baseline, not {n_layers} layers")
    model = loaded.model if loaded else init_ar(cfg, n_layers, tc.seed)
    tr = ARTrainer(model, tc, device)
    if loaded:
        _restore(tr, loaded.optim, loaded.meta)
    meta = {**model_meta(cfg), "kind": "ar", "n_layers": n_layers}
    _run([(AR_STEM, tr, 0, meta)], sampler, tc, folder, checkpoint_every=checkpoint_every,
         stop_after=stop_after, on_step=on_step)
