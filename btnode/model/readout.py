"""How a sweep's last evaluation becomes bytes: the `Readout` choices and the one default that the
library (sampler, evaluation, serving), the CLI and the wire (READOUT_UNSPECIFIED) share."""

from __future__ import annotations

from enum import Enum

from btnode.errors import InputError


class Readout(str, Enum):
    """A str enum: each value is the string `--readout` takes, so `Readout("pool")` parses and
    `Readout.POOL == "pool"`; the wire carries btnode.v2.Readout, matched by name (rpc/convert.py)."""

    POOL = "pool"  # the last evaluation pooled with every block's context readout (mean log-prob)
    LAST = "last"  # the last evaluation alone (the design's readout; the only one through the tail)
    COMMIT = "commit"  # the last stage commits the segment byte by byte, each byte after the ones before it
    SPEC = "spec"  # block 0 drafts, the pooled blocks keep an accepted prefix (1 … K bytes); no sweep
    SPEC_FILL = "spec-fill"  # spec, the rest of the segment filled by the last block alone (K bytes)

    @property
    def drafts(self) -> bool:
        """Block 0 drafts the segment and every block scores the draft: no diffusion sweep runs."""
        return self in (Readout.SPEC, Readout.SPEC_FILL)

    @property
    def pools(self) -> bool:
        """Every block adds its context readout's log-probs to a sum passed hop by hop."""
        return self in (Readout.POOL, Readout.SPEC, Readout.SPEC_FILL)

    @classmethod
    def parse(cls, value: str) -> Readout:
        """A user's or peer's readout string → Readout, or InputError naming the choices."""
        try:
            return cls(value)
        except ValueError:
            raise InputError(f"readout must be one of {[r.value for r in cls]}, got {value!r}") from None


SWEEP_READOUTS = (Readout.POOL, Readout.LAST)  # what the plain sweep reads (`sampler.sweep`, `btnode eval`)
DEFAULT_READOUT = Readout.POOL  # the chain is then at least an ensemble of its blocks (BENCHMARKS.md)


def default_readout(n_tail: int = 0) -> Readout:
    """The one default: DEFAULT_READOUT for a sweep that ends at σ_lo; LAST through the tail blocks,
    whose last evaluation is the joint sample (pooling would average per-position marginals again)."""
    return Readout.LAST if n_tail else DEFAULT_READOUT


def check_sweep_readout(readout: str) -> Readout:
    """A readout the plain sweep reads, or ValueError: the others need a serving stage."""
    if readout not in SWEEP_READOUTS:
        raise ValueError(f"readout must be one of {[r.value for r in SWEEP_READOUTS]}, got {readout!r}")
    return Readout(readout)
