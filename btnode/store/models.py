"""Saving and loading blocks and AR baselines, checked against the model configuration.

Block b of a run lives in FOLDER/block-{b}.*; an autoregressive baseline in FOLDER/ar.*. An
aggregator's state folder (RUN_FILE) keeps the versions of each unit in STATE/block-{b}/, or in
STATE/ar/ for the one AR model of a DiLoCo run (ModelConfig.kind). The metadata carries the full model configuration, its fingerprint and the hash of the target
table, so a checkpoint from another configuration is refused with the differing fields named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from btnode.errors import CheckpointError, ConfigError
from btnode.model.ar import ByteTransformer
from btnode.model.block import DiffusionBlock
from btnode.model.config import ModelConfig
from btnode.model.targets import table_sha256, target_table
from btnode.seeding import stream_seed
from btnode.store import files
from btnode.store.versions import VersionStore


def block_stem(block: int) -> str:
    return f"block-{block}"


AR_STEM = "ar"
RUN_FILE = "run.json"  # marks an aggregator state folder (see aggregate/statedir.py)


def init_block(cfg: ModelConfig, block: int, seed: int) -> DiffusionBlock:
    """Version 0 of block `block`: a seeded initialisation, identical on every host."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed("init-block", seed, block))
        return DiffusionBlock(cfg)


def init_ar(cfg: ModelConfig, n_layers: int, seed: int) -> ByteTransformer:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed("init-ar", seed, n_layers))
        return ByteTransformer(cfg, n_layers)


def init_unit(cfg: ModelConfig, unit: int, seed: int) -> torch.nn.Module:
    """Version 0 of unit `unit` of a swarm: block `unit`, or (kind "ar") the whole AR model. The one
    factory the aggregator, the worker and the simulator build their units with."""
    if cfg.kind == "ar":
        if unit != 0:
            raise ConfigError(f"an AR run has one unit, 0, not {unit}")
        return init_ar(cfg, cfg.ar_layers, seed)
    return init_block(cfg, unit, seed)


def unit_stem(cfg: ModelConfig, unit: int) -> str:
    """The folder of unit `unit`'s versions in an aggregator's state folder."""
    return AR_STEM if cfg.kind == "ar" else block_stem(unit)


def model_meta(cfg: ModelConfig) -> dict[str, Any]:
    return {"model": cfg.to_dict(), "fingerprint": cfg.fingerprint(), "target_sha256": table_sha256(target_table(cfg))}


def _config_of(meta: dict[str, Any], where: Path) -> ModelConfig:
    try:
        return ModelConfig.from_dict(meta["model"])
    except (KeyError, TypeError, ConfigError) as exc:
        raise CheckpointError(f"checkpoint {where} has no valid model configuration: {exc}") from exc


@dataclass
class Loaded:
    cfg: ModelConfig
    model: torch.nn.Module
    meta: dict[str, Any]
    optim: dict[str, torch.Tensor] | None


def _load(folder: Path, stem: str, expected: ModelConfig | None, kind: str, with_optim: bool) -> Loaded:
    ck = files.load(folder, stem, with_optim=with_optim)
    where = folder / f"{stem}.json"
    if ck.meta.get("kind") != kind:
        raise CheckpointError(f"checkpoint {where} is a {ck.meta.get('kind')!r} checkpoint, expected {kind!r}")
    cfg = _config_of(ck.meta, where)
    if expected is not None:
        expected.require_same(cfg, f"checkpoint {where}")
    if ck.meta.get("target_sha256") != table_sha256(target_table(cfg)):
        raise CheckpointError(f"checkpoint {where} was made with a different target table "
                              "(another torch RNG or target_seed); its blocks cannot be used here")
    if kind == "block":
        model: torch.nn.Module = DiffusionBlock(cfg)
    else:
        n_layers = ck.meta.get("n_layers")
        if not isinstance(n_layers, int) or n_layers < 1:
            raise CheckpointError(f"checkpoint {where} has no valid n_layers")
        model = ByteTransformer(cfg, n_layers)
    files.check_tensors(model.state_dict(), ck.tensors, f"checkpoint {where}")
    model.load_state_dict(ck.tensors)
    return Loaded(cfg=cfg, model=model, meta=ck.meta, optim=ck.optim)


def load_block(folder: Path, block: int, expected: ModelConfig | None = None, with_optim: bool = False) -> Loaded:
    loaded = _load(folder, block_stem(block), expected, "block", with_optim)
    if loaded.meta.get("block") != block:
        raise CheckpointError(f"{folder / block_stem(block)}.json says it holds block {loaded.meta.get('block')}")
    return loaded


def load_blocks(folder: Path, version: int | None = None) -> tuple[ModelConfig, list[DiffusionBlock]]:
    """All blocks of a run (the B scoring blocks, then any tail blocks), checked to share one
    configuration: from a train-local folder, or the newest complete versions (or version `version`
    of every block) in an aggregator's state folder. Scoring uses blocks[:cfg.n_blocks]."""
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    if (folder / RUN_FILE).exists():
        return _load_newest_versions(folder, version)
    if version is not None:
        raise CheckpointError(f"{folder} is a train-local folder; --version needs an aggregator state folder")
    first = load_block(folder, 0)
    blocks = [first.model]
    for b in range(1, first.cfg.total_blocks):
        blocks.append(load_block(folder, b, expected=first.cfg).model)
    return first.cfg, blocks  # type: ignore[return-value]


