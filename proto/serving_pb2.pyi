from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ServingLookupRequest(_message.Message):
    __slots__ = ("ids", "table")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    table: str
    def __init__(self, ids: _Optional[bytes] = ..., table: _Optional[str] = ...) -> None: ...

class ServingLookupResponse(_message.Message):
    __slots__ = ("rows", "found", "dim", "seq")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    rows: bytes
    found: bytes
    dim: int
    seq: int
    def __init__(self, rows: _Optional[bytes] = ..., found: _Optional[bytes] = ..., dim: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class ServingInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServingInfoResponse(_message.Message):
    __slots__ = ("table", "dim", "rows", "seq", "base_seq", "data_time", "loaded_time", "default_row", "deltas_applied", "rows_applied", "apply_seconds", "model", "version", "tables", "num_dense", "num_sparse", "version_time", "step", "pinned", "versions_refused", "canary_auc")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BASE_SEQ_FIELD_NUMBER: _ClassVar[int]
    DATA_TIME_FIELD_NUMBER: _ClassVar[int]
    LOADED_TIME_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_ROW_FIELD_NUMBER: _ClassVar[int]
    DELTAS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    ROWS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    NUM_DENSE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPARSE_FIELD_NUMBER: _ClassVar[int]
    VERSION_TIME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    CANARY_AUC_FIELD_NUMBER: _ClassVar[int]
    table: str
    dim: int
    rows: int
    seq: int
    base_seq: int
    data_time: float
    loaded_time: float
    default_row: str
    deltas_applied: int
    rows_applied: int
    apply_seconds: float
    model: str
    version: int
    tables: _containers.RepeatedScalarFieldContainer[str]
    num_dense: int
    num_sparse: int
    version_time: float
    step: int
    pinned: bool
    versions_refused: int
    canary_auc: float
    def __init__(self, table: _Optional[str] = ..., dim: _Optional[int] = ..., rows: _Optional[int] = ..., seq: _Optional[int] = ..., base_seq: _Optional[int] = ..., data_time: _Optional[float] = ..., loaded_time: _Optional[float] = ..., default_row: _Optional[str] = ..., deltas_applied: _Optional[int] = ..., rows_applied: _Optional[int] = ..., apply_seconds: _Optional[float] = ..., model: _Optional[str] = ..., version: _Optional[int] = ..., tables: _Optional[_Iterable[str]] = ..., num_dense: _Optional[int] = ..., num_sparse: _Optional[int] = ..., version_time: _Optional[float] = ..., step: _Optional[int] = ..., pinned: _Optional[bool] = ..., versions_refused: _Optional[int] = ..., canary_auc: _Optional[float] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("rows", "dense", "categorical")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    CATEGORICAL_FIELD_NUMBER: _ClassVar[int]
    rows: int
    dense: bytes
    categorical: bytes
    def __init__(self, rows: _Optional[int] = ..., dense: _Optional[bytes] = ..., categorical: _Optional[bytes] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("probabilities", "version", "model")
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    probabilities: bytes
    version: int
    model: str
    def __init__(self, probabilities: _Optional[bytes] = ..., version: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...
