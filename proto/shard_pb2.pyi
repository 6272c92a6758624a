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

class Durability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DURABILITY_DEFAULT: _ClassVar[Durability]
    DURABILITY_SYNC: _ClassVar[Durability]
    DURABILITY_ASYNC: _ClassVar[Durability]

class ServerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVER_UP: _ClassVar[ServerState]
    SERVER_DEAD: _ClassVar[ServerState]

class CopyState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COPY_IN_SYNC: _ClassVar[CopyState]
    COPY_CATCHING_UP: _ClassVar[CopyState]
    COPY_HANDING_OVER: _ClassVar[CopyState]

class ItemKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ITEM_CHANGES: _ClassVar[ItemKind]
    ITEM_SNAPSHOT_BEGIN: _ClassVar[ItemKind]
    ITEM_SNAPSHOT_ROWS: _ClassVar[ItemKind]
    ITEM_SNAPSHOT_END: _ClassVar[ItemKind]
    ITEM_BARRIER: _ClassVar[ItemKind]

class ReplicateReject(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_NONE: _ClassVar[ReplicateReject]
    REJECT_STALE: _ClassVar[ReplicateReject]
    REJECT_DIVERGED: _ClassVar[ReplicateReject]
    REJECT_GAP: _ClassVar[ReplicateReject]
    REJECT_BEHIND: _ClassVar[ReplicateReject]
    REJECT_WAIT: _ClassVar[ReplicateReject]
CODEC_FP32: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
DURABILITY_DEFAULT: Durability
DURABILITY_SYNC: Durability
DURABILITY_ASYNC: Durability
SERVER_UP: ServerState
SERVER_DEAD: ServerState
COPY_IN_SYNC: CopyState
COPY_CATCHING_UP: CopyState
COPY_HANDING_OVER: CopyState
ITEM_CHANGES: ItemKind
ITEM_SNAPSHOT_BEGIN: ItemKind
ITEM_SNAPSHOT_ROWS: ItemKind
ITEM_SNAPSHOT_END: ItemKind
ITEM_BARRIER: ItemKind
REJECT_NONE: ReplicateReject
REJECT_STALE: ReplicateReject
REJECT_DIVERGED: ReplicateReject
REJECT_GAP: ReplicateReject
REJECT_BEHIND: ReplicateReject
REJECT_WAIT: ReplicateReject

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
    __slots__ = ("name", "dim", "optimizer", "initializer", "seed", "dtype", "admission", "eviction", "memory_budget_bytes", "durability", "min_copies", "created_epoch")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    MIN_COPIES_FIELD_NUMBER: _ClassVar[int]
    CREATED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    optimizer: Component
    initializer: Component
    seed: int
    dtype: str
    admission: Admission
    eviction: Eviction
    memory_budget_bytes: int
    durability: Durability
    min_copies: int
    created_epoch: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., optimizer: _Optional[_Union[Component, _Mapping]] = ..., initializer: _Optional[_Union[Component, _Mapping]] = ..., seed: _Optional[int] = ..., dtype: _Optional[str] = ..., admission: _Optional[_Union[Admission, _Mapping]] = ..., eviction: _Optional[_Union[Eviction, _Mapping]] = ..., memory_budget_bytes: _Optional[int] = ..., durability: _Optional[_Union[Durability, str]] = ..., min_copies: _Optional[int] = ..., created_epoch: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("table", "ids", "codec", "epoch", "read_only", "unseen")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    UNSEEN_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    codec: Codec
    epoch: int
    read_only: bool
    unseen: str
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., codec: _Optional[_Union[Codec, str]] = ..., epoch: _Optional[int] = ..., read_only: _Optional[bool] = ..., unseen: _Optional[str] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: Rows
    def __init__(self, rows: _Optional[_Union[Rows, _Mapping]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("table", "ids", "grads", "client_id", "seq", "part", "epoch")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    grads: Rows
    client_id: str
    seq: int
    part: int
    epoch: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., grads: _Optional[_Union[Rows, _Mapping]] = ..., client_id: _Optional[str] = ..., seq: _Optional[int] = ..., part: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("applied_rows", "duplicate", "epoch", "under_replicated")
    APPLIED_ROWS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    UNDER_REPLICATED_FIELD_NUMBER: _ClassVar[int]
    applied_rows: int
    duplicate: bool
    epoch: int
    under_replicated: bool
    def __init__(self, applied_rows: _Optional[int] = ..., duplicate: _Optional[bool] = ..., epoch: _Optional[int] = ..., under_replicated: _Optional[bool] = ...) -> None: ...

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

class FailureDomain(_message.Message):
    __slots__ = ("zone", "rack", "host")
    ZONE_FIELD_NUMBER: _ClassVar[int]
    RACK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    zone: str
    rack: str
    host: str
    def __init__(self, zone: _Optional[str] = ..., rack: _Optional[str] = ..., host: _Optional[str] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("id", "address", "boot", "state", "domain")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BOOT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    boot: str
    state: ServerState
    domain: FailureDomain
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., boot: _Optional[str] = ..., state: _Optional[_Union[ServerState, str]] = ..., domain: _Optional[_Union[FailureDomain, _Mapping]] = ...) -> None: ...

class ShardMap(_message.Message):
    __slots__ = ("epoch", "num_slots", "replicas", "servers", "width", "copies", "states", "slot_epochs", "tables", "cluster_id")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    SLOT_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_slots: int
    replicas: int
    servers: _containers.RepeatedCompositeFieldContainer[ServerInfo]
    width: int
    copies: bytes
    states: bytes
    slot_epochs: bytes
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    cluster_id: str
    def __init__(self, epoch: _Optional[int] = ..., num_slots: _Optional[int] = ..., replicas: _Optional[int] = ..., servers: _Optional[_Iterable[_Union[ServerInfo, _Mapping]]] = ..., width: _Optional[int] = ..., copies: _Optional[bytes] = ..., states: _Optional[bytes] = ..., slot_epochs: _Optional[bytes] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., cluster_id: _Optional[str] = ...) -> None: ...

class InstallMapRequest(_message.Message):
    __slots__ = ("map",)
    MAP_FIELD_NUMBER: _ClassVar[int]
    map: ShardMap
    def __init__(self, map: _Optional[_Union[ShardMap, _Mapping]] = ...) -> None: ...

class InstallMapResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class RowBlock(_message.Message):
    __slots__ = ("ids", "weights", "state", "update_count", "last_step", "last_time", "dim", "state_width")
    IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_TIME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    STATE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    weights: bytes
    state: bytes
    update_count: bytes
    last_step: bytes
    last_time: bytes
    dim: int
    state_width: int
    def __init__(self, ids: _Optional[bytes] = ..., weights: _Optional[bytes] = ..., state: _Optional[bytes] = ..., update_count: _Optional[bytes] = ..., last_step: _Optional[bytes] = ..., last_time: _Optional[bytes] = ..., dim: _Optional[int] = ..., state_width: _Optional[int] = ...) -> None: ...

class DedupRecord(_message.Message):
    __slots__ = ("client_id", "seq", "slots")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    seq: int
    slots: bytes
    def __init__(self, client_id: _Optional[str] = ..., seq: _Optional[int] = ..., slots: _Optional[bytes] = ...) -> None: ...

class ReplicationItem(_message.Message):
    __slots__ = ("kind", "table", "lsn_epoch", "lsn_index", "slots", "prev_epochs", "prev_indexes", "rows", "deletes", "sighting_ids", "sighting_counts", "step", "dedup", "table_epoch", "copy_id", "after_seq")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    LSN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LSN_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PREV_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    PREV_INDEXES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DELETES_FIELD_NUMBER: _ClassVar[int]
    SIGHTING_IDS_FIELD_NUMBER: _ClassVar[int]
    SIGHTING_COUNTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DEDUP_FIELD_NUMBER: _ClassVar[int]
    TABLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    COPY_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    kind: ItemKind
    table: str
    lsn_epoch: int
    lsn_index: int
    slots: bytes
    prev_epochs: bytes
    prev_indexes: bytes
    rows: RowBlock
    deletes: bytes
    sighting_ids: bytes
    sighting_counts: bytes
    step: int
    dedup: _containers.RepeatedCompositeFieldContainer[DedupRecord]
    table_epoch: int
    copy_id: int
    after_seq: int
    def __init__(self, kind: _Optional[_Union[ItemKind, str]] = ..., table: _Optional[str] = ..., lsn_epoch: _Optional[int] = ..., lsn_index: _Optional[int] = ..., slots: _Optional[bytes] = ..., prev_epochs: _Optional[bytes] = ..., prev_indexes: _Optional[bytes] = ..., rows: _Optional[_Union[RowBlock, _Mapping]] = ..., deletes: _Optional[bytes] = ..., sighting_ids: _Optional[bytes] = ..., sighting_counts: _Optional[bytes] = ..., step: _Optional[int] = ..., dedup: _Optional[_Iterable[_Union[DedupRecord, _Mapping]]] = ..., table_epoch: _Optional[int] = ..., copy_id: _Optional[int] = ..., after_seq: _Optional[int] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("source", "source_boot", "generation", "epoch", "first_seq", "items", "lane")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BOOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    source: str
    source_boot: str
    generation: int
    epoch: int
    first_seq: int
    items: _containers.RepeatedCompositeFieldContainer[ReplicationItem]
    lane: int
    def __init__(self, source: _Optional[str] = ..., source_boot: _Optional[str] = ..., generation: _Optional[int] = ..., epoch: _Optional[int] = ..., first_seq: _Optional[int] = ..., items: _Optional[_Iterable[_Union[ReplicationItem, _Mapping]]] = ..., lane: _Optional[int] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("applied_through", "reject", "message", "slots", "epoch")
    APPLIED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    applied_through: int
    reject: ReplicateReject
    message: str
    slots: bytes
    epoch: int
    def __init__(self, applied_through: _Optional[int] = ..., reject: _Optional[_Union[ReplicateReject, str]] = ..., message: _Optional[str] = ..., slots: _Optional[bytes] = ..., epoch: _Optional[int] = ...) -> None: ...

class SlotInfoRequest(_message.Message):
    __slots__ = ("table", "checksums")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    table: str
    checksums: bool
    def __init__(self, table: _Optional[str] = ..., checksums: _Optional[bool] = ...) -> None: ...

class SlotTableInfo(_message.Message):
    __slots__ = ("table", "slots", "rows", "checksums", "lsn_epochs", "lsn_indexes", "pull_rates", "push_rates", "bytes")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    LSN_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    LSN_INDEXES_FIELD_NUMBER: _ClassVar[int]
    PULL_RATES_FIELD_NUMBER: _ClassVar[int]
    PUSH_RATES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    table: str
    slots: bytes
    rows: bytes
    checksums: bytes
    lsn_epochs: bytes
    lsn_indexes: bytes
    pull_rates: bytes
    push_rates: bytes
    bytes: bytes
    def __init__(self, table: _Optional[str] = ..., slots: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., checksums: _Optional[bytes] = ..., lsn_epochs: _Optional[bytes] = ..., lsn_indexes: _Optional[bytes] = ..., pull_rates: _Optional[bytes] = ..., push_rates: _Optional[bytes] = ..., bytes: _Optional[bytes] = ...) -> None: ...

class SlotInfoResponse(_message.Message):
    __slots__ = ("epoch", "tables", "server_id", "replication")
    class ReplicationEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    tables: _containers.RepeatedCompositeFieldContainer[SlotTableInfo]
    server_id: str
    replication: _containers.ScalarMap[str, float]
    def __init__(self, epoch: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[SlotTableInfo, _Mapping]]] = ..., server_id: _Optional[str] = ..., replication: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ExportRowsRequest(_message.Message):
    __slots__ = ("table", "slots", "chunk_rows", "weights_only", "since_time", "epoch", "cut")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ROWS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    SINCE_TIME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    table: str
    slots: bytes
    chunk_rows: int
    weights_only: bool
    since_time: float
    epoch: int
    cut: str
    def __init__(self, table: _Optional[str] = ..., slots: _Optional[bytes] = ..., chunk_rows: _Optional[int] = ..., weights_only: _Optional[bool] = ..., since_time: _Optional[float] = ..., epoch: _Optional[int] = ..., cut: _Optional[str] = ...) -> None: ...

class ExportRowsChunk(_message.Message):
    __slots__ = ("rows", "slots", "positions_epochs", "positions_indexes", "step", "server_time", "deleted_ids", "deleted_complete")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_INDEXES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    DELETED_IDS_FIELD_NUMBER: _ClassVar[int]
    DELETED_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    rows: RowBlock
    slots: bytes
    positions_epochs: bytes
    positions_indexes: bytes
    step: int
    server_time: float
    deleted_ids: bytes
    deleted_complete: bool
    def __init__(self, rows: _Optional[_Union[RowBlock, _Mapping]] = ..., slots: _Optional[bytes] = ..., positions_epochs: _Optional[bytes] = ..., positions_indexes: _Optional[bytes] = ..., step: _Optional[int] = ..., server_time: _Optional[float] = ..., deleted_ids: _Optional[bytes] = ..., deleted_complete: _Optional[bool] = ...) -> None: ...

class ImportRowsRequest(_message.Message):
    __slots__ = ("table", "rows", "epoch", "step")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    table: str
    rows: RowBlock
    epoch: int
    step: int
    def __init__(self, table: _Optional[str] = ..., rows: _Optional[_Union[RowBlock, _Mapping]] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class ImportRowsResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class PrepareCutRequest(_message.Message):
    __slots__ = ("cut", "tables", "hold_ms")
    CUT_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    cut: str
    tables: _containers.RepeatedScalarFieldContainer[str]
    hold_ms: int
    def __init__(self, cut: _Optional[str] = ..., tables: _Optional[_Iterable[str]] = ..., hold_ms: _Optional[int] = ...) -> None: ...

class PrepareCutResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class CommitCutRequest(_message.Message):
    __slots__ = ("cut", "since", "keep_ms", "base_epoch", "base_positions")
    class SinceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class BasePositionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    CUT_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    KEEP_MS_FIELD_NUMBER: _ClassVar[int]
    BASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    cut: str
    since: _containers.ScalarMap[str, float]
    keep_ms: int
    base_epoch: int
    base_positions: _containers.ScalarMap[str, bytes]
    def __init__(self, cut: _Optional[str] = ..., since: _Optional[_Mapping[str, float]] = ..., keep_ms: _Optional[int] = ..., base_epoch: _Optional[int] = ..., base_positions: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class CutTable(_message.Message):
    __slots__ = ("table", "step", "full", "positions_epochs", "positions_indexes")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_INDEXES_FIELD_NUMBER: _ClassVar[int]
    table: str
    step: int
    full: bool
    positions_epochs: bytes
    positions_indexes: bytes
    def __init__(self, table: _Optional[str] = ..., step: _Optional[int] = ..., full: _Optional[bool] = ..., positions_epochs: _Optional[bytes] = ..., positions_indexes: _Optional[bytes] = ...) -> None: ...

class CommitCutResponse(_message.Message):
    __slots__ = ("epoch", "slots", "server_time", "tables")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    slots: bytes
    server_time: float
    tables: _containers.RepeatedCompositeFieldContainer[CutTable]
    def __init__(self, epoch: _Optional[int] = ..., slots: _Optional[bytes] = ..., server_time: _Optional[float] = ..., tables: _Optional[_Iterable[_Union[CutTable, _Mapping]]] = ...) -> None: ...

class ReleaseCutRequest(_message.Message):
    __slots__ = ("cut",)
    CUT_FIELD_NUMBER: _ClassVar[int]
    cut: str
    def __init__(self, cut: _Optional[str] = ...) -> None: ...

class ReleaseCutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExchangeRequest(_message.Message):
    __slots__ = ("id", "pull", "push", "timeout_ms", "bundle", "pulls", "pushes")
    ID_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    id: int
    pull: PullRequest
    push: PushRequest
    timeout_ms: int
    bundle: _containers.RepeatedCompositeFieldContainer[ExchangeRequest]
    pulls: _containers.RepeatedCompositeFieldContainer[PullRequest]
    pushes: _containers.RepeatedCompositeFieldContainer[PushRequest]
    def __init__(self, id: _Optional[int] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ..., push: _Optional[_Union[PushRequest, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., bundle: _Optional[_Iterable[_Union[ExchangeRequest, _Mapping]]] = ..., pulls: _Optional[_Iterable[_Union[PullRequest, _Mapping]]] = ..., pushes: _Optional[_Iterable[_Union[PushRequest, _Mapping]]] = ...) -> None: ...

class ExchangeResponse(_message.Message):
    __slots__ = ("id", "pull", "push", "code", "message", "error", "epoch", "bundle", "parts")
    ID_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    id: int
    pull: PullResponse
    push: PushResponse
    code: int
    message: str
    error: str
    epoch: int
    bundle: _containers.RepeatedCompositeFieldContainer[ExchangeResponse]
    parts: _containers.RepeatedCompositeFieldContainer[ExchangeResponse]
    def __init__(self, id: _Optional[int] = ..., pull: _Optional[_Union[PullResponse, _Mapping]] = ..., push: _Optional[_Union[PushResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., error: _Optional[str] = ..., epoch: _Optional[int] = ..., bundle: _Optional[_Iterable[_Union[ExchangeResponse, _Mapping]]] = ..., parts: _Optional[_Iterable[_Union[ExchangeResponse, _Mapping]]] = ...) -> None: ...
