"""`TrainingTerms`: the training settings a worker states at Join (its whole TrainConfig and H), as
JSON. The aggregator judges the swarm-wide ones (aggregate/trust/claims.py) and keeps the rest, so that a
replay of an update can rebuild the worker's exact training. Here, below both sides, so that the
worker (swarm) and the aggregator (aggregate) read and write one format."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from btnode.errors import ConfigError, MalformedInput
from btnode.train.config import Precision, TrainConfig

MAX_JSON = 4096  # characters: a TrainConfig and H take about 300
H = "steps_per_round"
_TYPES = typing.get_type_hints(TrainConfig)


@dataclass(frozen=True)
class TrainingTerms:
    """A worker's TrainConfig and its H (steps per update). `train.steps` and `train.warmup` are its
    own schedule's length (node/worker.py join_worker) and differ per worker; the aggregator judges
    batch, lr, H and AdamW's betas and weight decay (ClaimConfig)."""

    train: TrainConfig
    steps_per_round: int

    def to_json(self) -> str:
        fields = dataclasses.asdict(self.train)
        fields["precision"] = self.train.precision.value
        return json.dumps({**fields, H: self.steps_per_round}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainingTerms:
        """The terms a peer stated; MalformedInput("training") for anything but `to_json`'s output:
        bad JSON, unknown or missing fields, a wrong type, a value TrainConfig refuses."""
        if len(text) > MAX_JSON:
            raise MalformedInput("training", f"training settings of {len(text)} characters, over {MAX_JSON}")
        try:
            raw = json.loads(text, parse_constant=_no_constant)
        except ValueError as exc:
            raise MalformedInput("training", f"training settings are not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise MalformedInput("training", f"training settings must be a JSON object, got {type(raw).__name__}")
        expected = set(_TYPES) | {H}
        unknown, missing = sorted(set(raw) - expected), sorted(expected - set(raw))
        if unknown or missing:
            raise MalformedInput("training", f"training settings with unknown fields {unknown} and missing {missing}")
        h = raw.pop(H)
        if not _is(h, int) or h < 1:
            raise MalformedInput("training", f"{H} must be a positive integer, got {h!r}")
        for name, value in raw.items():
            if not _fits(value, _TYPES[name]):
                raise MalformedInput("training", f"training setting {name} = {value!r} is not of type {_TYPES[name]}")
        try:
            return cls(TrainConfig(**raw), h)
        except ConfigError as exc:
            raise MalformedInput("training", f"training settings refused: {exc}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a setting may take")


def _is(value: Any, kind: type) -> bool:
    """JSON's own types: bool is not an int here, and an integral float is written as an int."""
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def _fits(value: Any, hint: Any) -> bool:
    if hint is Precision:
        return value in {p.value for p in Precision}
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(value is None if a is type(None) else _fits(value, a) for a in typing.get_args(hint))
    return _is(value, hint)
