from btnode.v2 import settings_pb2 as _settings_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_SPARSE8: _ClassVar[Codec]
    CODEC_SPARSE2: _ClassVar[Codec]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]

class PushOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_OUTCOME_UNSPECIFIED: _ClassVar[PushOutcome]
    PUSH_OUTCOME_ACCEPTED: _ClassVar[PushOutcome]
    PUSH_OUTCOME_LATE: _ClassVar[PushOutcome]
    PUSH_OUTCOME_STALE: _ClassVar[PushOutcome]
    PUSH_OUTCOME_REJECTED: _ClassVar[PushOutcome]
    PUSH_OUTCOME_PROBATION: _ClassVar[PushOutcome]
    PUSH_OUTCOME_PENDING: _ClassVar[PushOutcome]
    PUSH_OUTCOME_APPLIED: _ClassVar[PushOutcome]
    PUSH_OUTCOME_DROPPED: _ClassVar[PushOutcome]

class ClosedBy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLOSED_BY_UNSPECIFIED: _ClassVar[ClosedBy]
    CLOSED_BY_DEADLINE: _ClassVar[ClosedBy]
    CLOSED_BY_ALL_REPORTED: _ClassVar[ClosedBy]
    CLOSED_BY_DRAIN: _ClassVar[ClosedBy]
    CLOSED_BY_AMENDED: _ClassVar[ClosedBy]

class IdentityRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IDENTITY_ROLE_UNSPECIFIED: _ClassVar[IdentityRole]
    IDENTITY_ROLE_WORKER: _ClassVar[IdentityRole]
    IDENTITY_ROLE_RELAY: _ClassVar[IdentityRole]
    IDENTITY_ROLE_STAGE: _ClassVar[IdentityRole]
    IDENTITY_ROLE_OPERATOR: _ClassVar[IdentityRole]
    IDENTITY_ROLE_AGGREGATOR: _ClassVar[IdentityRole]
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_SPARSE8: Codec
CODEC_SPARSE2: Codec
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
PUSH_OUTCOME_UNSPECIFIED: PushOutcome
PUSH_OUTCOME_ACCEPTED: PushOutcome
PUSH_OUTCOME_LATE: PushOutcome
PUSH_OUTCOME_STALE: PushOutcome
PUSH_OUTCOME_REJECTED: PushOutcome
PUSH_OUTCOME_PROBATION: PushOutcome
PUSH_OUTCOME_PENDING: PushOutcome
PUSH_OUTCOME_APPLIED: PushOutcome
PUSH_OUTCOME_DROPPED: PushOutcome
CLOSED_BY_UNSPECIFIED: ClosedBy
CLOSED_BY_DEADLINE: ClosedBy
CLOSED_BY_ALL_REPORTED: ClosedBy
CLOSED_BY_DRAIN: ClosedBy
CLOSED_BY_AMENDED: ClosedBy
IDENTITY_ROLE_UNSPECIFIED: IdentityRole
IDENTITY_ROLE_WORKER: IdentityRole
IDENTITY_ROLE_RELAY: IdentityRole
IDENTITY_ROLE_STAGE: IdentityRole
IDENTITY_ROLE_OPERATOR: IdentityRole
IDENTITY_ROLE_AGGREGATOR: IdentityRole

class FrameHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "codec", "raw_bytes", "payload_bytes", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: Codec
    raw_bytes: int
    payload_bytes: int
    sha256: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[_Union[Codec, str]] = ..., raw_bytes: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class BundleHeader(_message.Message):
    __slots__ = ("codec", "tensors", "raw_bytes", "digest")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    tensors: int
    raw_bytes: _containers.RepeatedScalarFieldContainer[int]
    digest: bytes
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., tensors: _Optional[int] = ..., raw_bytes: _Optional[_Iterable[int]] = ..., digest: _Optional[bytes] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("header", "data", "bundle")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    header: FrameHeader
    data: bytes
    bundle: BundleHeader
    def __init__(self, header: _Optional[_Union[FrameHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., bundle: _Optional[_Union[BundleHeader, _Mapping]] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("block", "version", "base_version", "sha256", "delta_codec", "accepted", "late", "stale", "rejected", "mean_loss", "closed_by", "included")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DELTA_CODEC_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_BY_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    block: int
    version: int
    base_version: int
    sha256: bytes
    delta_codec: Codec
    accepted: int
    late: int
    stale: int
    rejected: int
    mean_loss: float
    closed_by: ClosedBy
    included: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block: _Optional[int] = ..., version: _Optional[int] = ..., base_version: _Optional[int] = ..., sha256: _Optional[bytes] = ..., delta_codec: _Optional[_Union[Codec, str]] = ..., accepted: _Optional[int] = ..., late: _Optional[int] = ..., stale: _Optional[int] = ..., rejected: _Optional[int] = ..., mean_loss: _Optional[float] = ..., closed_by: _Optional[_Union[ClosedBy, str]] = ..., included: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("worker_id", "block", "fingerprint", "config", "data_id", "training", "relay", "cert", "signature", "relayed_by")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    DATA_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    CERT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    RELAYED_BY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    block: int
    fingerprint: str
    config: _settings_pb2.ModelSettings
    data_id: str
    training: _settings_pb2.TrainingSettings
    relay: bool
    cert: bytes
    signature: bytes
    relayed_by: str
    def __init__(self, worker_id: _Optional[str] = ..., block: _Optional[int] = ..., fingerprint: _Optional[str] = ..., config: _Optional[_Union[_settings_pb2.ModelSettings, _Mapping]] = ..., data_id: _Optional[str] = ..., training: _Optional[_Union[_settings_pb2.TrainingSettings, _Mapping]] = ..., relay: _Optional[bool] = ..., cert: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., relayed_by: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("current", "deadline_s", "codecs", "max_staleness", "data_key", "audits", "relay_audits", "bundles")
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    DATA_KEY_FIELD_NUMBER: _ClassVar[int]
    AUDITS_FIELD_NUMBER: _ClassVar[int]
    RELAY_AUDITS_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_FIELD_NUMBER: _ClassVar[int]
    current: VersionInfo
    deadline_s: float
    codecs: _containers.RepeatedScalarFieldContainer[Codec]
    max_staleness: int
    data_key: str
    audits: bool
    relay_audits: bool
    bundles: bool
    def __init__(self, current: _Optional[_Union[VersionInfo, _Mapping]] = ..., deadline_s: _Optional[float] = ..., codecs: _Optional[_Iterable[_Union[Codec, str]]] = ..., max_staleness: _Optional[int] = ..., data_key: _Optional[str] = ..., audits: _Optional[bool] = ..., relay_audits: _Optional[bool] = ..., bundles: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "block")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    block: int
    def __init__(self, worker_id: _Optional[str] = ..., block: _Optional[int] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("block", "worker_id", "bundles")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_FIELD_NUMBER: _ClassVar[int]
    block: int
    worker_id: str
    bundles: bool
    def __init__(self, block: _Optional[int] = ..., worker_id: _Optional[str] = ..., bundles: _Optional[bool] = ...) -> None: ...

class FetchDeltaRequest(_message.Message):
    __slots__ = ("block", "version", "bundles")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_FIELD_NUMBER: _ClassVar[int]
    block: int
    version: int
    bundles: bool
    def __init__(self, block: _Optional[int] = ..., version: _Optional[int] = ..., bundles: _Optional[bool] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("info", "chunk")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    info: VersionInfo
    chunk: Chunk
    def __init__(self, info: _Optional[_Union[VersionInfo, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class FetchDeltaReply(_message.Message):
    __slots__ = ("info", "chunk")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    info: VersionInfo
    chunk: Chunk
    def __init__(self, info: _Optional[_Union[VersionInfo, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker_id", "block", "base_version", "samples", "loss", "codec", "update_id", "data_key", "steps", "claim", "manifest", "cert", "signature")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_KEY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CERT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    block: int
    base_version: int
    samples: float
    loss: float
    codec: Codec
    update_id: str
    data_key: str
    steps: _containers.RepeatedScalarFieldContainer[int]
    claim: WorkClaim
    manifest: _containers.RepeatedCompositeFieldContainer[ManifestEntry]
    cert: bytes
    signature: bytes
    def __init__(self, worker_id: _Optional[str] = ..., block: _Optional[int] = ..., base_version: _Optional[int] = ..., samples: _Optional[float] = ..., loss: _Optional[float] = ..., codec: _Optional[_Union[Codec, str]] = ..., update_id: _Optional[str] = ..., data_key: _Optional[str] = ..., steps: _Optional[_Iterable[int]] = ..., claim: _Optional[_Union[WorkClaim, _Mapping]] = ..., manifest: _Optional[_Iterable[_Union[ManifestEntry, _Mapping]]] = ..., cert: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ManifestEntry(_message.Message):
    __slots__ = ("worker_id", "update_id", "base_version", "weight", "sha256", "samples", "cert", "signature", "claim_sha256", "token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CERT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CLAIM_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    update_id: str
    base_version: int
    weight: float
    sha256: bytes
    samples: float
    cert: bytes
    signature: bytes
    claim_sha256: bytes
    token: bytes
    def __init__(self, worker_id: _Optional[str] = ..., update_id: _Optional[str] = ..., base_version: _Optional[int] = ..., weight: _Optional[float] = ..., sha256: _Optional[bytes] = ..., samples: _Optional[float] = ..., cert: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., claim_sha256: _Optional[bytes] = ..., token: _Optional[bytes] = ...) -> None: ...

class WorkClaim(_message.Message):
    __slots__ = ("base_sha256", "data_id", "recipe", "optimizer_start", "optimizer_end", "residual_start", "residual_end")
    BASE_SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_ID_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_START_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_END_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_START_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_END_FIELD_NUMBER: _ClassVar[int]
    base_sha256: bytes
    data_id: str
    recipe: str
    optimizer_start: bytes
    optimizer_end: bytes
    residual_start: bytes
    residual_end: bytes
    def __init__(self, base_sha256: _Optional[bytes] = ..., data_id: _Optional[str] = ..., recipe: _Optional[str] = ..., optimizer_start: _Optional[bytes] = ..., optimizer_end: _Optional[bytes] = ..., residual_start: _Optional[bytes] = ..., residual_end: _Optional[bytes] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("outcome", "reason", "round_version", "audit", "closes_in_s")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ROUND_VERSION_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    CLOSES_IN_S_FIELD_NUMBER: _ClassVar[int]
    outcome: PushOutcome
    reason: str
    round_version: int
    audit: bool
    closes_in_s: float
    def __init__(self, outcome: _Optional[_Union[PushOutcome, str]] = ..., reason: _Optional[str] = ..., round_version: _Optional[int] = ..., audit: _Optional[bool] = ..., closes_in_s: _Optional[float] = ...) -> None: ...

class SubmitStateRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class SubmitStateReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrawRequest(_message.Message):
    __slots__ = ("header", "digest", "relay", "refused")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    digest: bytes
    relay: str
    refused: bool
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., digest: _Optional[bytes] = ..., relay: _Optional[str] = ..., refused: _Optional[bool] = ...) -> None: ...

class DrawReply(_message.Message):
    __slots__ = ("drawn", "token")
    DRAWN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    drawn: bool
    token: bytes
    def __init__(self, drawn: _Optional[bool] = ..., token: _Optional[bytes] = ...) -> None: ...

class EvidenceHeader(_message.Message):
    __slots__ = ("push", "unit")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    push: PushHeader
    unit: float
    def __init__(self, push: _Optional[_Union[PushHeader, _Mapping]] = ..., unit: _Optional[float] = ...) -> None: ...

class EvidenceChild(_message.Message):
    __slots__ = ("update_id", "weight", "scale", "entries")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    weight: float
    scale: float
    entries: int
    def __init__(self, update_id: _Optional[str] = ..., weight: _Optional[float] = ..., scale: _Optional[float] = ..., entries: _Optional[int] = ...) -> None: ...

class SubmitEvidenceRequest(_message.Message):
    __slots__ = ("header", "child", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHILD_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: EvidenceHeader
    child: EvidenceChild
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[EvidenceHeader, _Mapping]] = ..., child: _Optional[_Union[EvidenceChild, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class SubmitEvidenceReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("block", "worker_id", "relay")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    block: int
    worker_id: str
    relay: str
    def __init__(self, block: _Optional[int] = ..., worker_id: _Optional[str] = ..., relay: _Optional[str] = ...) -> None: ...

class WatchReply(_message.Message):
    __slots__ = ("version", "receipts", "states_wanted", "duties")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    STATES_WANTED_FIELD_NUMBER: _ClassVar[int]
    DUTIES_FIELD_NUMBER: _ClassVar[int]
    version: VersionInfo
    receipts: _containers.RepeatedCompositeFieldContainer[RoundReceipt]
    states_wanted: _containers.RepeatedScalarFieldContainer[str]
    duties: bool
    def __init__(self, version: _Optional[_Union[VersionInfo, _Mapping]] = ..., receipts: _Optional[_Iterable[_Union[RoundReceipt, _Mapping]]] = ..., states_wanted: _Optional[_Iterable[str]] = ..., duties: _Optional[bool] = ...) -> None: ...

class RoundReceipt(_message.Message):
    __slots__ = ("update_id", "outcome", "version", "reason")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    outcome: PushOutcome
    version: int
    reason: str
    def __init__(self, update_id: _Optional[str] = ..., outcome: _Optional[_Union[PushOutcome, str]] = ..., version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RoundReceiptRequest(_message.Message):
    __slots__ = ("block", "worker_id", "update_id")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    block: int
    worker_id: str
    update_id: str
    def __init__(self, block: _Optional[int] = ..., worker_id: _Optional[str] = ..., update_id: _Optional[str] = ...) -> None: ...

class RoundReceiptReply(_message.Message):
    __slots__ = ("receipt", "states_wanted")
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    STATES_WANTED_FIELD_NUMBER: _ClassVar[int]
    receipt: RoundReceipt
    states_wanted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, receipt: _Optional[_Union[RoundReceipt, _Mapping]] = ..., states_wanted: _Optional[_Iterable[str]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RoundSummary(_message.Message):
    __slots__ = ("version", "closed_at_unix")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOSED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    version: VersionInfo
    closed_at_unix: float
    def __init__(self, version: _Optional[_Union[VersionInfo, _Mapping]] = ..., closed_at_unix: _Optional[float] = ...) -> None: ...

class BlockStatus(_message.Message):
    __slots__ = ("block", "current", "replicas", "round_age_s", "accepted_in_round", "recent", "data_keys", "relays")
    class DataKeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ROUND_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_IN_ROUND_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    DATA_KEYS_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    block: int
    current: VersionInfo
    replicas: _containers.RepeatedScalarFieldContainer[str]
    round_age_s: float
    accepted_in_round: int
    recent: _containers.RepeatedCompositeFieldContainer[RoundSummary]
    data_keys: _containers.ScalarMap[str, str]
    relays: _containers.RepeatedCompositeFieldContainer[RelayRecord]
    def __init__(self, block: _Optional[int] = ..., current: _Optional[_Union[VersionInfo, _Mapping]] = ..., replicas: _Optional[_Iterable[str]] = ..., round_age_s: _Optional[float] = ..., accepted_in_round: _Optional[int] = ..., recent: _Optional[_Iterable[_Union[RoundSummary, _Mapping]]] = ..., data_keys: _Optional[_Mapping[str, str]] = ..., relays: _Optional[_Iterable[_Union[RelayRecord, _Mapping]]] = ...) -> None: ...

class RelayRecord(_message.Message):
    __slots__ = ("name", "children", "last_version", "last_weight", "pushes", "refused")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    LAST_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    name: str
    children: _containers.RepeatedScalarFieldContainer[str]
    last_version: int
    last_weight: float
    pushes: int
    refused: int
    def __init__(self, name: _Optional[str] = ..., children: _Optional[_Iterable[str]] = ..., last_version: _Optional[int] = ..., last_weight: _Optional[float] = ..., pushes: _Optional[int] = ..., refused: _Optional[int] = ...) -> None: ...

class Counter(_message.Message):
    __slots__ = ("name", "labels", "value")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.ScalarMap[str, str]
    value: float
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., value: _Optional[float] = ...) -> None: ...

class IdentityRecord(_message.Message):
    __slots__ = ("name", "role", "fingerprint", "joined", "accepted", "refused", "audited", "failed", "revoked_at_unix", "dropped", "applied", "verified", "verify_seconds")
    class RefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    AUDITED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: IdentityRole
    fingerprint: str
    joined: _containers.RepeatedScalarFieldContainer[int]
    accepted: int
    refused: _containers.ScalarMap[str, int]
    audited: int
    failed: int
    revoked_at_unix: float
    dropped: _containers.ScalarMap[str, int]
    applied: int
    verified: int
    verify_seconds: float
    def __init__(self, name: _Optional[str] = ..., role: _Optional[_Union[IdentityRole, str]] = ..., fingerprint: _Optional[str] = ..., joined: _Optional[_Iterable[int]] = ..., accepted: _Optional[int] = ..., refused: _Optional[_Mapping[str, int]] = ..., audited: _Optional[int] = ..., failed: _Optional[int] = ..., revoked_at_unix: _Optional[float] = ..., dropped: _Optional[_Mapping[str, int]] = ..., applied: _Optional[int] = ..., verified: _Optional[int] = ..., verify_seconds: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("fingerprint", "config", "blocks", "counters", "server_time_unix", "data_id", "identities", "node_version")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    DATA_ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITIES_FIELD_NUMBER: _ClassVar[int]
    NODE_VERSION_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    config: _settings_pb2.ModelSettings
    blocks: _containers.RepeatedCompositeFieldContainer[BlockStatus]
    counters: _containers.RepeatedCompositeFieldContainer[Counter]
    server_time_unix: float
    data_id: str
    identities: _containers.RepeatedCompositeFieldContainer[IdentityRecord]
    node_version: str
    def __init__(self, fingerprint: _Optional[str] = ..., config: _Optional[_Union[_settings_pb2.ModelSettings, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[BlockStatus, _Mapping]]] = ..., counters: _Optional[_Iterable[_Union[Counter, _Mapping]]] = ..., server_time_unix: _Optional[float] = ..., data_id: _Optional[str] = ..., identities: _Optional[_Iterable[_Union[IdentityRecord, _Mapping]]] = ..., node_version: _Optional[str] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RevokeReply(_message.Message):
    __slots__ = ("revoked_at_unix",)
    REVOKED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    revoked_at_unix: float
    def __init__(self, revoked_at_unix: _Optional[float] = ...) -> None: ...

class DutiesRequest(_message.Message):
    __slots__ = ("block", "worker_id")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    block: int
    worker_id: str
    def __init__(self, block: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class VerifyTask(_message.Message):
    __slots__ = ("task_id", "header", "terms", "keep")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    header: PushHeader
    terms: _settings_pb2.TrainingSettings
    keep: int
    def __init__(self, task_id: _Optional[str] = ..., header: _Optional[_Union[PushHeader, _Mapping]] = ..., terms: _Optional[_Union[_settings_pb2.TrainingSettings, _Mapping]] = ..., keep: _Optional[int] = ...) -> None: ...

class StateWanted(_message.Message):
    __slots__ = ("task", "k")
    TASK_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    task: VerifyTask
    k: int
    def __init__(self, task: _Optional[_Union[VerifyTask, _Mapping]] = ..., k: _Optional[int] = ...) -> None: ...

class DutiesReply(_message.Message):
    __slots__ = ("tasks", "traces", "states", "children")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    TRACES_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[VerifyTask]
    traces: _containers.RepeatedCompositeFieldContainer[VerifyTask]
    states: _containers.RepeatedCompositeFieldContainer[StateWanted]
    children: _containers.RepeatedCompositeFieldContainer[ChildDuties]
    def __init__(self, tasks: _Optional[_Iterable[_Union[VerifyTask, _Mapping]]] = ..., traces: _Optional[_Iterable[_Union[VerifyTask, _Mapping]]] = ..., states: _Optional[_Iterable[_Union[StateWanted, _Mapping]]] = ..., children: _Optional[_Iterable[_Union[ChildDuties, _Mapping]]] = ...) -> None: ...

class ChildDuties(_message.Message):
    __slots__ = ("worker_id", "duties")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DUTIES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    duties: DutiesReply
    def __init__(self, worker_id: _Optional[str] = ..., duties: _Optional[_Union[DutiesReply, _Mapping]] = ...) -> None: ...

class VerifyInputsRequest(_message.Message):
    __slots__ = ("block", "task_id", "worker_id")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    block: int
    task_id: str
    worker_id: str
    def __init__(self, block: _Optional[int] = ..., task_id: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class VerifyInputsReply(_message.Message):
    __slots__ = ("base", "start")
    BASE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    base: Chunk
    start: Chunk
    def __init__(self, base: _Optional[_Union[Chunk, _Mapping]] = ..., start: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class AttestRequest(_message.Message):
    __slots__ = ("block", "task_id", "verifier", "digest", "seconds", "cert", "signature")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CERT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    block: int
    task_id: str
    verifier: str
    digest: bytes
    seconds: float
    cert: bytes
    signature: bytes
    def __init__(self, block: _Optional[int] = ..., task_id: _Optional[str] = ..., verifier: _Optional[str] = ..., digest: _Optional[bytes] = ..., seconds: _Optional[float] = ..., cert: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class AttestReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitTraceRequest(_message.Message):
    __slots__ = ("block", "task_id", "worker_id", "trace", "cert", "signature")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    CERT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    block: int
    task_id: str
    worker_id: str
    trace: _containers.RepeatedScalarFieldContainer[bytes]
    cert: bytes
    signature: bytes
    def __init__(self, block: _Optional[int] = ..., task_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., trace: _Optional[_Iterable[bytes]] = ..., cert: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SubmitTraceReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DisputeStateHeader(_message.Message):
    __slots__ = ("block", "task_id", "worker_id", "k")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    block: int
    task_id: str
    worker_id: str
    k: int
    def __init__(self, block: _Optional[int] = ..., task_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., k: _Optional[int] = ...) -> None: ...

class SubmitDisputeStateRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: DisputeStateHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[DisputeStateHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class SubmitDisputeStateReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
