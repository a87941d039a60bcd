"""The aggregator's settings (`AggregatorConfig`, declared once beside its flags) and what a block
reports of itself (`BlockStatus`, `RoundSummary`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from btnode.aggregate.sums.accumulate import SPARSE_MEANS
from btnode.aggregate.sums.averaging import OuterConfig
from btnode.aggregate.round.rounds import RoundConfig
from btnode.aggregate.trust.audit import AuditConfig
from btnode.aggregate.trust.claims import ClaimConfig
from btnode.aggregate.trust.delegate import DelegationConfig
from btnode.aggregate.trust.evidence import RelayAuditConfig
from btnode.aggregate.trust.standing import StandingConfig
from btnode.codec.codecs import Codec, parse
from btnode.codec.profiles import CLI_LINK, LINKS, Link, link_codecs
from btnode.codec.warmup import DensityWarmup
from btnode.errors import ConfigError
from btnode.protocol import VersionInfo
from btnode.settings import fill, flag, same_flag
from btnode.store.theta import IN_FILE_BYTES


@dataclass(frozen=True)
class AggregatorConfig:
    round: RoundConfig = RoundConfig()
    outer: OuterConfig = OuterConfig()
    claims: ClaimConfig = ClaimConfig()  # the swarm's batch, H and inner lr: an update's weight and bound
    audit: AuditConfig = AuditConfig()  # replay audits: share, probation, how long a state may take
    delegation: DelegationConfig = DelegationConfig()  # who replays them: other workers, refereed (delegate.py)
    relay_audit: RelayAuditConfig = RelayAuditConfig()  # relays' combined pushes checked bit for bit (evidence.py)
    standing: StandingConfig = StandingConfig()  # an identity's weight from its verified work and drops (standing.py)
    open: bool = flag("--open/--no-open", "Anyone may join, without a join code: a new identity's updates weigh "
                                          "nothing until it has passed its probation audits, then grow with the "
                                          "audits it passes (--full-standing). Needs --audit. docs/security.md.",
                      default=False)
    update_codecs: tuple[Codec, ...] = tuple(Codec)
    link: str = same_flag(Link, "link")  # the profile the CLI filled the publish codec from (codec/profiles.py)
    publish_codec: Codec = flag("--publish-codec", "Codec of published deltas: fp32, bf16, int8, sparse8, sparse2 "
                                                   "(default: --link's).",
                                default=Codec.FP32, value=str, parse=parse, optional=True,
                                format=lambda c: c.name.lower())  # every replica applies these same bytes, lossy or not
    publish_density: float = flag("--publish-density", "Share of values a sparse publish codec sends (0, 1]; default: "
                                                       "--link's.",
                                  default=0.03, optional=True)  # a sparse publish codec keeps the top of step + residual
    warmup: DensityWarmup = DensityWarmup()  # ... denser over the first versions (codec/warmup.py)
    keep: int = flag("--keep", "Versions kept on disk per block.", default=3)  # versions kept on disk
    max_norm_ratio: float = 10.0  # reject an update whose norm exceeds this × the median accepted norm
    screen_band: tuple[float, float] = (0.5, 2.0)  # screened mode: keep norms within this × the round's median
    screen_cosine: float = 0.7  # screened mode: drop a cosine with the median update under this × the round's median cosine
    history: int = 20  # round summaries kept for status
    theta_in_file_bytes: int = IN_FILE_BYTES  # a unit larger in fp32 keeps θ in its version file, not in memory
    sparse_mean: str = flag("--sparse-mean", "How sparse updates are averaged per coordinate: senders (over the updates "
                                             "that sent it) or all (docs/tuning.md).", default="senders")
    decode_slots: int = flag("--decode-slots", "Pushes decoded and judged at once; the others wait, holding only "
                                               "their compressed bytes (bounds the memory of pushes in flight). "
                                               "Of a unit over 64 MiB, one at a time.",
                             default=2)
    mmap_threshold_kib: int = flag("--mmap-threshold-kib", "glibc's mmap threshold: freed blocks from this size up "
                                                           "go back to the kernel at once. 0: the role's default "
                                                           "(aggregator 128, relay 4096; docs/operations.md).",
                                   default=0)  # memory against page faults (node/memory.py)
    clip: bool = flag("--clip/--no-clip", "Scale an update larger than the median norm of recent accepted updates "
                                          "down to it before averaging.", default=False)

    @classmethod
    def from_flags(cls, values: Mapping[str, Any]) -> AggregatorConfig:
        """The flags' settings; a publish codec and density no flag gives come from --link (the CLI's
        default: wan) for the swarm's model (codec/profiles.py)."""
        made = fill(cls, values)
        link = link_codecs(values.get("link"), values.get("model"))
        return replace(made, link=values.get("link") or CLI_LINK,
                       publish_codec=made.publish_codec if values.get("publish_codec") is not None else link.publish_codec,
                       publish_density=(made.publish_density if values.get("publish_density") is not None
                                        else link.publish_density),
                       warmup=link.warmup.over(values))

    def __post_init__(self) -> None:
        if self.link not in LINKS:
            raise ConfigError(f"--link must be one of {LINKS}, got {self.link!r}")
        if self.open and not (self.audit.on and self.audit.probation >= 1):
            raise ConfigError("--open needs replay audits with probation (--audit P > 0, --probation ≥ 1): without "
                              "them no identity can earn the standing its updates' weight comes from")
        if not 0 < self.publish_density <= 1:
            raise ConfigError(f"--publish-density must be in (0, 1], got {self.publish_density}")
        if self.decode_slots < 1:
            raise ConfigError(f"--decode-slots must be at least 1, got {self.decode_slots}")
        if self.mmap_threshold_kib < 0:
            raise ConfigError(f"--mmap-threshold-kib must be 0 (the role's default) or more, got {self.mmap_threshold_kib}")
        if self.sparse_mean not in SPARSE_MEANS:
            raise ConfigError(f"--sparse-mean must be one of {SPARSE_MEANS}, got {self.sparse_mean!r}")


