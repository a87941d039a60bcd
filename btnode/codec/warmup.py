"""Sparsity warm-up (Deep Gradient Compression, Lin et al. 2018): a sparse codec's density over a run's first
versions, from `factor` × its final value down to it. The one place that decides the density of a worker's
update and of a published delta from the version each builds on (issue #40).

No message carries the schedule and no receiver needs it: a sparse frame names its own keep (codec/sparse.py),
which the decoder, the aggregator and an audit's replay read from the bytes, and check as they check any keep.
Keyed on the version, every replica and the aggregator follow it without agreeing on anything; a worker that
joins late, or an aggregator resumed from disk, is where the swarm is, not at the start of a warm-up."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from btnode.codec.sparse import keep_of
from btnode.errors import ConfigError
from btnode.settings import fill, flag

FACTOR = 10.0  # the start, × the final density: 0.3 % starts at 3 %, --link wan's density before #40


@dataclass(frozen=True)
class DensityWarmup:
    """Where the warm-up flags are declared once; the worker's config (for --density) and the aggregator's
    (for --publish-density) take it. Local to each node: peers need not agree (module doc)."""

    rounds: int = flag("--density-warmup-rounds", "Sparse densities (--density, --publish-density) start at "
                                                  "--density-warmup-factor × their value (at most 1) and decay "
                                                  "geometrically to it over this many versions (0: none; default: "
                                                  "--link's; docs/tuning.md).", default=0, optional=True)
    factor: float = flag("--density-warmup-factor", "A sparse density's start, × its final value, during "
                                                    "--density-warmup-rounds.", default=FACTOR, optional=True)

    def __post_init__(self) -> None:
        if self.rounds < 0:
            raise ConfigError(f"--density-warmup-rounds must be 0 or more, got {self.rounds}")
        if not self.factor >= 1:
            raise ConfigError(f"--density-warmup-factor must be at least 1, got {self.factor}")

    def density(self, final: float, version: int) -> float:
        """The density of an update or published delta built on `version`: start · (final/start)^(v/W) for
        v < W (start = min(1, factor · final)), `final` from version W on."""
        if version >= self.rounds:
            return final
        start = min(1.0, self.factor * final)
        return max(final, min(start, start * (final / start) ** (max(0, version) / self.rounds)))

    def keep(self, final: float, version: int) -> int:
        """Values kept per 4,096-value chunk (codecs.encode's `keep`) at `version`."""
        return keep_of(self.density(final, version))

    def over(self, values: Mapping[str, Any]) -> DensityWarmup:
        """This warm-up (a link's) with the fields the flags `values` give."""
        return fill(DensityWarmup, values, base=self)


NONE = DensityWarmup()
