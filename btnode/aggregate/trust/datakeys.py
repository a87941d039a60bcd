"""`DataKeys`: which windows each worker trains is decided by the swarm, not by the worker. The
aggregator hands every (block, worker id) a data key at Join, "B/S" with S the order in which
worker ids first joined block B, and the worker draws its windows as
`WindowSampler.batch(seed, key, step, batch)`. Keys are disjoint by construction, a re-join gets its
key back, and the assignment is written durably to the state folder, so a restarted aggregator
hands out the same keys. It also holds the swarm's data id: what every worker must train on."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from btnode.errors import CheckpointError, ConfigError, ConfigMismatchError
from btnode.durable import atomic_write

KEYS_FILE = "data_keys.json"


def data_key(block: int, slot: int) -> str:
    return f"{block}/{slot}"


class DataKeys:
    """The data keys of the blocks one aggregator owns, and the swarm's data id: `fixed` (the
    aggregator's --data-id) or, without one, the first id a worker states."""

    def __init__(self, state_dir: Path, *, fixed: str | None = None):
        self.path = state_dir / KEYS_FILE
        self._lock = threading.Lock()
        self.data_id, self._joined = self._read()  # block → worker ids in the order they first joined
        if fixed is not None:
            if self.data_id is not None and self.data_id != fixed:
                raise ConfigError(f"--data-id {fixed} differs from the data id {self.data_id} this state folder's "
                                  f"workers trained on ({self.path})")
            if self.data_id is None:
                self.data_id = fixed
                self._write()

    def assign(self, block: int, worker_id: str, data_id: str) -> str:
        """The data key of `worker_id` on `block` (a new one for a new worker), once its data id is
        checked: a stated id must be the swarm's, and the first stated id becomes the swarm's."""
        with self._lock:
            changed = False
            if data_id and self.data_id is None:
                self.data_id, changed = data_id, True
            elif data_id and data_id != self.data_id:
                raise ConfigMismatchError(f"worker {worker_id!r} trains on data {data_id}, but this swarm trains on "
                                          f"{self.data_id}", [("data", self.data_id, data_id)])
            joined = self._joined.setdefault(block, [])
            if worker_id not in joined:
                joined.append(worker_id)
                changed = True
            if changed:
                self._write()
            return data_key(block, joined.index(worker_id))

    def of(self, block: int) -> dict[str, str]:
        """worker id → data key, for every worker that ever joined `block`."""
        with self._lock:
            return {w: data_key(block, s) for s, w in enumerate(self._joined.get(block, ()))}

    def _write(self) -> None:
        doc = {"data_id": self.data_id, "blocks": {str(b): ws for b, ws in sorted(self._joined.items())}}
        atomic_write(self.path, json.dumps(doc, indent=1).encode())

    def _read(self) -> tuple[str | None, dict[int, list[str]]]:
        if not self.path.exists():
            return None, {}
        try:
            doc = json.loads(self.path.read_bytes())
            data_id, blocks = doc["data_id"], {int(b): list(ws) for b, ws in doc["blocks"].items()}
            ok = (data_id is None or isinstance(data_id, str)) and all(
                isinstance(w, str) for ws in blocks.values() for w in ws)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{self.path} cannot be read as the swarm's data keys: {exc}") from exc
        if not ok:
            raise CheckpointError(f"{self.path} cannot be read as the swarm's data keys: unexpected value types")
        return data_id, blocks
