"""Configuration of a shard server: a frozen dataclass and its loader.

``load_server_config`` merges four sources, highest first: CLI flags, ``TIGANA_*`` environment variables,
a YAML or TOML config file, the dataclass defaults. Sizes accept ``8GiB``, ``512MiB``, ``1.5G`` or plain bytes.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tigana.ps import settings
from tigana.ps.domains import FailureDomain
from tigana.ps.errors import InvalidArgument
from tigana.ps.routing import DEFAULT_NUM_SLOTS, parse_slots
from tigana.ps.security import SecuritySettings
from tigana.ps.settings import parse_bytes

MiB = 1 << 20


@dataclass(frozen=True)
class ServerConfig(SecuritySettings):
    """Everything a shard server needs. Immutable; ``dataclasses.replace`` makes variants.

    port / metrics_port: 0 for ``port`` picks a free port; ``metrics_port`` 0 turns the metrics HTTP endpoint
    off and -1 picks a free port. ``slots``: the slots this server leads, as text (``"all"`` or
    ``"0-2047,4000"``, inclusive ranges over ``num_slots`` virtual slots). ``memory_budget`` (bytes) caps the resident rows of the whole
    daemon: tables with no budget of their own share what tables with one leave (at least 1 MiB each); past
    its share a table spills cold rows to a spill file under ``data_dir``, each table's spill tier capped at
    ``spill_max_bytes`` (None: until the disk is full); when spilling fails, new rows past 1.25x a table's
    share are refused with RESOURCE_EXHAUSTED (stored rows still update). ``data_dir`` None keeps
    everything in memory (no snapshots on shutdown, Snapshot/Restore RPCs refused). ``keep_snapshots``: full
    snapshot chains kept per table after each full snapshot (0 keeps all).

    Cluster: ``scheduler`` ("host:port") makes the server register with a scheduler, heartbeat every
    ``heartbeat_interval_s`` and hold the slots the shard map gives it (``slots`` must stay "all" then).
    ``server_id``: stable identity (default: created once in the data dir). ``advertise``: host:port the
    scheduler, clients and peers use (default: the bound address). ``snapshot_every_s`` > 0 (default 60, 0
    turns it off): an incremental snapshot of every table with a ``data_dir`` that often, a full one every
    ``full_snapshot_every`` snapshots. It bounds what a ``kill -9`` of a standalone server, or the loss of
    every copy of a slot, costs: the updates since the last snapshot (docs/durability.md has the measured
    table). 60 s is Redis's busiest default save rule (60 s when 10,000 keys changed); an incremental snapshot
    writes only the rows changed since the last one (0.4 s per 100,000 changed rows of dim 16).
    ``replication_timeout_s``: a copy that has not applied the stream for that long is reported to the
    scheduler; ``ack_timeout_s``: how long a sync push waits for its copies
    before answering UNAVAILABLE (the client retries; exactly-once makes that safe). ``lease_s``: an async
    push is acknowledged only while the last successful heartbeat was sent less than this ago (keep it below the
    scheduler's heartbeat timeout: it bounds what a paused, deposed primary can acknowledge). ``copy_rate``: bytes a
    second the slot copies of planned moves (rebalance, drain, hand-over) that this server sends may use, all
    together (None, 0 or ``unlimited``: no cap); a copy restoring a missing replica is never paced. 32 MiB/s is
    CockroachDB's default for rebalance snapshots: a move at full speed made sync pushes' p99 several times its
    usual value on a busy server (``tigana.ps.replication.pacing``). ``domain``: where the server runs,
    ``zone=Z,rack=R,host=H`` (any of them; the host defaults to the machine's name): the scheduler keeps a slot's
    copies in distinct domains (``tigana.ps.domains``). ``workers``: shard processes this daemon runs on its host
    (``tigana server --workers N``, ``tigana.tools.server_workers``): each is a server of the map with its own
    port and data folder, all in this daemon's failure domain.

    Security (``tigana.ps.security``): ``tls_cert``/``tls_key`` serve TLS, ``tls_ca`` verifies peers (and,
    with ``require_client_cert``, clients' certificates); ``auth_token_file`` holds the trainers' token,
    ``admin_token_file`` the admin token (which this server also sends to the scheduler and its peers);
    tokens need TLS unless ``allow_insecure_loopback``. Limits: ``max_message_bytes``,
    ``max_rows_per_request`` (ids in one pull or push), ``max_concurrent_requests`` (RPCs in progress; more
    answer RESOURCE_EXHAUSTED). Streaming data path: ``max_streams`` ``Exchange`` streams at most (each holds a
    gRPC thread for its life; past the limit clients use the unary calls), each with at most ``stream_window``
    frames read and not yet answered (flow control holds the client back past it).
    """

    host: str = "127.0.0.1"
    port: int = 0
    data_dir: str | None = None
    memory_budget: int | None = None
    spill_max_bytes: int | None = None
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    num_slots: int = DEFAULT_NUM_SLOTS
    slots: str = "all"
    max_workers: int = 16
    max_message_bytes: int = 64 * MiB
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    dedup_window: int = 1024
    drain_grace_s: float = 30.0
    snapshot_on_shutdown: bool = True
    keep_snapshots: int = 2
    scheduler: str | None = None
    server_id: str | None = None
    advertise: str | None = None
    heartbeat_interval_s: float = 0.5
    snapshot_every_s: float = 60.0
    full_snapshot_every: int = 10
    replication_timeout_s: float = 2.0
    ack_timeout_s: float = 10.0
    replication_queue_bytes: int = 512 * MiB  # per outgoing stream; writers wait past it (back-pressure)
    copy_rate: int | None = 32 * MiB
    lease_s: float = 2.0
    max_rows_per_request: int = 4_000_000
    max_concurrent_requests: int = 256
    max_streams: int = 64
    stream_window: int = 8
    domain: str = ""
    workers: int = 1

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> InvalidArgument:
            return InvalidArgument(f"server config: field {field!r} {why}")

        if not 0 <= self.port <= 65535:
            raise bad("port", f"must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise bad("metrics_port", f"must be -1 (any free port), 0 (off) or a port, got {self.metrics_port}")
        if self.num_slots < 1:
            raise bad("num_slots", f"must be >= 1, got {self.num_slots}")
        if self.max_workers < 1:
            raise bad("max_workers", f"must be >= 1, got {self.max_workers}")
        if self.max_message_bytes < 1 << 16:
            raise bad("max_message_bytes", f"must be >= 64KiB, got {self.max_message_bytes}")
        if isinstance(self.workers, bool) or self.workers < 1:
            raise bad("workers", f"must be >= 1, got {self.workers}")
        if self.dedup_window < 1:
            raise bad("dedup_window", f"must be >= 1, got {self.dedup_window}")
        if self.memory_budget is not None and self.memory_budget < 0:
            raise bad("memory_budget", f"must be >= 0, got {self.memory_budget}")
        if self.copy_rate is not None and self.copy_rate < (1 << 16):
            raise bad("copy_rate", f"must be >= 64KiB (bytes a second) or none, got {self.copy_rate}")
        if self.spill_max_bytes is not None and self.spill_max_bytes < (1 << 20):
            raise bad("spill_max_bytes", f"must be >= 1MiB, got {self.spill_max_bytes}")
        if self.keep_snapshots < 0:
            raise bad("keep_snapshots", f"must be >= 0 (0 keeps all), got {self.keep_snapshots}")
        if self.drain_grace_s < 0:
            raise bad("drain_grace_s", f"must be >= 0, got {self.drain_grace_s}")
        for name in ("scheduler", "server_id", "advertise", "tls_cert", "tls_key", "tls_ca", "auth_token_file",
                     "admin_token_file"):
            if getattr(self, name) is not None and not str(getattr(self, name)).strip():
                object.__setattr__(self, name, None)
        for name in ("heartbeat_interval_s", "replication_timeout_s", "ack_timeout_s", "lease_s"):
            if not getattr(self, name) > 0:
                raise bad(name, f"must be > 0, got {getattr(self, name)}")
        if self.snapshot_every_s < 0:
            raise bad("snapshot_every_s", f"must be >= 0 (0: off), got {self.snapshot_every_s}")
        if self.full_snapshot_every < 1:
            raise bad("full_snapshot_every", f"must be >= 1, got {self.full_snapshot_every}")
        if self.max_rows_per_request < 1 or self.max_concurrent_requests < 1:
            raise bad("max_rows_per_request", "and max_concurrent_requests must be >= 1")
        if self.max_streams < 0 or self.stream_window < 1:
            raise bad("max_streams", "must be >= 0 and stream_window >= 1")
        if self.scheduler is not None and self.slots.strip() not in ("", "all"):
            raise bad("slots", "must be 'all' with --scheduler: the shard map says which slots a server holds")
        try:
            parse_slots(self.slots, self.num_slots)
        except ValueError as exc:
            raise bad("slots", str(exc)) from None
        try:
            object.__setattr__(self, "domain", str(FailureDomain.parse(self.domain, field="server config: field "
                                                                       "'domain'")))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None

    def failure_domain(self, hostname: str | None = None) -> FailureDomain:
        """The server's failure domain: ``domain``, its host defaulting to ``hostname`` (the machine's name)."""
        return FailureDomain.parse(self.domain).with_host(hostname or socket.gethostname())

    def owned_slots(self) -> np.ndarray:
        """(num_slots,) bool mask of the slots this server leads (a static shard list: their only copy)."""
        return parse_slots(self.slots, self.num_slots)


_SIZES = ("memory_budget", "spill_max_bytes", "max_message_bytes", "copy_rate")


def _size(name: str) -> Callable[[Any, str], int | None]:
    def parse(value: Any, where: str) -> int | None:
        empty = value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "unlimited", "0"))
        if empty and name in ("memory_budget", "spill_max_bytes", "copy_rate"):
            return None
        return parse_bytes(value, field=f"{where}: field {name!r}")
    return parse


def _slots(value: Any, where: str) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)


def _domain(value: Any, where: str) -> str:
    """``zone=Z,rack=R,host=H`` text, or a mapping of those keys (a config file's ``domain: {zone: ...}``)."""
    if isinstance(value, Mapping):
        value = ",".join(f"{k}={v}" for k, v in value.items())
    try:
        return str(FailureDomain.parse("" if value is None else str(value), field=f"{where}: field 'domain'"))
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


PARSERS: dict[str, Callable[[Any, str], Any]] = {**{n: _size(n) for n in _SIZES},
                                                 "metrics_port": settings.parse_metrics_port,
                                                 "slots": _slots, "domain": _domain}
_STATEFULSET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?-[0-9]+$")


def statefulset_identity(values: dict[str, Any], sources: dict[str, str], env: Mapping[str, str] | None = None,
                         hostname: str | None = None) -> None:
    """A shard daemon in a Kubernetes StatefulSet (``KUBERNETES_SERVICE_HOST`` set, hostname ``NAME-ORDINAL``)
    with no ``server_id`` from any source, and a data dir that has none stored yet, takes its hostname as its
    id: the same pod ordinal is the same server across restarts and rescheduling."""
    env = os.environ if env is None else env
    if values.get("server_id") or "KUBERNETES_SERVICE_HOST" not in env:
        return
    data_dir = values.get("data_dir")
    if data_dir and (Path(data_dir) / "server-id").exists():
        return  # the stored id wins (checked against the rows it names)
    host = hostname or socket.gethostname()
    if _STATEFULSET_NAME.match(host):
        values["server_id"], sources["server_id"] = host, "StatefulSet hostname"


def load_server_config_sources(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                               file: str | os.PathLike | None = None) -> settings.Loaded[ServerConfig]:
    """``load_server_config`` with where each value came from."""
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    file = file or flags.pop("config", None) or env.get(settings.ENV_PREFIX + "CONFIG") or None
    flags.pop("config", None)
    return settings.load(ServerConfig, flags=flags, env=env, file=file, section="server", parsers=PARSERS,
                         derive=lambda v, s: statefulset_identity(v, s, env))


def load_server_config(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                       file: str | os.PathLike | None = None) -> ServerConfig:
    """Merge CLI ``flags`` (field name -> value; None means not given) > ``TIGANA_<FIELD>`` variables in ``env``
    (``os.environ`` when None) > ``file`` (or ``TIGANA_CONFIG``; a ``server:`` section when present) >
    defaults. Raises ``InvalidArgument`` naming the source and field of a bad value."""
    return load_server_config_sources(flags, env, file).config
