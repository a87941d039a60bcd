"""Checkpoints on disk: safetensors for tensors plus a JSON of metadata, each written atomically.

A checkpoint named STEM in a folder is STEM.safetensors (model), optionally STEM.optim.safetensors
(optimizer state, for resuming) and STEM.json. The JSON is written last and records the sha256
and size of the tensor files, so a torn or truncated write is detected on load instead of being
half-read; the JSON itself is the commit record.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from btnode import __version__
from btnode.durable import atomic_write
from btnode.errors import CheckpointError

FORMAT = 1


_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
Group = Mapping[str, "torch.Tensor | bytes"]  # bytes: a flat uint8 tensor, written without a copy


@dataclass(frozen=True)
class Streamed:
    """A group of float32 tensors made as it is written, one at a time (issue #25: a large unit's new θ
    is never whole in memory): `shapes` lays out the file up front; `make()` yields (name, tensor) in
    that order, each dropped once written."""

    shapes: Mapping[str, tuple[int, ...]]
    make: Callable[[], Iterable[tuple[str, torch.Tensor]]]


def _streamed_pieces(group: Streamed) -> Iterator[memoryview]:
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in group.shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    yield _header_piece(header)
    names = iter(group.shapes)
    for name, t in group.make():
        expected = next(names, None)
        if name != expected or tuple(t.shape) != tuple(group.shapes[name]) or t.dtype != torch.float32:
            raise ValueError(f"streamed tensor {name!r} {t.dtype} {tuple(t.shape)} does not fit the layout "
                             f"(expected {expected!r})")
        t = t.contiguous()
        yield memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
    if (left := next(names, None)) is not None:
        raise ValueError(f"the streamed group ended before {left!r}")


def _header_piece(header: dict[str, Any]) -> memoryview:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return memoryview(struct.pack("<Q", len(text)) + text)


def _pieces(group: Group | Streamed) -> Iterator[memoryview]:
    """A safetensors file (8-byte header length, JSON header, data) in pieces: each tensor's bytes
    are a view of the tensor itself, so a large checkpoint is never one blob in memory."""
    if isinstance(group, Streamed):
        yield from _streamed_pieces(group)
        return
    header: dict[str, Any] = {}
    views = []
    offset = 0
    for name, t in group.items():
        if isinstance(t, (bytes, bytearray, memoryview)):
            view, dtype, shape = memoryview(t).cast("B"), "U8", [len(t)]
        else:
            t = t.detach().cpu().contiguous()
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
            dtype, shape = _DTYPES[t.dtype], list(t.shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(view)]}
        offset += len(view)
        views.append(view)
    yield _header_piece(header)
    yield from views


def _write_group(path: Path, group: Group | Streamed) -> dict[str, Any]:
    """Write one tensor group durably; its record (name, size, sha256), computed as it is written."""
    digest, size = hashlib.sha256(), 0

    def counted() -> Iterator[memoryview]:
        nonlocal size
        for piece in _pieces(group):
            digest.update(piece)
            size += len(piece)
            yield piece

    atomic_write(path, counted())
    return {"name": path.name, "bytes": size, "sha256": digest.hexdigest()}


@dataclass
class Checkpoint:
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    optim: dict[str, torch.Tensor] | None
    extra: dict[str, dict[str, torch.Tensor]]


def file_name(stem: str, role: str) -> str:
    return f"{stem}.safetensors" if role == "model" else f"{stem}.{role}.safetensors"


def save(folder: Path, stem: str, *, tensors: Mapping[str, torch.Tensor] | Streamed, meta: dict[str, Any],
         optim: dict[str, torch.Tensor] | None = None,
         extra: dict[str, Group] | None = None) -> None:
    """Write each tensor group to its own file (streamed: no copy of a group is made), then the JSON
    that commits them all."""
    folder.mkdir(parents=True, exist_ok=True)
    groups: dict[str, Group | Streamed | None] = {"model": tensors, "optim": optim, **(extra or {})}
    files = {}
    for role, group in groups.items():
        if group is None:
            continue
        files[role] = _write_group(folder / file_name(stem, role), group)
    doc = {"format": FORMAT, "btnode_version": __version__, **meta, "files": files}
    atomic_write(folder / f"{stem}.json", json.dumps(doc, indent=1, sort_keys=True).encode())


def remove(folder: Path, stem: str) -> None:
    """Delete a checkpoint: its JSON first, so that a crash midway never leaves a JSON pointing at nothing."""
    (folder / f"{stem}.json").unlink(missing_ok=True)
    for path in folder.glob(f"{stem}.*safetensors"):
        path.unlink(missing_ok=True)


def _read_tensors(folder: Path, record: dict[str, Any], with_path: Path) -> dict[str, torch.Tensor]:
    path = folder / record["name"]
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {with_path}: cannot read {path.name}: {exc.strerror or exc}") from exc
    if len(blob) != record["bytes"] or hashlib.sha256(blob).hexdigest() != record["sha256"]:
        raise CheckpointError(f"checkpoint {with_path}: {path.name} is truncated or corrupted "
                              f"({len(blob)} bytes, expected {record['bytes']}; sha256 differs)")
    try:
        return st_load(blob)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {with_path}: {path.name} is not a valid safetensors file: {exc}") from exc


def iter_group(folder: Path, stem: str, role: str, piece_bytes: int = 16 << 20) -> Iterator[tuple[str, bytes]]:
    """The tensors of one group as (name, raw bytes), one at a time in file order, read in pieces and
    hashed as they go: a large group is never whole in memory. CheckpointError, at the end, if the
    file fails its commit record: a caller keeps nothing it was given until the iteration ends."""
    meta_path = folder / f"{stem}.json"
    record = load_meta(folder, stem)["files"].get(role)
    if not isinstance(record, dict):
        raise CheckpointError(f"checkpoint {meta_path} holds no {role!r} tensors")
    path = folder / record["name"]
    digest, size = hashlib.sha256(), 0
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            text = f.read(struct.unpack("<Q", head)[0]) if len(head) == 8 else b""
            digest.update(head + text)
            size += len(head) + len(text)
            header = json.loads(text)
            spans = sorted(((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__"))
            at = 0
            for (lo, hi), name in spans:
                if lo != at or hi < lo:
                    raise ValueError(f"tensor {name!r} lies at bytes {lo}..{hi}, expected it to start at {at}")
                at = hi
                parts = []
                for start in range(lo, hi, piece_bytes):
                    piece = f.read(min(piece_bytes, hi - start))
                    digest.update(piece)
                    parts.append(piece)
                size += hi - lo
                yield name, b"".join(parts) if len(parts) != 1 else parts[0]
            rest = f.read()
            digest.update(rest)
            size += len(rest)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise CheckpointError(f"checkpoint {meta_path}: cannot read {path.name}: {exc}") from exc
    if size != record["bytes"] or digest.hexdigest() != record["sha256"]:
        raise CheckpointError(f"checkpoint {meta_path}: {path.name} is truncated or corrupted "
                              f"({size} bytes, expected {record['bytes']}; sha256 differs)")


def load_meta(folder: Path, stem: str) -> dict[str, Any]:
    """A checkpoint's commit record (its JSON), checked to be one."""
    meta_path = folder / f"{stem}.json"
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"no checkpoint {stem} in {folder} ({meta_path.name} is missing)") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint metadata {meta_path} is unreadable or truncated: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "model" not in meta.get("files", {}):
        raise CheckpointError(f"checkpoint metadata {meta_path} is not a btnode checkpoint of format {FORMAT}")
    return meta


