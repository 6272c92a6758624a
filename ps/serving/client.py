"""``ServingClient``: a small client of ``tigana.v1.Serving`` (``tigana serve``)."""

from __future__ import annotations

import grpc
import numpy as np

from tigana.proto import serving_pb2 as pb
from tigana.proto import serving_pb2_grpc
from tigana.ps.errors import DataLoss, from_rpc_error
from tigana.ps.security import NONE, Security


class ServingClient:
    """A small client of ``tigana.v1.Serving``: ``lookup(ids) -> (rows, found)``, ``predict(dense,
    categorical) -> (probabilities, version)`` (``tigana serve --model``), ``info()``."""

    def __init__(self, address: str, *, timeout_s: float = 10.0, max_message_bytes: int = 64 << 20,
                 security: Security = NONE) -> None:
        self.address, self.timeout_s = address, timeout_s
        self.channel = security.channel(address, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)])
        self.stub = serving_pb2_grpc.ServingStub(self.channel)

    def lookup(self, ids: np.ndarray, table: str = "") -> tuple[np.ndarray, np.ndarray]:
        """(n,) int64 ids -> ((n, dim) float32, (n,) bool found)."""
        ids = np.ascontiguousarray(ids, "<i8")
        try:
            reply = self.stub.Lookup(pb.ServingLookupRequest(ids=ids.tobytes(), table=table), timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.address) from None
        rows = np.frombuffer(reply.rows, "<f4")
        if reply.dim == 0 or rows.size != ids.size * reply.dim:
            raise DataLoss(f"{self.address}: Lookup answered {rows.size} floats for {ids.size} ids of dim {reply.dim}")
        return rows.reshape(ids.size, reply.dim), np.frombuffer(reply.found, np.uint8).astype(bool)

    def predict(self, dense: np.ndarray, categorical: np.ndarray) -> tuple[np.ndarray, int]:
        """Click probabilities of feature rows in the training data's raw form: ``dense`` (n, num_dense)
        values (NaN: missing), ``categorical`` (n, num_sparse) raw values before hashing (uint64; Criteo's hex
        fields as integers; ``0xFFFFFFFFFFFFFFFF``: missing). Returns ((n,) float32 probabilities, the model
        version that answered). Shapes are checked against the server's ``info()`` by the server."""
        dense = np.ascontiguousarray(dense, "<f4")
        categorical = np.ascontiguousarray(categorical, "<u8")
        if dense.ndim != 2 or categorical.ndim != 2 or dense.shape[0] != categorical.shape[0]:
            raise ValueError(f"predict: dense {dense.shape} and categorical {categorical.shape} must be 2-D with "
                             "one row per sample each")
        n = dense.shape[0]
        try:
            reply = self.stub.Predict(pb.PredictRequest(rows=n, dense=dense.tobytes(),
                                                        categorical=categorical.tobytes()), timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.address) from None
        out = np.frombuffer(reply.probabilities, "<f4")
        if out.size != n:
            raise DataLoss(f"{self.address}: Predict answered {out.size} probabilities for {n} rows")
        return out, int(reply.version)

    def info(self) -> pb.ServingInfoResponse:
        try:
            return self.stub.Info(pb.ServingInfoRequest(), timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.address) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> ServingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
