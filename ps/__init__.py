"""tigana.ps — the parameter server: shard daemons over gRPC, the scheduler that owns the shard map (placement,
replication, failover), and the client trainers use.

Example::

    from tigana import ps
    client = ps.connect(scheduler="127.0.0.1:7100")     # or a static list: ps.connect(["h1:7101", "h2:7101"])
    client.create_table("user_id", dim=16, optimizer=ps.Adagrad(lr=0.05), initializer=ps.Normal(std=0.01))
    rows = client.pull("user_id", ids)        # (n,) int64 -> (n, 16) float32, in the order of ids
    fut = client.push("user_id", ids, grads)  # asynchronous; fut.result() waits
    client.flush()                            # waits for every push in flight
"""

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
from tigana.ps.local import LocalCluster, LocalEtcd
from tigana.ps.routing import ShardMap, TableDef
from tigana.ps.scheduler import SchedulerConfig, SchedulerHandle, start_scheduler
from tigana.ps.security import Security
from tigana.ps.settings import parse_bytes
from tigana.ps.shard.config import ServerConfig, load_server_config
from tigana.ps.shard.daemon import ServerHandle, start_server

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
