"""tigana.ps — the parameter server: shard daemons over gRPC and the client trainers use.

Example::

    from tigana import ps
    client = ps.connect(["127.0.0.1:7101", "127.0.0.1:7102"])
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
from tigana.ps.client import Client, ClientConfig, Compression, TableInfo, connect
from tigana.ps.config import ServerConfig, load_server_config, parse_bytes
from tigana.ps.daemon import ServerHandle, start_server
from tigana.ps.errors import (
    DataLoss,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    PSError,
    ResourceExhausted,
    TableExists,
    TableNotFound,
    Unavailable,
    WrongShard,
)
from tigana.ps.local import LocalCluster

__all__ = [
    "FTRL", "SGD", "Adagrad", "Adam", "Admission", "DataLoss", "DeadlineExceeded", "Eviction", "Internal",
    "InvalidArgument", "Normal", "PSError", "ResourceExhausted", "RowWiseAdagrad", "TableExists",
    "TableNotFound", "Unavailable", "Uniform", "WrongShard", "Zeros",
    "Client", "ClientConfig", "Compression", "TableInfo", "connect",
    "LocalCluster", "ServerConfig", "ServerHandle", "load_server_config", "parse_bytes", "start_server",
]
