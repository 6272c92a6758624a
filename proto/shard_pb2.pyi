from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_FP32: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
CODEC_FP32: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec

class Rows(_message.Message):
    __slots__ = ("codec", "dim", "data", "scales")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    dim: int
    data: bytes
    scales: bytes
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., dim: _Optional[int] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ...) -> None: ...

class Component(_message.Message):
    __slots__ = ("kind", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    params: _containers.ScalarMap[str, float]
    def __init__(self, kind: _Optional[str] = ..., params: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Admission(_message.Message):
    __slots__ = ("min_count", "probability", "max_tracked")
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    MAX_TRACKED_FIELD_NUMBER: _ClassVar[int]
    min_count: int
    probability: float
    max_tracked: int
    def __init__(self, min_count: _Optional[int] = ..., probability: _Optional[float] = ..., max_tracked: _Optional[int] = ...) -> None: ...

class Eviction(_message.Message):
    __slots__ = ("ttl_steps", "ttl_seconds", "max_rows", "policy")
    TTL_STEPS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ttl_steps: int
    ttl_seconds: float
    max_rows: int
    policy: str
    def __init__(self, ttl_steps: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., max_rows: _Optional[int] = ..., policy: _Optional[str] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "dim", "optimizer", "initializer", "seed", "dtype", "admission", "eviction", "memory_budget_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    optimizer: Component
    initializer: Component
    seed: int
    dtype: str
    admission: Admission
    eviction: Eviction
    memory_budget_bytes: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., optimizer: _Optional[_Union[Component, _Mapping]] = ..., initializer: _Optional[_Union[Component, _Mapping]] = ..., seed: _Optional[int] = ..., dtype: _Optional[str] = ..., admission: _Optional[_Union[Admission, _Mapping]] = ..., eviction: _Optional[_Union[Eviction, _Mapping]] = ..., memory_budget_bytes: _Optional[int] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("spec", "exist_ok")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    exist_ok: bool
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., exist_ok: _Optional[bool] = ...) -> None: ...

class CreateTableResponse(_message.Message):
    __slots__ = ("spec", "created")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    created: bool
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class DescribeTableRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class DescribeTableResponse(_message.Message):
    __slots__ = ("spec", "stats")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    stats: TableStats
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., stats: _Optional[_Union[TableStats, _Mapping]] = ...) -> None: ...

class DropTableRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class DropTableResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    def __init__(self, dropped: _Optional[bool] = ...) -> None: ...

class ListTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("table", "ids", "codec")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    codec: Codec
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., codec: _Optional[_Union[Codec, str]] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: Rows
    def __init__(self, rows: _Optional[_Union[Rows, _Mapping]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("table", "ids", "grads", "client_id", "seq", "part")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    grads: Rows
    client_id: str
    seq: int
    part: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., grads: _Optional[_Union[Rows, _Mapping]] = ..., client_id: _Optional[str] = ..., seq: _Optional[int] = ..., part: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("applied_rows", "duplicate")
    APPLIED_ROWS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    applied_rows: int
    duplicate: bool
    def __init__(self, applied_rows: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("incremental",)
    INCREMENTAL_FIELD_NUMBER: _ClassVar[int]
    incremental: bool
    def __init__(self, incremental: _Optional[bool] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("paths", "rows")
    PATHS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    rows: int
    def __init__(self, paths: _Optional[_Iterable[str]] = ..., rows: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("table", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TABLE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    table: str
    values: _containers.ScalarMap[str, float]
    def __init__(self, table: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ...) -> None: ...
