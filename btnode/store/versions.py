"""The aggregator's durable history of one block: version v's parameters, the published delta
that produced it, and the outer-optimizer state, written atomically before v is announced.

Layout: STATE_DIR/block-{b}/v{version:012d}.json (the commit record, written last),
.safetensors (θ^v), .delta.safetensors (the delta's raw codec bytes, one uint8 tensor per name)
and .outer.safetensors (momentum buffers, when used). The newest `keep` versions are kept; a
restart resumes from the newest version whose files all verify. A DiLoCo run's one unit, the
whole AR model, keeps the same files under STATE_DIR/ar/ (`stem`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from btnode.codec.codecs import Codec
from btnode.errors import CheckpointError, UnknownBlock
from btnode.store import files
from btnode.store.theta import FileTheta

log = logging.getLogger(__name__)
_STEM = re.compile(r"^v(\d{12})\.json$")


def stem(version: int) -> str:
    return f"v{version:012d}"


@dataclass
class StoredVersion:
    version: int
    params: Mapping[str, torch.Tensor]  # a dict, or a FileTheta (`in_file`)
    meta: dict[str, Any]
    outer: dict[str, torch.Tensor]


class VersionStore:
    def __init__(self, root: Path, block: int, keep: int = 3, *, stem: str | None = None):
        if keep < 1:
            raise ValueError("keep must be ≥ 1")
        self.folder = Path(root) / (stem or f"block-{block}")
        self.block = block
        self.name = stem or f"block {block}"  # for messages
        self.keep = keep

    def versions(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        found = (_STEM.match(p.name) for p in self.folder.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def write(self, version: int, params: Mapping[str, torch.Tensor] | files.Streamed, *, meta: dict[str, Any],
              delta_raw: dict[str, bytes] | None = None, delta_codec: Codec | None = None,
              outer: dict[str, torch.Tensor] | None = None) -> None:
        """Durably write version `version`; returns only after the commit record is fsynced."""
        extra: dict[str, files.Group] = {}
        if delta_raw is not None:
            extra["delta"] = delta_raw  # written as flat uint8 tensors, without a copy
        if outer:
            extra["outer"] = outer
        record = {**meta, "kind": "version", "block": self.block, "version": version,
                  "delta_codec": delta_codec.name if delta_codec is not None else None}
        files.save(self.folder, stem(version), tensors=params, meta=record, extra=extra)
        for old in self.versions():
            if old <= version - self.keep:
                files.remove(self.folder, stem(old))

    def latest(self, *, in_file: bool = False) -> StoredVersion | None:
        """The newest version whose files all verify; torn or corrupted newer ones are skipped. `in_file`:
        its θ as a FileTheta, the model file checked a tensor at a time, never read whole (store/theta.py)."""
        for v in reversed(self.versions()):
            try:
                return self.load(v, in_file=in_file)
            except CheckpointError as exc:
                log.warning("%s: skipping version %d: %s", self.name, v, exc)
        return None

    def theta(self, version: int) -> FileTheta:
        """θ of a version kept here, read from its file a tensor at a time (store/theta.py)."""
        return FileTheta(self.folder / files.file_name(stem(version), "model"))

    def load(self, version: int, *, in_file: bool = False) -> StoredVersion:
        ck = files.load(self.folder, stem(version), optional_roles=("outer",), with_model=not in_file)
        params: Mapping[str, torch.Tensor] = ck.tensors
        if in_file:
            for _ in files.iter_group(self.folder, stem(version), "model"):  # its hash, a tensor at a time
                pass
            params = self.theta(version)
        return StoredVersion(version=version, params=params, meta=ck.meta, outer=ck.extra.get("outer", {}))

    def delta(self, version: int) -> tuple[Codec, dict[str, bytes], dict[str, Any]]:
        """The published delta that produced `version`: (codec, raw bytes per tensor, metadata). Reads
        and hash-checks the delta's file only, never the model's."""
        if version not in self.versions():
            raise UnknownBlock("version", f"{self.name} keeps no version {version}")
        try:
            ck = files.load(self.folder, stem(version), roles=("delta",), with_model=False)
        except CheckpointError as exc:
            raise UnknownBlock("version", f"{self.name} version {version} has no readable delta: {exc}") from exc
        raw = {n: t.numpy().tobytes() for n, t in ck.extra["delta"].items()}
        return Codec[ck.meta["delta_codec"]], raw, ck.meta

    def delta_pieces(self, version: int) -> tuple[Codec, dict[str, Any], Iterator[tuple[str, bytes]]]:
        """As `delta`, but the raw bytes come one tensor at a time (files.iter_group): a fetch of a large
        delta never holds all of it; UnknownBlock, at the end of the iteration, if the file fails its hash."""
        if version not in self.versions():
            raise UnknownBlock("version", f"{self.name} keeps no version {version}")
        try:
            meta = files.load_meta(self.folder, stem(version))
            if "delta" not in meta["files"] or meta.get("delta_codec") not in Codec.__members__:
                raise CheckpointError("it holds no delta tensors")  # version 0, or a version made otherwise
        except CheckpointError as exc:
            raise UnknownBlock("version", f"{self.name} version {version} has no readable delta: {exc}") from exc

        def pieces() -> Iterator[tuple[str, bytes]]:
            try:
                yield from files.iter_group(self.folder, stem(version), "delta")
            except CheckpointError as exc:
                raise UnknownBlock("version", f"{self.name} version {version} has no readable delta: {exc}") from exc

        return Codec[meta["delta_codec"]], meta, pieces()
