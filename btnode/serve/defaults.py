"""The serving defaults: the readout, K and grid size a request gets when it names none, chosen from
what bench/serving.py and the judge measured (BENCHMARKS.md, serving frontier), overridable by a
`serving.json` beside a checkpoint; and `describe_settings`, what each setting means, for /v1/models."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from btnode.errors import ConfigError
from btnode.model.config import ModelConfig
from btnode.model.readout import Readout

SERVING_FILE = "serving.json"  # beside a checkpoint's blocks: {"readout": "spec", "k": 16, "steps": 7}
# bench/results/serving/default.json (2026-12-02, runs/served2: d = 128, 3 blocks × 2 layers, N = 128):
# at AR quality (judge CE within 0.10 nats/byte of the AR chain's), the fastest mode whose every byte is
# the pooled blocks' is readout spec at K = 16 ("best_spec_at_ar_quality": judge CE 1.647 vs AR 1.675,
# 53 bytes/s over the emulated WAN vs 10.6 for the AR chain). Pool at K = 16 serves letter soup (5.87).
MEASURED_READOUT = Readout.SPEC
MEASURED_K = 16
MEASURED_LABEL = "blockwise K=16 spec"  # the serving bench's label of that mode (checked by a test)


@dataclass(frozen=True)
class ServingDefaults:
    """What a block-chain request that leaves a setting unset gets. `n_steps` None: 2B + 1."""

    readout: Readout = MEASURED_READOUT
    k: int = MEASURED_K
    n_steps: int | None = None
    source: str = "measured"  # "measured" (bench/results/serving) or the serving.json it came from

    def as_dict(self) -> dict[str, Any]:
        return {"readout": self.readout.value, "k": self.k, "steps": self.n_steps, "source": self.source}


def serving_defaults(cfg: ModelConfig, checkpoint: Path | None = None) -> ServingDefaults:
    """The defaults for a block chain of this model: a checkpoint's serving.json when it has one
    (ConfigError when it is malformed), else the measured best, K at most an eighth of the context as
    measured (K = 16 at N = 128), so that a prompt keeps 7/8 of the window (N − K + 1 bytes): at N = 32
    a K of 16 left 17 bytes, less than a short chat prompt."""
    if checkpoint is not None and (checkpoint / SERVING_FILE).is_file():
        return _from_file(cfg, checkpoint / SERVING_FILE)
    k = min(MEASURED_K, cfg.context // 8)
    return ServingDefaults(readout=MEASURED_READOUT, k=max(1, k))


def _from_file(cfg: ModelConfig, path: Path) -> ServingDefaults:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict) or set(raw) - {"readout", "k", "steps"}:
        raise ConfigError(f"{path}: expected an object with readout, k and steps, got {raw!r}")
    try:
        readout = Readout(raw.get("readout", MEASURED_READOUT.value))
    except ValueError:
        raise ConfigError(f"{path}: unknown readout {raw.get('readout')!r}") from None
    k, steps = raw.get("k", MEASURED_K), raw.get("steps")
    if isinstance(k, bool) or not isinstance(k, int) or not (1 <= k <= cfg.context // 2 if readout.drafts
                                                             else k in cfg.segments):
        raise ConfigError(f"{path}: k={k!r} cannot be served with readout {readout.value!r} "
                          f"(trained K: {list(cfg.segments)}; spec drafts 1 … {cfg.context // 2})")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 2):
        raise ConfigError(f"{path}: steps must be an integer ≥ 2, got {steps!r}")
    return ServingDefaults(readout=readout, k=k, n_steps=steps, source=str(path))


READOUT_MEANING = {
    Readout.SPEC: "block 0 drafts K bytes, every block scores them in the same traversal and the last keeps the "
                  "prefix the pooled blocks accept: 1 … K bytes per traversal, each a sample of the pooled "
                  "blocks (readable text; the default)",
    Readout.SPEC_FILL: "spec, the rest of the segment filled by the last block alone: K bytes per traversal, "
                       "slightly worse text",
    Readout.COMMIT: "one diffusion sweep, then the last block commits the K bytes one by one (word-shaped text)",
    Readout.POOL: "one diffusion sweep, every byte of the segment sampled independently: readable only at K = 1",
    Readout.LAST: "the sweep's last evaluation alone, bytes independent: readable only at K = 1",
}


def describe_settings(cfg: ModelConfig, defaults: ServingDefaults) -> dict[str, Any]:
    """What the block chain's settings mean and which give readable text, for /v1/models and the
    page. The prompt budget: a sweep of K sees N − K + 1 bytes; spec sees the whole N − K + 1 too."""
    return {
        "defaults": defaults.as_dict(),
        "readouts": {r.value: READOUT_MEANING[r] for r in Readout},
        "k": (f"bytes per traversal (spec: the draft length, any 1 … {cfg.context // 2}; a sweep: one of "
              f"{list(cfg.segments)}); the prompt may hold N − K + 1 bytes"),
        "prompt_bytes": {str(k): cfg.context - k + 1 for k in sorted({*cfg.segments, defaults.k})},
        "steps": f"sampler grid points per sweep (default 2B + 1 = {2 * cfg.n_blocks + 1}); spec runs none",
        "readable": f"readout spec (any K up to {cfg.context // 2}), commit, or any readout at K = 1",
    }
