"""The model's configuration: every field here is swarm-wide and hashed into the run fingerprint.

Peers that disagree on any of these fields cannot exchange blocks, so a mismatch is reported
field by field (`diff`). Local settings (device, threads, batch, learning rate, data path) live in
the training configuration instead and never enter the fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from btnode.errors import ConfigError, ConfigMismatchError
from btnode.settings import fill, flag, join_ints, parse_ints, to_flags

FINGERPRINT_VERSION = 1  # bump when the meaning of a field or the model code changes


_TAIL_FIELDS = ("tail_blocks", "sigma_gen")
# Fields added after models were stored: left out of to_dict (and so of the fingerprint) at these values,
# and read back at them when a stored dict lacks them, so a model keeps the fingerprint it had before the
# field existed (ctx_head's default is 1 now: an old checkpoint without the field is a ctx_head = 0 model).
_OPTIONAL_FIELDS = {"ada_rank": 0, "ctx_head": 0}
_KIND_FIELDS = ("kind", "ar_layers")


class UnitKind(StrEnum):
    """What a swarm trains and a stage serves: ModelConfig.kind's values (a str, as flags and TOML give it)."""

    BLOCK = "block"  # BlockTrain: B diffusion blocks (and T tail blocks), each its own unit
    AR = "ar"  # DiLoCo: one autoregressive model, the swarm's one unit


KINDS = tuple(k.value for k in UnitKind)


