"""Which weights a chain serves, and the model id clients send for them: NAME-vVERSION-HASH8, so a
new version of the weights is a new id (OpenAI's ids name weights, not shapes). A stage knows its
own unit's hash and the checkpoint it came from; a chain's `Weights` are its stages' joined in
chain order, so `btnode serve` and a proxy in front of a chain of separate stages give one
checkpoint the same id. Free of torch: the HTTP proxy (node/api.py) builds ids from an entry's Info."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Origin:
    """Where a stage's weights came from: the checkpoint's name ("" when unknown, as for a block
    pulled from a live aggregator) and its version (an aggregator's round, or a training step)."""

    name: str = ""
    version: int = 0


def chain_sha256(units: Sequence[str]) -> str:
    """One hash of the served weights: sha256 over each unit's canonical state hash (hex), in chain order."""
    h = hashlib.sha256()
    for unit in units:
        h.update(unit.encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Weights:
    """The weights of a chain from one stage to its end: the first stage's checkpoint name, the
    newest version on it, and each unit's canonical state hash in chain order (store.files.state_sha256;
    a block chain: one per block; an AR chain: the model's once, when every stage holds the same)."""

    name: str
    version: int
    units: tuple[str, ...]

    def then(self, rest: Weights | None, *, same_unit: bool = False) -> Weights | None:
        """These weights followed by the rest of the chain's (None: unknown, so the whole is unknown).
        `same_unit`: every stage holds the whole model (the AR chain), so equal hashes count once."""
        if rest is None:
            return None
        units = self.units if same_unit and rest.units == self.units else self.units + rest.units
        return Weights(name=self.name, version=max(self.version, rest.version), units=units)

    @property
    def sha256(self) -> str:
        return chain_sha256(self.units)


@dataclass(frozen=True)
class ModelIdentity:
    """Which weights are served, as clients, logs and metrics name them."""

    name: str
    version: int  # the checkpoint's version (an aggregator's round) or training step
    weights_sha256: str  # over every unit's canonical state hash, in chain order (chain_sha256)

    @classmethod
    def of(cls, weights: Weights, name: str = "", fallback: str = "btnode") -> ModelIdentity:
        """The identity of a chain's weights: named `name`, else the checkpoint's name, else `fallback`."""
        return cls(name=name or weights.name or fallback, version=weights.version, weights_sha256=weights.sha256)

    @property
    def id(self) -> str:
        return f"{self.name}-v{self.version}-{self.weights_sha256[:8]}"

    @property
    def fingerprint(self) -> str:
        """OpenAI's `system_fingerprint` of a reply: the version and the weights' hash."""
        return f"v{self.version}-{self.weights_sha256[:12]}"
