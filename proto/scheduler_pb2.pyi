from tigana.proto import shard_pb2 as _shard_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("server_id", "address", "boot", "positions")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BOOT_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    address: str
    boot: str
    positions: _containers.RepeatedCompositeFieldContainer[_shard_pb2.SlotTableInfo]
    def __init__(self, server_id: _Optional[str] = ..., address: _Optional[str] = ..., boot: _Optional[str] = ..., positions: _Optional[_Iterable[_Union[_shard_pb2.SlotTableInfo, _Mapping]]] = ...) -> None: ...

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
    __slots__ = ("reporter", "epoch", "target", "slots")
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    reporter: str
    epoch: int
    target: str
    slots: bytes
    def __init__(self, reporter: _Optional[str] = ..., epoch: _Optional[int] = ..., target: _Optional[str] = ..., slots: _Optional[bytes] = ...) -> None: ...

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
    __slots__ = ("map", "servers", "degraded_slots", "unavailable_slots")
    MAP_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    map: _shard_pb2.ShardMap
    servers: _containers.RepeatedCompositeFieldContainer[ServerStatus]
    degraded_slots: int
    unavailable_slots: int
    def __init__(self, map: _Optional[_Union[_shard_pb2.ShardMap, _Mapping]] = ..., servers: _Optional[_Iterable[_Union[ServerStatus, _Mapping]]] = ..., degraded_slots: _Optional[int] = ..., unavailable_slots: _Optional[int] = ...) -> None: ...

class SchedulerState(_message.Message):
    __slots__ = ("map", "target", "target_width")
    MAP_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TARGET_WIDTH_FIELD_NUMBER: _ClassVar[int]
    map: _shard_pb2.ShardMap
    target: bytes
    target_width: int
    def __init__(self, map: _Optional[_Union[_shard_pb2.ShardMap, _Mapping]] = ..., target: _Optional[bytes] = ..., target_width: _Optional[int] = ...) -> None: ...
