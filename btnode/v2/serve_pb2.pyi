from btnode.v2 import settings_pb2 as _settings_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Readout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    READOUT_UNSPECIFIED: _ClassVar[Readout]
    READOUT_POOL: _ClassVar[Readout]
    READOUT_LAST: _ClassVar[Readout]
    READOUT_COMMIT: _ClassVar[Readout]
    READOUT_SPEC: _ClassVar[Readout]
    READOUT_SPEC_FILL: _ClassVar[Readout]
READOUT_UNSPECIFIED: Readout
READOUT_POOL: Readout
READOUT_LAST: Readout
READOUT_COMMIT: Readout
READOUT_SPEC: Readout
READOUT_SPEC_FILL: Readout

class StateTensor(_message.Message):
    __slots__ = ("shape", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SegmentRequest(_message.Message):
    __slots__ = ("request_id", "context", "segment", "k", "n_steps", "seed", "temperature", "z", "want_logits", "readout", "pool", "first_chunk", "final", "no_cache", "n_tail", "draft", "draft_logp")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    N_STEPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    Z_FIELD_NUMBER: _ClassVar[int]
    WANT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    READOUT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    N_TAIL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOGP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context: bytes
    segment: int
    k: int
    n_steps: int
    seed: int
    temperature: float
    z: StateTensor
    want_logits: bool
    readout: Readout
    pool: StateTensor
    first_chunk: int
    final: bool
    no_cache: bool
    n_tail: int
    draft: bytes
    draft_logp: StateTensor
    def __init__(self, request_id: _Optional[str] = ..., context: _Optional[bytes] = ..., segment: _Optional[int] = ..., k: _Optional[int] = ..., n_steps: _Optional[int] = ..., seed: _Optional[int] = ..., temperature: _Optional[float] = ..., z: _Optional[_Union[StateTensor, _Mapping]] = ..., want_logits: _Optional[bool] = ..., readout: _Optional[_Union[Readout, str]] = ..., pool: _Optional[_Union[StateTensor, _Mapping]] = ..., first_chunk: _Optional[int] = ..., final: _Optional[bool] = ..., no_cache: _Optional[bool] = ..., n_tail: _Optional[int] = ..., draft: _Optional[bytes] = ..., draft_logp: _Optional[_Union[StateTensor, _Mapping]] = ...) -> None: ...

class SegmentReply(_message.Message):
    __slots__ = ("new_bytes", "logits", "route", "accepted")
    NEW_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    new_bytes: bytes
    logits: StateTensor
    route: _containers.RepeatedScalarFieldContainer[str]
    accepted: int
    def __init__(self, new_bytes: _Optional[bytes] = ..., logits: _Optional[_Union[StateTensor, _Mapping]] = ..., route: _Optional[_Iterable[str]] = ..., accepted: _Optional[int] = ...) -> None: ...

class SegmentBatch(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentRequest]
    def __init__(self, segments: _Optional[_Iterable[_Union[SegmentRequest, _Mapping]]] = ...) -> None: ...

class SegmentOutcome(_message.Message):
    __slots__ = ("reply", "code", "reason", "message")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reply: SegmentReply
    code: int
    reason: str
    message: str
    def __init__(self, reply: _Optional[_Union[SegmentReply, _Mapping]] = ..., code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class SegmentBatchReply(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[SegmentOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[SegmentOutcome, _Mapping]]] = ...) -> None: ...

class ARRequest(_message.Message):
    __slots__ = ("request_id", "tokens", "step", "seed", "temperature", "start", "hidden", "reset", "draft")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: bytes
    step: int
    seed: int
    temperature: float
    start: int
    hidden: StateTensor
    reset: bool
    draft: bytes
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[bytes] = ..., step: _Optional[int] = ..., seed: _Optional[int] = ..., temperature: _Optional[float] = ..., start: _Optional[int] = ..., hidden: _Optional[_Union[StateTensor, _Mapping]] = ..., reset: _Optional[bool] = ..., draft: _Optional[bytes] = ...) -> None: ...

class ARReply(_message.Message):
    __slots__ = ("new_bytes", "route")
    NEW_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    new_bytes: bytes
    route: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, new_bytes: _Optional[bytes] = ..., route: _Optional[_Iterable[str]] = ...) -> None: ...

class ARBatch(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[ARRequest]
    def __init__(self, steps: _Optional[_Iterable[_Union[ARRequest, _Mapping]]] = ...) -> None: ...

class AROutcome(_message.Message):
    __slots__ = ("reply", "code", "reason", "message")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reply: ARReply
    code: int
    reason: str
    message: str
    def __init__(self, reply: _Optional[_Union[ARReply, _Mapping]] = ..., code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ARBatchReply(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[AROutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[AROutcome, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "n_bytes", "k", "n_steps", "seed", "temperature", "want_logits", "readout", "draft", "no_cache", "n_tail")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    N_BYTES_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    N_STEPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    WANT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    READOUT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    N_TAIL_FIELD_NUMBER: _ClassVar[int]
    prompt: bytes
    n_bytes: int
    k: int
    n_steps: int
    seed: int
    temperature: float
    want_logits: bool
    readout: Readout
    draft: int
    no_cache: bool
    n_tail: int
    def __init__(self, prompt: _Optional[bytes] = ..., n_bytes: _Optional[int] = ..., k: _Optional[int] = ..., n_steps: _Optional[int] = ..., seed: _Optional[int] = ..., temperature: _Optional[float] = ..., want_logits: _Optional[bool] = ..., readout: _Optional[_Union[Readout, str]] = ..., draft: _Optional[int] = ..., no_cache: _Optional[bool] = ..., n_tail: _Optional[int] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("new_bytes", "traversals", "logits", "route", "drafted", "accepted")
    NEW_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAVERSALS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    new_bytes: bytes
    traversals: int
    logits: StateTensor
    route: _containers.RepeatedScalarFieldContainer[str]
    drafted: int
    accepted: int
    def __init__(self, new_bytes: _Optional[bytes] = ..., traversals: _Optional[int] = ..., logits: _Optional[_Union[StateTensor, _Mapping]] = ..., route: _Optional[_Iterable[str]] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ...) -> None: ...

class StageInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("kind", "block", "first_layer", "n_layers", "last", "fingerprint", "config", "name", "node_version", "default_readout", "default_k", "default_steps", "weights_name", "weights_version", "unit_sha256")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_READOUT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_K_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    UNIT_SHA256_FIELD_NUMBER: _ClassVar[int]
    kind: _settings_pb2.UnitKind
    block: int
    first_layer: int
    n_layers: int
    last: bool
    fingerprint: str
    config: _settings_pb2.ModelSettings
    name: str
    node_version: str
    default_readout: Readout
    default_k: int
    default_steps: int
    weights_name: str
    weights_version: int
    unit_sha256: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[_Union[_settings_pb2.UnitKind, str]] = ..., block: _Optional[int] = ..., first_layer: _Optional[int] = ..., n_layers: _Optional[int] = ..., last: _Optional[bool] = ..., fingerprint: _Optional[str] = ..., config: _Optional[_Union[_settings_pb2.ModelSettings, _Mapping]] = ..., name: _Optional[str] = ..., node_version: _Optional[str] = ..., default_readout: _Optional[_Union[Readout, str]] = ..., default_k: _Optional[int] = ..., default_steps: _Optional[int] = ..., weights_name: _Optional[str] = ..., weights_version: _Optional[int] = ..., unit_sha256: _Optional[_Iterable[str]] = ...) -> None: ...