def load(folder: Path, stem: str, *, with_optim: bool = False, roles: tuple[str, ...] = (),
         optional_roles: tuple[str, ...] = (), with_model: bool = True) -> Checkpoint:
    """Every file read is checked against the commit record. `with_model=False` reads only the
    groups asked for (a delta fetch reads the delta, not the model); `tensors` is then empty."""
    meta_path = folder / f"{stem}.json"
    meta = load_meta(folder, stem)
    tensors = _read_tensors(folder, meta["files"]["model"], meta_path) if with_model else {}
    optim = None
    if with_optim:
        if "optim" not in meta["files"]:
            raise CheckpointError(f"checkpoint {meta_path} holds no optimizer state, so it cannot be resumed")
        optim = _read_tensors(folder, meta["files"]["optim"], meta_path)
    extra = {}
    for role in roles + tuple(r for r in optional_roles if r in meta["files"]):
        if role not in meta["files"]:
            raise CheckpointError(f"checkpoint {meta_path} holds no {role!r} tensors")
        extra[role] = _read_tensors(folder, meta["files"][role], meta_path)
    return Checkpoint(meta=meta, tensors=tensors, optim=optim, extra=extra)


def state_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """Canonical hash of a block's state: names in sorted order, each as name, shape and
    little-endian float32 bytes. Workers and the aggregator compare this after every version."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode() + b"\0" + repr(tuple(t.shape)).encode() + b"\0")
        h.update(t.numpy().reshape(-1).view('uint8') if t.numel() else b"")  # no copy of the tensor
    return h.hexdigest()


def check_tensors(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> None:
    """Raise CheckpointError naming every missing, unexpected or wrongly shaped/typed tensor."""
    problems = []
    for name in sorted(set(expected) - set(got)):
        problems.append(f"missing {name}")
    for name in sorted(set(got) - set(expected)):
        problems.append(f"unexpected {name}")
    for name in sorted(set(expected) & set(got)):
        e, g = expected[name], got[name]
        if e.shape != g.shape or e.dtype != g.dtype:
            problems.append(f"{name} is {g.dtype} {tuple(g.shape)}, expected {e.dtype} {tuple(e.shape)}")
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise CheckpointError(f"{what} does not fit the model: {shown}")


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Flatten an optimizer's state into named tensors plus its JSON-able param groups."""
    sd = opt.state_dict()
    tensors = {f"state.{idx}.{key}": (val if torch.is_tensor(val) else torch.tensor(val))
               for idx, st in sd["state"].items() for key, val in st.items()}
    return tensors, sd["param_groups"]


def load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, val in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = val
    try:
        opt.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"optimizer state does not fit the model: {exc}") from exc
