"""tigana.ps — the parameter server: shard daemons over gRPC, the scheduler that owns the shard map (placement,
replication, failover), and the client trainers use.

Example::

    from tigana import ps
    client = ps.connect(scheduler="127.0.0.1:7100")     # or a static list: ps.connect(["h1:7101", "h2:7101"])
    client.create_table("user_id", dim=16, optimizer=ps.Adagrad(lr=0.05), initializer=ps.Normal(std=0.01))
    rows = client.pull("user_id", ids)        # (n,) int64 -> (n, 16) float32, in the order of ids
    fut = client.push("user_id", ids, grads)  # asynchronous; fut.result() waits
    client.flush()                            # waits for every push in flight

``import tigana.ps`` loads the client only. The server-side names (``start_server``, ``ServerConfig``,
``start_scheduler``, ``LocalCluster``, ...) load their subsystem on first use (``_LAZY``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tigana.embeddings.config import (
    FTRL,
    SGD,
    Adagrad,
    Adam,
    Admission,
    Eviction,
    Normal,
    RowWiseAdagrad,
    Uniform,
    Zeros,
)
from tigana.embeddings.unseen import Unseen
from tigana.ps.client import Client, ClientConfig, Compression, TableInfo, connect
from tigana.ps.errors import (
    DataLoss,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    NotEnoughReplicas,
    PermissionDenied,
    PSError,
    PushExpired,
    ResourceExhausted,
    TableExists,
    TableNotFound,
    Unauthenticated,
    Unavailable,
    UnknownClient,
    WrongShard,
)
from tigana.ps.routing import ShardMap, TableDef
from tigana.ps.security import Security
from tigana.ps.settings import parse_bytes

if TYPE_CHECKING:
    from tigana.ps.ops.local import LocalCluster, LocalEtcd
    from tigana.ps.scheduler import SchedulerConfig, SchedulerHandle, start_scheduler
    from tigana.ps.shard.config import ServerConfig, load_server_config
    from tigana.ps.shard.daemon import ServerHandle, start_server

# The server side, imported when a name is first asked for (PEP 562): name -> the module that defines it.
_LAZY = {
    "ServerConfig": "tigana.ps.shard.config", "load_server_config": "tigana.ps.shard.config",
    "ServerHandle": "tigana.ps.shard.daemon", "start_server": "tigana.ps.shard.daemon",
    "SchedulerConfig": "tigana.ps.scheduler", "SchedulerHandle": "tigana.ps.scheduler",
    "start_scheduler": "tigana.ps.scheduler",
    "LocalCluster": "tigana.ps.ops.local", "LocalEtcd": "tigana.ps.ops.local",
}

__all__ = [
    "FTRL", "SGD", "Adagrad", "Adam", "Admission", "DataLoss", "DeadlineExceeded", "Eviction", "Internal",
    "InvalidArgument", "Normal", "NotEnoughReplicas", "PSError", "PermissionDenied", "PushExpired",
    "ResourceExhausted", "Unauthenticated", "UnknownClient",
    "RowWiseAdagrad", "TableExists",
    "TableNotFound", "Unavailable", "Uniform", "Unseen", "WrongShard", "Zeros",
    "Client", "ClientConfig", "Compression", "TableInfo", "connect",
    "LocalCluster", "LocalEtcd", "ServerConfig", "ServerHandle", "load_server_config", "parse_bytes", "start_server",
    "SchedulerConfig", "SchedulerHandle", "Security", "ShardMap", "TableDef", "start_scheduler",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
