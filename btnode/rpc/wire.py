"""The wire's serving vocabulary free of torch, for light clients of a chain's entry (the HTTP proxy,
node/api.py, must not load torch): channel options, `WireEnum` and the unit-kind and readout enums,
the model settings and a generation request to protobuf and back. rpc/convert.py builds on these."""

from __future__ import annotations

import dataclasses
import re
from enum import Enum
from typing import Any, Generic, TypeVar

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from btnode.errors import MalformedInput
from btnode.model.config import ModelConfig, UnitKind
from btnode.model.readout import Readout, default_readout
from btnode.serve.identity import Weights
from btnode.serve.request import GenerationRequest
from btnode.v2 import serve_pb2 as serve_pb
from btnode.v2 import settings_pb2 as settings_pb

MAX_MESSAGE_BYTES = 4 << 20  # a 1 MiB chunk plus headers fits with room to spare
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's reconnect backoff grows to 120 s by default, and while it waits every call fails at once with
    # the last error: a relay or worker whose parent restarted kept "Connection refused" for half a minute
    # after the parent was back (bench/soak.py --relays). A parent comes back within seconds; so does this.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]

E = TypeVar("E", bound=Enum)
MAX_UNITS = 4096  # unit hashes one StageInfo may carry: far above any chain's blocks
MAX_WEIGHTS_NAME = 128
_SHA256 = re.compile(r"[0-9a-f]{64}")


class WireEnum(Generic[E]):
    """A wire enum and the domain enum it carries, matched by name: the wire's `PREFIX_NAME` for each
    member NAME (PREFIX: the wire enum's name in upper snake case, so values never collide in the
    package's one scope). Both ways: a member without a wire value, or a wire value (other than
    UNSPECIFIED) without a member, fails the import. `unspecified`: the member UNSPECIFIED stands
    for, if any (otherwise a reader gets None and decides by the rule docs/wire.md states)."""

    def __init__(self, wire: EnumTypeWrapper, domain: type[E], *, unspecified: E | None = None):
        self.name = wire.DESCRIPTOR.full_name
        self.prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", wire.DESCRIPTOR.name).upper() + "_"
        self.unspecified = unspecified
        members = [m for m in domain if m is not unspecified]
        names = {self.prefix + m.name for m in members} | {self.prefix + "UNSPECIFIED"}
        if names != set(wire.keys()):
            raise ImportError(f"{self.name} {sorted(wire.keys())} and {domain.__module__}.{domain.__qualname__} "
                              f"{[m.name for m in domain]} disagree")
        self._to = {m: wire.Value(self.prefix + m.name) for m in members}
        if unspecified is not None:
            self._to[unspecified] = 0
        self._from = {n: m for m, n in self._to.items()}

    def to_pb(self, member: E) -> int:
        return self._to[member]

    def member(self, number: int) -> E | None:
        """The member a peer sent; None for UNSPECIFIED without a member, or a value this build does not know."""
        return self._from.get(number)

    def from_pb(self, number: int, what: str) -> E | None:
        """The member a peer sent; None for UNSPECIFIED without a member; MalformedInput(`what`) for a
        value this build does not know."""
        if number in self._from or number == 0:
            return self._from.get(number)
        raise MalformedInput(what, f"unknown {self.name} value {number}")


UNIT_KINDS = WireEnum(settings_pb.UnitKind, UnitKind)
READOUTS = WireEnum(serve_pb.Readout, Readout)

# Settings messages mirror their dataclasses field for field.
_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
if set(settings_pb.ModelSettings.DESCRIPTOR.fields_by_name) != set(_MODEL_FIELDS):
    raise ImportError(f"{settings_pb.ModelSettings.DESCRIPTOR.full_name} and its dataclass disagree: "
                      f"{sorted(set(settings_pb.ModelSettings.DESCRIPTOR.fields_by_name) ^ set(_MODEL_FIELDS))}")


def readout_from_pb(number: int, n_tail: int) -> Readout:
    """A segment's or request's readout; UNSPECIFIED is the one default the library and the CLI share
    (readout.default_readout), never a default of the wire's own."""
    return READOUTS.from_pb(number, "readout") or default_readout(n_tail)


def model_to_pb(cfg: ModelConfig) -> settings_pb.ModelSettings:
    fields = {n: getattr(cfg, n) for n in _MODEL_FIELDS}
    return settings_pb.ModelSettings(**{**fields, "segments": list(cfg.segments),
                                        "kind": UNIT_KINDS.to_pb(UnitKind(cfg.kind))})


def model_dict_from_pb(m: settings_pb.ModelSettings) -> dict[str, Any]:
    """ModelConfig's fields as a peer sent them, for ModelConfig.from_dict to judge (ConfigError); a kind
    this build does not know becomes a string that ModelConfig refuses."""
    kind = UNIT_KINDS.member(m.kind)
    return {**{n: getattr(m, n) for n in _MODEL_FIELDS}, "segments": list(m.segments),
            "kind": kind.value if kind is not None else f"kind#{m.kind}"}


def model_from_pb(m: settings_pb.ModelSettings) -> ModelConfig:
    return ModelConfig.from_dict(model_dict_from_pb(m))


def request_to_pb(r: GenerationRequest) -> serve_pb.GenerateRequest:
    """Defaults travel as the wire's zero values: k, n_steps 0 and READOUT_UNSPECIFIED."""
    return serve_pb.GenerateRequest(prompt=r.prompt, n_bytes=r.n_bytes, k=r.k or 0, n_steps=r.n_steps or 0,
                                    seed=r.seed, temperature=r.temperature, want_logits=r.want_logits,
                                    readout=READOUTS.to_pb(r.readout) if r.readout else serve_pb.READOUT_UNSPECIFIED,
                                    no_cache=not r.use_cache, draft=r.draft_len, n_tail=r.n_tail)


def request_from_pb(m: serve_pb.GenerateRequest) -> GenerationRequest:
    return GenerationRequest(prompt=bytes(m.prompt), n_bytes=m.n_bytes, seed=m.seed, temperature=m.temperature,
                             k=m.k or None, n_steps=m.n_steps or None, n_tail=m.n_tail,
                             readout=READOUTS.from_pb(m.readout, "readout"),  # None: the library's default
                             want_logits=m.want_logits, use_cache=not m.no_cache, draft_len=m.draft)


def weights_from_pb(m: serve_pb.StageInfo) -> Weights | None:
    """The weights a stage's Info reports for the chain from it on; None when it names no unit hashes
    (an older build, or a stage further down that did not say). MalformedInput for hashes that are not
    sha256 hex digests, too many of them, or an overlong name."""
    if not m.unit_sha256:
        return None
    units = tuple(m.unit_sha256)
    if len(units) > MAX_UNITS or not all(_SHA256.fullmatch(u) for u in units):
        raise MalformedInput("info", f"{len(units)} unit hashes, not all sha256 hex digests (at most {MAX_UNITS})")
    if len(m.weights_name) > MAX_WEIGHTS_NAME:
        raise MalformedInput("info", f"a weights name of {len(m.weights_name)} characters; at most {MAX_WEIGHTS_NAME}")
    return Weights(name=m.weights_name, version=m.weights_version, units=units)
