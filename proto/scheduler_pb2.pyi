from tigana.proto import shard_pb2 as _shard_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("server_id", "address", "boot", "positions", "domain")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BOOT_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    boot: str
    positions: _containers.RepeatedCompositeFieldContainer[_shard_pb2.SlotTableInfo]
    domain: _shard_pb2.FailureDomain
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ..., boot: _Optional[str] = ..., positions: _Optional[_Iterable[_Union[_shard_pb2.SlotTableInfo, _Mapping]]] = ..., domain: _Optional[_Union[_shard_pb2.FailureDomain, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("map",)
    MAP_FIELD_NUMBER: _ClassVar[int]
    map: _shard_pb2.ShardMap
    def __init__(self, map: _Optional[_Union[_shard_pb2.ShardMap, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("server_id", "boot", "epoch", "stats")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    BOOT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    boot: str
    epoch: int
    stats: _containers.ScalarMap[str, float]
    def __init__(self, server_id: _Optional[str] = ..., boot: _Optional[str] = ..., epoch: _Optional[int] = ..., stats: _Optional[_Mapping[str, float]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("map", "reregister")
    MAP_FIELD_NUMBER: _ClassVar[int]
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    map: _shard_pb2.ShardMap
    reregister: bool
    def __init__(self, map: _Optional[_Union[_shard_pb2.ShardMap, _Mapping]] = ..., reregister: _Optional[bool] = ...) -> None: ...

class GetMapRequest(_message.Message):
    __slots__ = ("known_epoch", "wait_s")
    KNOWN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    known_epoch: int
    wait_s: float
    def __init__(self, known_epoch: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class GetMapResponse(_message.Message):
    __slots__ = ("map", "epoch")
    MAP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    map: _shard_pb2.ShardMap
    epoch: int
    def __init__(self, map: _Optional[_Union[_shard_pb2.ShardMap, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReportCopyFailureRequest(_message.Message):
    __slots__ = ("reporter", "epoch", "target", "slots", "reason")
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    reporter: str
    epoch: int
    target: str
    slots: bytes
    reason: str
    def __init__(self, reporter: _Optional[str] = ..., epoch: _Optional[int] = ..., target: _Optional[str] = ..., slots: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class CopyCaughtUpRequest(_message.Message):
    __slots__ = ("reporter", "epoch", "target", "slots", "since_epoch")
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SINCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    reporter: str
    epoch: int
    target: str
    slots: bytes
    since_epoch: int
    def __init__(self, reporter: _Optional[str] = ..., epoch: _Optional[int] = ..., target: _Optional[str] = ..., slots: _Optional[bytes] = ..., since_epoch: _Optional[int] = ...) -> None: ...

class HandoverReadyRequest(_message.Message):
    __slots__ = ("reporter", "epoch", "slots")
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    reporter: str
    epoch: int
    slots: bytes
    def __init__(self, reporter: _Optional[str] = ..., epoch: _Optional[int] = ..., slots: _Optional[bytes] = ...) -> None: ...

class ReportUnreachableRequest(_message.Message):
    __slots__ = ("address", "reporter")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    address: str
    reporter: str
    def __init__(self, address: _Optional[str] = ..., reporter: _Optional[str] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("epoch", "accepted", "message")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    accepted: bool
    message: str
    def __init__(self, epoch: _Optional[int] = ..., accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStatus(_message.Message):
    __slots__ = ("info", "last_heartbeat_s", "primaries", "replicas", "catching_up", "stats")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    INFO_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    PRIMARIES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CATCHING_UP_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    info: _shard_pb2.ServerInfo
    last_heartbeat_s: float
    primaries: int
    replicas: int
    catching_up: int
    stats: _containers.ScalarMap[str, float]
    def __init__(self, info: _Optional[_Union[_shard_pb2.ServerInfo, _Mapping]] = ..., last_heartbeat_s: _Optional[float] = ..., primaries: _Optional[int] = ..., replicas: _Optional[int] = ..., catching_up: _Optional[int] = ..., stats: _Optional[_Mapping[str, float]] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("map", "servers", "degraded_slots", "unavailable_slots", "moving_slots", "draining", "domain_degraded_slots", "domain_level")
    MAP_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MOVING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_DEGRADED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_LEVEL_FIELD_NUMBER: _ClassVar[int]
    map: _shard_pb2.ShardMap
    servers: _containers.RepeatedCompositeFieldContainer[ServerStatus]
    degraded_slots: int
    unavailable_slots: int
    moving_slots: int
    draining: _containers.RepeatedScalarFieldContainer[str]
    domain_degraded_slots: int
    domain_level: str
    def __init__(self, map: _Optional[_Union[_shard_pb2.ShardMap, _Mapping]] = ..., servers: _Optional[_Iterable[_Union[ServerStatus, _Mapping]]] = ..., degraded_slots: _Optional[int] = ..., unavailable_slots: _Optional[int] = ..., moving_slots: _Optional[int] = ..., draining: _Optional[_Iterable[str]] = ..., domain_degraded_slots: _Optional[int] = ..., domain_level: _Optional[str] = ...) -> None: ...

class MoveSlotRequest(_message.Message):
    __slots__ = ("slot", "to", "primary")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    slot: int
    to: str
    primary: bool
    def __init__(self, slot: _Optional[int] = ..., to: _Optional[str] = ..., primary: _Optional[bool] = ..., **kwargs) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("server", "undrain")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    UNDRAIN_FIELD_NUMBER: _ClassVar[int]
    server: str
    undrain: bool
    def __init__(self, server: _Optional[str] = ..., undrain: _Optional[bool] = ...) -> None: ...

class CostModel(_message.Message):
    __slots__ = ("row_weight", "rate_weight", "link_bytes_per_s")
    ROW_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RATE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LINK_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    row_weight: float
    rate_weight: float
    link_bytes_per_s: float
    def __init__(self, row_weight: _Optional[float] = ..., rate_weight: _Optional[float] = ..., link_bytes_per_s: _Optional[float] = ...) -> None: ...

class SlotLoad(_message.Message):
    __slots__ = ("rows", "bytes", "rates")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RATES_FIELD_NUMBER: _ClassVar[int]
    rows: bytes
    bytes: bytes
    rates: bytes
    def __init__(self, rows: _Optional[bytes] = ..., bytes: _Optional[bytes] = ..., rates: _Optional[bytes] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("plan_only", "cost", "load")
    PLAN_ONLY_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    plan_only: bool
    cost: CostModel
    load: SlotLoad
    def __init__(self, plan_only: _Optional[bool] = ..., cost: _Optional[_Union[CostModel, _Mapping]] = ..., load: _Optional[_Union[SlotLoad, _Mapping]] = ...) -> None: ...

class Move(_message.Message):
    __slots__ = ("slot", "add", "remove", "primary_from", "primary_to", "bytes")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FROM_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_TO_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    slot: int
    add: _containers.RepeatedScalarFieldContainer[str]
    remove: _containers.RepeatedScalarFieldContainer[str]
    primary_from: str
    primary_to: str
    bytes: int
    def __init__(self, slot: _Optional[int] = ..., add: _Optional[_Iterable[str]] = ..., remove: _Optional[_Iterable[str]] = ..., primary_from: _Optional[str] = ..., primary_to: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class LoadFigures(_message.Message):
    __slots__ = ("max", "mean", "per_server")
    class PerServerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    PER_SERVER_FIELD_NUMBER: _ClassVar[int]
    max: float
    mean: float
    per_server: _containers.ScalarMap[str, float]
    def __init__(self, max: _Optional[float] = ..., mean: _Optional[float] = ..., per_server: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("moves", "before", "after", "bytes_moved", "predicted_seconds", "applied", "epoch", "note")
    MOVES_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    moves: _containers.RepeatedCompositeFieldContainer[Move]
    before: LoadFigures
    after: LoadFigures
    bytes_moved: int
    predicted_seconds: float
    applied: bool
    epoch: int
    note: str
    def __init__(self, moves: _Optional[_Iterable[_Union[Move, _Mapping]]] = ..., before: _Optional[_Union[LoadFigures, _Mapping]] = ..., after: _Optional[_Union[LoadFigures, _Mapping]] = ..., bytes_moved: _Optional[int] = ..., predicted_seconds: _Optional[float] = ..., applied: _Optional[bool] = ..., epoch: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...

class SchedulerState(_message.Message):
    __slots__ = ("map", "target", "target_width", "draining", "target_kind")
    MAP_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TARGET_KIND_FIELD_NUMBER: _ClassVar[int]
    map: _shard_pb2.ShardMap
    target: bytes
    target_width: int
    draining: _containers.RepeatedScalarFieldContainer[str]
    target_kind: str
    def __init__(self, map: _Optional[_Union[_shard_pb2.ShardMap, _Mapping]] = ..., target: _Optional[bytes] = ..., target_width: _Optional[int] = ..., draining: _Optional[_Iterable[str]] = ..., target_kind: _Optional[str] = ...) -> None: ...
