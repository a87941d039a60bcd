"""Link profiles: the codecs a swarm uses when no codec flag says otherwise (docs/tuning.md, "Choose a
codec"). `--link wan`, the daemon's default, is the frontier `python -m bench.comms` measured for home
links: sparse8 updates at 0.3 % with error feedback, sparse8 published deltas at 0.9 %, 146× fewer
bytes than int8 up / fp32 down at +0.018 CE. DiLoCo (`--model ar`) keeps int8 both ways there: under
its Nesterov outer step no sparse row came within +0.02 CE. `--link lan` is int8 up, fp32 down, the
lossless download the library's dataclass defaults (simulator, in-process tools) keep.
"""

from __future__ import annotations

from dataclasses import dataclass

from btnode.codec.codecs import SPARSE_DENSITY, Codec
from btnode.errors import ConfigError
from btnode.settings import flag

LINKS = ("wan", "lan")
CLI_LINK = "wan"  # what `btnode join` and `btnode swarm` use without --link


@dataclass(frozen=True)
class LinkCodecs:
    codec: Codec  # the workers' updates
    density: float  # ... their share of values, for a sparse codec
    publish_codec: Codec  # the aggregator's published deltas
    publish_density: float


LAN = LinkCodecs(Codec.INT8, SPARSE_DENSITY, Codec.FP32, 0.03)
WAN = LinkCodecs(Codec.SPARSE8, 0.003, Codec.SPARSE8, 0.009)
WAN_AR = LinkCodecs(Codec.INT8, SPARSE_DENSITY, Codec.INT8, 0.03)


def link_codecs(link: str | None, kind: str | None = "block") -> LinkCodecs:
    """The codecs of `link` (None: the CLI's default) for a swarm of `kind` (block or ar)."""
    link = link or CLI_LINK
    if link not in LINKS:
        raise ConfigError(f"--link must be one of {LINKS}, got {link!r}")
    if link == "lan":
        return LAN
    return WAN_AR if kind == "ar" else WAN


@dataclass(frozen=True)
class Link:
    """Where the --link flag is declared once; the aggregator's and the worker's configs take it."""

    link: str = flag("--link", "The links this swarm runs over, which set the codecs no flag sets: wan (the default: "
                               "sparse8 updates at 0.3 % with error feedback and sparse8 published deltas at 0.9 %; "
                               "DiLoCo int8 both ways) or lan (int8 updates, fp32 published deltas). --codec, "
                               "--density, --publish-codec and --publish-density override it (docs/tuning.md).",
                     default="lan", optional=True)
