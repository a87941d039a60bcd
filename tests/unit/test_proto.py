"""The generated protobuf code is checked in; regenerating it from proto/ must give no diff. Each wire
enum matches its domain enum both ways, and each settings message its dataclass."""

import dataclasses
import os
from enum import Enum
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc  # a test dependency, pinned in pyproject.toml

from btnode.aggregate.trust.identities import Role
from btnode.codec.codecs import Codec
from btnode.model.config import ModelConfig, UnitKind
from btnode.model.readout import Readout
from btnode.protocol import ClosedBy, Outcome
from btnode.rpc import convert
from btnode.train.config import Precision, TrainConfig
from btnode.v2 import serve_pb2, settings_pb2, swarm_pb2

ROOT = Path(__file__).resolve().parents[2]
GENERATED = [f"{name}{suffix}" for name in ("swarm", "serve", "settings", "enroll")
             for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
# wire enum → its domain enum, and the member UNSPECIFIED stands for (None: the reader's stated rule)
ENUMS = [(swarm_pb2.Codec, Codec, None), (swarm_pb2.PushOutcome, Outcome, None),
         (swarm_pb2.ClosedBy, ClosedBy, ClosedBy.NONE), (swarm_pb2.IdentityRole, Role, None),
         (settings_pb2.UnitKind, UnitKind, None), (settings_pb2.Precision, Precision, None),
         (serve_pb2.Readout, Readout, None)]


def test_generated_code_matches_the_schema(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    assert sorted(protos) == [f"btnode/v2/{n}.proto" for n in ("enroll", "serve", "settings", "swarm")]
    cwd = os.getcwd()
    os.chdir(ROOT / "proto")
    try:
        rc = protoc.main(["protoc", "-I.", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                          f"--pyi_out={tmp_path}", *protos])
    finally:
        os.chdir(cwd)
    assert rc == 0
    for name in GENERATED:
        fresh = (tmp_path / "btnode" / "v2" / name).read_text()
        committed = (ROOT / "btnode" / "v2" / name).read_text()
        assert fresh == committed, f"btnode/v2/{name} is stale: run `make proto` and commit the result"


@pytest.mark.parametrize("wire, domain, unspecified", ENUMS, ids=[e[0].DESCRIPTOR.name for e in ENUMS])
def test_each_wire_enum_matches_its_domain_enum_both_ways(wire, domain, unspecified):
    mapped = next(e for e in convert.WIRE_ENUMS if e.name == wire.DESCRIPTOR.full_name)
    assert mapped.unspecified is unspecified
    numbers = {mapped.to_pb(m) for m in domain}
    assert numbers == set(wire.values()) - ({0} if unspecified is None else set())  # every value, each once
    for member in domain:
        assert mapped.from_pb(mapped.to_pb(member), "test") is member
    assert mapped.from_pb(0, "test") is unspecified
    assert mapped.member(max(wire.values()) + 1) is None


def test_the_codec_numbers_are_the_domain_values_the_registry_is_keyed_by():
    assert {c: swarm_pb2.Codec.Value(f"CODEC_{c.name}") for c in Codec} == {c: c.value for c in Codec}


def test_a_drifted_enum_fails_at_import_naming_both_sides():
    class Wider(str, Enum):
        POOL = "pool"
        LAST = "last"
        COMMIT = "commit"
        SPEC = "spec"
        SPEC_FILL = "spec-fill"
        NEW = "new"  # no READOUT_NEW on the wire

    with pytest.raises(ImportError, match=r"btnode.v2.Readout .* and .*Wider .* disagree"):
        convert.WireEnum(serve_pb2.Readout, Wider)


@pytest.mark.parametrize("message, cls", [(settings_pb2.ModelSettings, ModelConfig),
                                          (settings_pb2.TrainingSettings, TrainConfig)])
def test_each_settings_message_mirrors_its_dataclass(message, cls):
    fields = {f.name for f in dataclasses.fields(cls)} | ({"steps_per_round"} if cls is TrainConfig else set())
    assert set(message.DESCRIPTOR.fields_by_name) == fields


def test_every_gap_in_a_message_s_field_numbers_is_reserved():
    """A retired number is reserved, never left free to be reused by mistake (docs/wire.md); v1's
    string fields that v2 types are among them."""
    gaps = {}
    for module in (swarm_pb2, serve_pb2, settings_pb2):
        for message in module.DESCRIPTOR.message_types_by_name.values():
            proto = descriptor_pb2.DescriptorProto()
            message.CopyToProto(proto)
            used = {f.number for f in proto.field}
            reserved = {n for r in proto.reserved_range for n in range(r.start, r.end)}
            assert not used & reserved, message.full_name
            if free := set(range(1, max(used | reserved, default=0) + 1)) - used - reserved:
                gaps[message.full_name] = sorted(free)
            if message.name in ("VersionInfo", "JoinRequest", "StatusReply", "StageInfo"):
                assert reserved, f"{message.full_name}: v1's string fields retired without a reservation"
    assert gaps == {}
