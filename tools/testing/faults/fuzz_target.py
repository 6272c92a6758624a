"""An atheris (libFuzzer) target: coverage-guided bytes to every method of a real shard server.

    python -m tigana.tools.testing.faults.fuzz_target -runs=20000 [corpus_dir]

A shard server (static mode, one table) serves on a loopback port in this process, so atheris sees the
coverage of the request decoding and validation it drives. The first input byte picks the method, the rest
is the request. A crash is an answer of INTERNAL or UNKNOWN, or a server that stops answering.
``tigana bench faults --only malformed`` runs it for a while when atheris is installed (``pip install
tigana[fuzz]``).
"""

from __future__ import annotations

import sys
import tempfile

import grpc
import numpy as np

from tigana.proto import shard_pb2 as pb

METHODS = [(f"/tigana.v1.Shard/{m.name}", m.server_streaming)
           for m in pb.DESCRIPTOR.services_by_name["Shard"].methods] + [("/grpc.health.v1.Health/Check", False)]
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class Target:
    """The server and a channel to it; ``__call__`` is the fuzz target."""

    def __init__(self, data_dir: str) -> None:
        from tigana import ps
        from tigana.ps.shard.config import ServerConfig
        from tigana.ps.shard.daemon import start_server

        self.handle = start_server(ServerConfig(port=0, data_dir=data_dir, drain_grace_s=1.0, max_workers=4))
        if not self.handle.wait_ready(60):
            raise RuntimeError(f"fuzz target: the server did not start: {self.handle.error}")
        with ps.connect([self.handle.address]) as client:
            client.create_table("fuzz", dim=4, optimizer=ps.Adagrad(lr=0.1))
            client.push("fuzz", np.arange(100), np.ones((100, 4), np.float32)).result()
        self.channel = grpc.insecure_channel(self.handle.address)
        self.calls = [(self.channel.unary_stream(p) if s else self.channel.unary_unary(p), s, p) for p, s in METHODS]

    def __call__(self, data: bytes) -> None:
        if not data:
            return
        call, streaming, path = self.calls[data[0] % len(self.calls)]
        try:
            if streaming:
                for _ in call(data[1:], timeout=10):
                    pass
            else:
                call(data[1:], timeout=10)
        except grpc.RpcError as err:
            if err.code() in BAD or err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise AssertionError(f"{path}: {err.code().name}: {err.details()}") from None

    def close(self) -> None:
        self.channel.close()
        self.handle.close(grace=1.0)


# The request path: decoding, validation, the handlers. Not the storage engine: numba compiles its kernels
# from their Python code, which must stay uninstrumented.
_MODULES = ("tigana.ps.rpc", "tigana.ps.wire.data", "tigana.ps.shard._guard", "tigana.ps.shard.service",
            "tigana.ps.shard.hosted", "tigana.ps.shard.ownership", "tigana.ps.shard.writes", "tigana.ps.shard.export",
            "tigana.ps.shard.persistence", "tigana.ps.shard.view", "tigana.ps.shard.cuts", "tigana.ps.shard.receiver",
            "tigana.ps.errors", "tigana.ps.wire.cluster", "tigana.ps.routing",
            "tigana.embeddings.config")


def _instrument(atheris) -> None:
    import importlib
    import inspect

    for name in _MODULES:
        module = importlib.import_module(name)
        for obj in list(vars(module).values()):
            if inspect.isfunction(obj) and obj.__module__ == name:
                atheris.instrument_func(obj)
            elif inspect.isclass(obj) and obj.__module__ == name:
                for member in vars(obj).values():
                    if inspect.isfunction(member):
                        atheris.instrument_func(member)


def main(argv: list[str]) -> None:
    import atheris

    with tempfile.TemporaryDirectory(prefix="tigana-fuzz-") as tmp:
        target = Target(tmp)
        _instrument(atheris)
        try:
            atheris.Setup(argv, target)
            atheris.Fuzz()
        finally:
            target.close()


if __name__ == "__main__":
    main(sys.argv)