def _load_newest_versions(folder: Path, version: int | None = None) -> tuple[ModelConfig, list[DiffusionBlock]]:
    cfg = _block_run_config(folder)
    return cfg, [_newest_version(folder, cfg, b, version) for b in range(cfg.total_blocks)]  # type: ignore[misc]


def _newest_version(folder: Path, cfg: ModelConfig, b: int, version: int | None = None) -> torch.nn.Module:
    """Unit b (a block, or a DiLoCo run's AR model) at its newest version, or at `version`."""
    store = VersionStore(folder, b, stem=unit_stem(cfg, b))
    what = cfg.unit_name(b)
    if version is not None and version not in store.versions():
        raise CheckpointError(f"aggregator state {folder} holds no version {version} of {what} "
                              f"(it keeps {store.versions()})")
    stored = store.latest() if version is None else store.load(version)
    if stored is None:
        raise CheckpointError(f"aggregator state {folder} holds no complete version of {what}")
    if files.state_sha256(stored.params) != stored.meta.get("info", {}).get("sha256"):
        raise CheckpointError(f"{what} version {stored.version} in {folder} fails its hash")
    model = init_unit(cfg, b, 0)
    files.check_tensors(model.state_dict(), stored.params, f"{what} version {stored.version} in {folder}")
    model.load_state_dict(stored.params)
    return model


def load_one_block(folder: Path, block: int) -> tuple[ModelConfig, DiffusionBlock]:
    """Block `block` from a train-local folder, or its newest version in an aggregator state folder."""
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    if (folder / RUN_FILE).exists():
        cfg = _block_run_config(folder)
        if not 0 <= block < cfg.total_blocks:
            raise CheckpointError(f"{folder} holds blocks 0…{cfg.total_blocks - 1}, not block {block}")
        return cfg, _newest_version(folder, cfg, block)  # type: ignore[return-value]
    loaded = load_block(folder, block)
    return loaded.cfg, loaded.model  # type: ignore[return-value]


def _run_config(folder: Path) -> ModelConfig:
    try:
        return ModelConfig.from_dict(json.loads((folder / RUN_FILE).read_text())["model"])
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
        raise CheckpointError(f"{folder / RUN_FILE} is not a valid run description: {exc}") from exc


def _block_run_config(folder: Path) -> ModelConfig:
    cfg = _run_config(folder)
    if cfg.kind != "block":
        raise CheckpointError(f"{folder} is the state of a DiLoCo run: it holds a {cfg.ar_layers}-layer AR model, "
                              "not blocks (the AR commands read it: eval, generate, a --model ar stage)")
    return cfg


def load_ar(folder: Path, expected: ModelConfig | None = None, with_optim: bool = False,
            version: int | None = None) -> Loaded:
    """An AR model: from a train-ar folder, or the newest version (or version `version`) of a DiLoCo
    run's model in an aggregator state folder."""
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    if (folder / RUN_FILE).exists():
        cfg = _run_config(folder)
        if cfg.kind != "ar":
            raise CheckpointError(f"{folder} is the state of a block swarm, not of a DiLoCo (--model ar) run")
        if expected is not None:
            expected.require_same(cfg, f"aggregator state {folder}")
        model = _newest_version(folder, cfg, 0, version)
        meta = {"kind": "ar", "n_layers": cfg.ar_layers, "model": cfg.to_dict(), "fingerprint": cfg.fingerprint()}
        return Loaded(cfg=cfg, model=model, meta=meta, optim=None)
    if version is not None:
        raise CheckpointError(f"{folder} is a train-ar folder; --version needs an aggregator state folder")
    return _load(folder, AR_STEM, expected, "ar", with_optim)


def kind_of(folder: Path) -> str:
    """'block' or 'ar': what a checkpoint folder holds."""
    if (folder / f"{block_stem(0)}.json").exists():
        return "block"
    if (folder / f"{AR_STEM}.json").exists():
        return "ar"
    if (folder / RUN_FILE).exists():
        return _run_config(folder).kind
    raise CheckpointError(f"{folder} holds no btnode checkpoint (no block-0.json or ar.json)")


def checkpoint_version(folder: Path) -> int:
    """The version a checkpoint folder holds: an aggregator state folder's newest version (the newest
    any unit has), a train-local or train-ar folder's training step. What a served model's id names."""
    if (folder / RUN_FILE).exists():
        cfg = _run_config(folder)
        units = 1 if cfg.kind == "ar" else cfg.total_blocks
        newest = [VersionStore(folder, u, stem=unit_stem(cfg, u)).versions() for u in range(units)]
        return max((v[-1] for v in newest if v), default=0)
    meta = folder / (f"{block_stem(0)}.json" if kind_of(folder) == "block" else f"{AR_STEM}.json")
    try:
        step = json.loads(meta.read_text()).get("step", 0)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {meta}: {exc}") from None
    return int(step) if isinstance(step, int) else 0