def _swarm_wide(names: str, help: str, **kw: Any) -> Any:
    """A swarm-wide flag: every field a flag sets here is hashed into the fingerprint."""
    return flag(names, help, swarm_wide=True, **kw)


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256  # byte-level: one class per byte value
    d_model: int = _swarm_wide("--d-model", "Model width d.", default=128)  # width of every block (and of the AR baselines)
    n_heads: int = _swarm_wide("--heads", "Attention heads.", default=4)  # attention heads per layer
    n_layers: int = _swarm_wide("--layers", "Layers per block L.", default=2)  # L: layers per block
    n_blocks: int = _swarm_wide("--blocks", "Number of blocks B.", default=3)  # B: blocks, each trained independently on its own noise interval
    context: int = _swarm_wide("--context", "Context length N in bytes.", default=128)  # N: bytes of clean context / noisy targets per training window
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model
    sigma_lo: float = 1.0  # lowest noise level; with unit-norm targets σ ≥ 1 leaks ≤ 0.5 nats
    sigma_hi: float = 10.0  # highest noise level, where sampling starts
    p_mean: float = -1.2  # ln σ ~ N(p_mean, p_std), truncated to [sigma_lo, sigma_hi]
    p_std: float = 1.2
    gamma: float = 0.1  # overlap: each block trains slightly beyond its partition cell
    sigma_data: float = 0.5  # EDM's σ_d, used by c_in and the loss weight λ(σ)
    target_seed: int = _swarm_wide("--target-seed", "Seed of the fixed target table E.", default=0)  # seed of the fixed unit-norm target table E
    segments: tuple[int, ...] = _swarm_wide("--segments", "Comma-separated segment lengths K to train; must include 1.",
                                      default=(1, 16), value=str, parse=lambda t: parse_ints(t, "--segments"),
                                      format=join_ints)  # segment lengths K trained (and servable)
    # Tail blocks (issue #11): blocks B … B+T−1 train on [sigma_gen, sigma_lo], below the scoring chain's
    # last noise level, so that generation can continue past σ_lo and commit a segment jointly. They are
    # ordinary blocks (own σ interval, own workers and stage); K = 1 scoring never runs them.
    tail_blocks: int = _swarm_wide("--tail-blocks", "T: tail blocks trained below σ_lo for joint multi-byte generation.",
                             default=0)
    sigma_gen: float = _swarm_wide("--sigma-gen", "σ the tail blocks end at (used only with --tail-blocks).", default=0.1)
    # What the swarm trains (issue #12). "block": the B (+T) diffusion blocks, each its own unit.
    # "ar": DiLoCo, every worker trains a full replica of an `ar_layers`-layer autoregressive model
    # (model/ar.py), and that whole model is the swarm's one unit, unit 0, aggregated exactly as a
    # block is. The σ, γ, target and segment fields then shape nothing, but stay in the fingerprint.
    kind: str = _swarm_wide("--model", "What the swarm trains: block (BlockTrain: B blocks, a worker trains one) or ar "
                             "(DiLoCo: every worker trains a full replica of the AR model, the swarm's one unit); "
                             "a stage: what it serves, a block of the one-sweep chain or a slice of an AR model.",
                      default="block")
    ar_layers: int = _swarm_wide("--ar-layers", "Depth of the AR model of a --model ar run (default B·L).", default=0,
                           format=lambda n: n or None)  # depth of the AR model of a kind="ar" run (0 otherwise)
    # The noisy stream's σ-conditioning (issue #12, bytes per round). 0: every layer has its own
    # full-rank AdaLN map from a d-wide σ-embedding (6d² per layer, a third of the block's layer
    # parameters). r > 0: the σ-embedding is r wide and every layer maps it to its 6d modulation
    # through an r × 6d matrix, so the σ path costs ≈ r·d·(6L + 2) instead of d²·(6L + 3). A block
    # covers a narrow σ interval, and σ is one number, so little is lost (measured in BENCHMARKS.md).
    ada_rank: int = _swarm_wide("--ada-rank", "Rank r of the blocks' σ-conditioning: 0 gives every layer a full-rank AdaLN map "
                                        "(6d² parameters each); r > 0 a shared r-wide σ-embedding and r × 6d maps, "
                                        "fewer bytes per round.", default=0)
    # The clean stream's own next-byte head (issue #42). 1: the clean stream, a causal L-layer transformer
    # over the context, also predicts x_{j+1} at every position j (one d × 256 head, trained at every
    # step on all N positions, as an AR-L model is), and that head is the block's context readout for
    # rows that predict the byte right after their context (K = 1 rows, drafts). 0: the context readout
    # is the noisy stream at z = 0, σ_hi, trained only on the `ctx_share` samples. 1 by default: with
    # TrainConfig's noisy_rows 0.25 and ctx_weight 50 it reads context 0.23–0.24 nats/byte better at
    # equal time over 2 seeds (docs/research.md). An AR run has no clean stream: 0 there, whatever is given.
    ctx_head: int = _swarm_wide("--ctx-head", "1: the clean stream gets its own next-byte head, trained at every step "
                                "and read as the block's context readout (0: the noisy stream at z = 0, as "
                                "models before it).", default=1)

    @property
    def total_blocks(self) -> int:
        """Every unit a swarm trains: the B scoring blocks and the T tail blocks, or the one AR model."""
        return 1 if self.kind == "ar" else self.n_blocks + self.tail_blocks

    def unit_name(self, block: int) -> str:
        """How logs and the local swarm name unit `block`: "block 2", or "ar" for a DiLoCo run's model."""
        return "ar" if self.kind == "ar" else f"block {block}"

    def is_tail(self, block: int) -> bool:
        return self.n_blocks <= block < self.total_blocks

    def __post_init__(self) -> None:
        problems = []
        if self.vocab != 256:
            problems.append(f"vocab must be 256 (bytes), got {self.vocab}")
        if self.d_model <= 0 or self.n_heads <= 0 or self.d_model % self.n_heads:
            problems.append(f"d_model={self.d_model} must be a positive multiple of n_heads={self.n_heads}")
        if self.n_layers < 1 or self.n_blocks < 1:
            problems.append(f"need n_layers ≥ 1 and n_blocks ≥ 1, got {self.n_layers}, {self.n_blocks}")
        if self.context < 2:
            problems.append(f"context must be ≥ 2 bytes, got {self.context}")
        if not 0 < self.sigma_lo < self.sigma_hi:
            problems.append(f"need 0 < sigma_lo < sigma_hi, got {self.sigma_lo}, {self.sigma_hi}")
        if self.tail_blocks < 0 or (self.tail_blocks and not 0 < self.sigma_gen < self.sigma_lo):
            problems.append(f"need tail_blocks ≥ 0 and 0 < sigma_gen < sigma_lo, got {self.tail_blocks}, {self.sigma_gen}")
        if self.kind not in KINDS:
            problems.append(f"kind must be one of {KINDS}, got {self.kind!r}")
        elif self.kind == "ar" and (self.ar_layers < 1 or self.tail_blocks):
            problems.append(f"an AR run needs ar_layers ≥ 1 and no tail blocks, got {self.ar_layers}, {self.tail_blocks}")
        elif self.kind == "block" and self.ar_layers:
            problems.append(f"ar_layers is for kind='ar' runs only, got {self.ar_layers} with kind='block'")
        if self.ada_rank < 0:
            problems.append(f"ada_rank must be ≥ 0 (0: full-rank AdaLN), got {self.ada_rank}")
        if self.kind == "ar":  # no clean stream to give a head to (the AR model's own head reads every position)
            object.__setattr__(self, "ctx_head", 0)
        if self.ctx_head not in (0, 1):
            problems.append(f"ctx_head must be 0 or 1, got {self.ctx_head}")
        if self.p_std <= 0 or self.gamma < 0 or self.sigma_data <= 0:
            problems.append("p_std and sigma_data must be > 0 and gamma ≥ 0")
        segs = tuple(self.segments)
        if not segs or any(int(k) != k or k < 1 or k > self.context for k in segs):
            problems.append(f"segments must be integers in [1, context={self.context}], got {segs}")
        elif 1 not in segs:
            problems.append(f"segments must include K=1, got {segs}")
        if problems:
            raise ConfigError("invalid model configuration: " + "; ".join(problems))
        object.__setattr__(self, "segments", tuple(sorted(set(int(k) for k in segs))))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["segments"] = list(self.segments)
        if self.tail_blocks == 0:  # a model without a tail keeps the fingerprint it had before tails existed
            for name in _TAIL_FIELDS:
                del d[name]
        if self.kind == "block":  # ... and a block run the one it had before AR runs existed
            for name in _KIND_FIELDS:
                del d[name]
        for name, default in _OPTIONAL_FIELDS.items():  # ... and a run at a default the one it had before the field
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown model settings: {', '.join(unknown)}")
        d = {**_OPTIONAL_FIELDS, **d}  # a dict stored before a field existed: the value it had then
        if "segments" in d:
            d["segments"] = tuple(d["segments"])
        return cls(**d)

    def fingerprint(self) -> str:
        """sha256 over the canonical JSON of every swarm-wide field (and the format version)."""
        doc = {"fingerprint_version": FINGERPRINT_VERSION, **self.to_dict()}
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @classmethod
    def from_flags(cls, values: Mapping[str, Any]) -> ModelConfig:
        """The configuration the flags give (keyed by parameter name: d_model, heads, …, model,
        ar_layers); an absent flag keeps its default. --ar-layers defaults to B·L in an AR run."""
        kind = values.get("model") or "block"
        if kind not in KINDS:
            raise ConfigError(f"--model must be one of {', '.join(KINDS)}, got {kind!r}")
        depth = values.get("ar_layers")
        if depth is not None and kind != "ar":
            raise ConfigError("--ar-layers is the depth of a --model ar run; this is a block run")
        if kind == "ar" and depth is None:
            depth = values.get("blocks", cls.n_blocks) * values.get("layers", cls.n_layers)
        return fill(cls, values, ar_layers=depth if kind == "ar" else 0)

    def to_flags(self) -> list[str]:
        """The command-line flags that make this configuration (`btnode join`, `train-local`, …): how
        `btnode swarm` and the benchmarks hand a shape to the nodes they start. ConfigError for a
        field no flag sets (σ range, γ, …) away from its default: flags could not carry it."""
        return to_flags(self)

    def diff(self, other: ModelConfig) -> list[tuple[str, object, object]]:
        """(field, ours, theirs) for every swarm-wide field that differs."""
        a, b = dataclasses.asdict(self), dataclasses.asdict(other)
        return [(k, a[k], b[k]) for k in a if a[k] != b[k]]

    def require_same(self, other: ModelConfig, what: str) -> None:
        fields = self.diff(other)
        if fields:
            detail = ", ".join(f"{k}: expected {ours!r}, got {theirs!r}" for k, ours, theirs in fields)
            raise ConfigMismatchError(f"{what} has a different model configuration ({detail})", fields)
