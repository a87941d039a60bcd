"""What an aggregator's state folder holds of its own: the run it belongs to (`check_run`) and the
secret its audit draws and the screen's sketches are keyed by (`secret_of`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from btnode.durable import atomic_write
from btnode.errors import ConfigError
from btnode.model.config import ModelConfig
from btnode.store.models import RUN_FILE

SECRET_FILE = "audit.secret"


def secret_of(state_dir: Path) -> bytes:
    """The key of the audit draws: 32 random bytes made once per state folder, readable by its owner only."""
    path = state_dir / SECRET_FILE
    if not path.exists():
        atomic_write(path, os.urandom(32))
        path.chmod(0o600)
    secret = path.read_bytes()
    if len(secret) != 32:
        raise ConfigError(f"{path} is not a 32-byte audit key; delete it to make a new one")
    return secret


def check_run(state_dir: Path, cfg: ModelConfig, fingerprint: str) -> None:
    """A state folder belongs to one run: refuse to mix versions of different configurations."""
    marker = state_dir / RUN_FILE
    if marker.exists():
        theirs = ModelConfig.from_dict(json.loads(marker.read_text())["model"])
        cfg.require_same(theirs, f"state folder {state_dir}")
    else:
        atomic_write(marker, json.dumps({"model": cfg.to_dict(), "fingerprint": fingerprint},
                                        indent=1).encode())