@dataclass(frozen=True)
class RoundSummary:
    info: VersionInfo
    closed_at: float
    dropped: tuple[tuple[str, str], ...] = ()  # (worker id, reason) of each update the robust screen dropped


@dataclass(frozen=True)
class BlockStatus:
    """One block at one instant, read under its lock (`BlockAggregator.status`): what the Status
    RPC and /metrics report. The mappings are copies, so the aggregator moving on leaves it as it was."""

    block: int
    current: VersionInfo
    replicas: tuple[str, ...]  # registered workers, sorted
    round_age_s: float  # since the open round's clock started
    accepted_in_round: int
    recent: tuple[RoundSummary, ...]  # the last `history` closed rounds, oldest first
    updates: Mapping[tuple[str, str], int]  # (outcome, reason) → pushes, in the order first seen
    rounds_closed: Mapping[str, int]  # closed_by → rounds
    data_keys: Mapping[str, str] = field(default_factory=dict)  # worker id → data key (filled by SwarmAggregator)
    relays: tuple = ()  # manifests.RelayRecord of each relay pushing here (filled by SwarmAggregator)


def version_meta(info: VersionInfo, rule: str = "") -> dict:
    """What a version's file records of it (store/versions.py meta): its VersionInfo and the rule that made it."""
    return {"info": {**info.__dict__, "delta_codec": info.delta_codec.name}, "rule": rule}


def info_from_meta(meta: dict) -> VersionInfo:
    """The VersionInfo a version's file recorded (`version_meta`)."""
    d = dict(meta["info"])
    d["delta_codec"] = Codec[d["delta_codec"]]
    d["included"] = tuple(d.get("included", ()))
    return VersionInfo(**d)
