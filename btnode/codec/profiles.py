"""Link profiles: the codecs a swarm uses when no codec flag says otherwise (docs/tuning.md, "Choose a
codec"). `--link wan`, the daemon's default: sparse8 updates at 3 % with error feedback, sparse8
published deltas at 9 %: 25× fewer bytes than int8 up / fp32 down at −0.013 CE in `python -m
bench.comms`. The 146× row (0.3 % / 0.9 %, +0.018 there) was the first choice and failed the checks a
default must pass: in the cheats bench's 5-replica swarm of a 47 k-parameter block (8 rounds) it costs
the honest swarm 1.5–1.8 nats/byte against lan, and not through the robust screen (with it off: CE
4.20–4.52, on: 4.27–4.56): too few values reach so small a block in so few rounds, through the 0.9 %
publish most (bench/results/cheats/screen/). DiLoCo
(`--model ar`, whose outer step is η = 1, μ = 0.3: aggregate/sums/averaging.py) keeps int8 up, fp32 down:
sparse2 at 2 % up and 4 % published is 66× fewer bytes within +0.02 CE at the bench's H = 5 (3 seeds,
bench/results/comms/diloco/), but +0.16 at the daemon's H = 50, where only ~20× (10 % / 20 %, one seed)
stayed within +0.02; one flag away until a denser setting passes at H = 50 over seeds. `--link lan` is int8 up, fp32 down, which the library's dataclass defaults (simulator, in-process
tools) keep. A profile may carry a density warm-up (codec/warmup.py: the sparse densities start at 10× and
decay over the first versions, for the 0.3 % row's few early rounds); none does: at 0.3 % / 0.9 % over 20
versions from 10× it was +0.067 in `bench.comms` (without it +0.31 on the same code; 177× fewer bytes after
the warm-up), and honest CE in the cheats bench's 30 rounds 2.94–3.11 against 2.79–2.87 at 3 % (3 seeds;
bench/results/{comms,cheats}/warmup/).
"""

from __future__ import annotations

from dataclasses import dataclass

from btnode.codec.codecs import SPARSE_DENSITY, Codec
from btnode.codec.warmup import NONE, DensityWarmup
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
    warmup: DensityWarmup = NONE  # both densities over the first versions (codec/warmup.py)


LAN = LinkCodecs(Codec.INT8, SPARSE_DENSITY, Codec.FP32, 0.03)
WAN = LinkCodecs(Codec.SPARSE8, 0.03, Codec.SPARSE8, 0.09)
# DiLoCo: int8 / fp32 (see above). The short-round setting, one flag away: two full replicas' 2 % top-k
# overlap little, so their mean has up to 4 % nonzeros, which a publish at 4 % carries nearly whole; 2-bit
# values both ways (sparse8 published at 4 %: 28 % more bytes for 0.003 lower CE, plain averaging, 3 seeds)
SHORT_ROUNDS_AR = LinkCodecs(Codec.SPARSE2, 0.02, Codec.SPARSE2, 0.04)
WAN_AR = LAN


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
                               "sparse8 updates at 3 % with error feedback and sparse8 published deltas at 9 %; "
                               "DiLoCo: int8 and fp32, as lan) or lan (int8 updates, fp32 published deltas). --codec, "
                               "--density, --publish-codec and --publish-density override it (docs/tuning.md).",
                     default="lan", optional=True)
