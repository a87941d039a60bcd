from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UnitKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNIT_KIND_UNSPECIFIED: _ClassVar[UnitKind]
    UNIT_KIND_BLOCK: _ClassVar[UnitKind]
    UNIT_KIND_AR: _ClassVar[UnitKind]

class Precision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECISION_UNSPECIFIED: _ClassVar[Precision]
    PRECISION_FP32: _ClassVar[Precision]
    PRECISION_BF16: _ClassVar[Precision]
UNIT_KIND_UNSPECIFIED: UnitKind
UNIT_KIND_BLOCK: UnitKind
UNIT_KIND_AR: UnitKind
PRECISION_UNSPECIFIED: Precision
PRECISION_FP32: Precision
PRECISION_BF16: Precision

class ModelSettings(_message.Message):
    __slots__ = ("vocab", "d_model", "n_heads", "n_layers", "n_blocks", "context", "mlp_ratio", "sigma_lo", "sigma_hi", "p_mean", "p_std", "gamma", "sigma_data", "target_seed", "segments", "tail_blocks", "sigma_gen", "kind", "ar_layers", "ada_rank", "ctx_head")
    VOCAB_FIELD_NUMBER: _ClassVar[int]
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    N_HEADS_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MLP_RATIO_FIELD_NUMBER: _ClassVar[int]
    SIGMA_LO_FIELD_NUMBER: _ClassVar[int]
    SIGMA_HI_FIELD_NUMBER: _ClassVar[int]
    P_MEAN_FIELD_NUMBER: _ClassVar[int]
    P_STD_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    SIGMA_DATA_FIELD_NUMBER: _ClassVar[int]
    TARGET_SEED_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TAIL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SIGMA_GEN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    AR_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ADA_RANK_FIELD_NUMBER: _ClassVar[int]
    CTX_HEAD_FIELD_NUMBER: _ClassVar[int]
    vocab: int
    d_model: int
    n_heads: int
    n_layers: int
    n_blocks: int
    context: int
    mlp_ratio: int
    sigma_lo: float
    sigma_hi: float
    p_mean: float
    p_std: float
    gamma: float
    sigma_data: float
    target_seed: int
    segments: _containers.RepeatedScalarFieldContainer[int]
    tail_blocks: int
    sigma_gen: float
    kind: UnitKind
    ar_layers: int
    ada_rank: int
    ctx_head: int
    def __init__(self, vocab: _Optional[int] = ..., d_model: _Optional[int] = ..., n_heads: _Optional[int] = ..., n_layers: _Optional[int] = ..., n_blocks: _Optional[int] = ..., context: _Optional[int] = ..., mlp_ratio: _Optional[int] = ..., sigma_lo: _Optional[float] = ..., sigma_hi: _Optional[float] = ..., p_mean: _Optional[float] = ..., p_std: _Optional[float] = ..., gamma: _Optional[float] = ..., sigma_data: _Optional[float] = ..., target_seed: _Optional[int] = ..., segments: _Optional[_Iterable[int]] = ..., tail_blocks: _Optional[int] = ..., sigma_gen: _Optional[float] = ..., kind: _Optional[_Union[UnitKind, str]] = ..., ar_layers: _Optional[int] = ..., ada_rank: _Optional[int] = ..., ctx_head: _Optional[int] = ...) -> None: ...

class TrainingSettings(_message.Message):
    __slots__ = ("batch", "lr", "min_lr_ratio", "warmup", "steps", "weight_decay", "beta1", "beta2", "grad_clip", "seed", "k1_share", "ctx_share", "precision", "steps_per_round", "noisy_rows", "ctx_weight")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_RATIO_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    K1_SHARE_FIELD_NUMBER: _ClassVar[int]
    CTX_SHARE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    NOISY_ROWS_FIELD_NUMBER: _ClassVar[int]
    CTX_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    batch: int
    lr: float
    min_lr_ratio: float
    warmup: int
    steps: int
    weight_decay: float
    beta1: float
    beta2: float
    grad_clip: float
    seed: int
    k1_share: float
    ctx_share: float
    precision: Precision
    steps_per_round: int
    noisy_rows: float
    ctx_weight: float
    def __init__(self, batch: _Optional[int] = ..., lr: _Optional[float] = ..., min_lr_ratio: _Optional[float] = ..., warmup: _Optional[int] = ..., steps: _Optional[int] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., grad_clip: _Optional[float] = ..., seed: _Optional[int] = ..., k1_share: _Optional[float] = ..., ctx_share: _Optional[float] = ..., precision: _Optional[_Union[Precision, str]] = ..., steps_per_round: _Optional[int] = ..., noisy_rows: _Optional[float] = ..., ctx_weight: _Optional[float] = ...) -> None: ...
