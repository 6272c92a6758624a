"""The scheduler's settings: ``SchedulerConfig`` (a frozen dataclass, checked when built) and
``load_scheduler_config``, which builds one at the edge from flags, ``TIGANA_*`` variables and a file."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tigana.ps import settings
from tigana.ps.errors import InvalidArgument
from tigana.ps.routing import DEFAULT_NUM_SLOTS
from tigana.ps.security import SecuritySettings


@dataclass(frozen=True)
class SchedulerConfig(SecuritySettings):
    """Settings of a scheduler. ``data_dir`` holds the persisted map (None: a temporary directory), unless
    ``store`` names another store: ``etcd://HOST:PORT[,HOST:PORT][/PREFIX]`` keeps it in etcd, where two or three
    schedulers elect a leader (an etcd lease of ``leader_ttl_s`` seconds) and the others stand by.

    replicas: copies per slot besides the primary. heartbeat_timeout_s: a server silent that long is dead
    (a probe that finds its port closed declares it dead sooner). expect_servers: the first placement waits
    for this many servers (or ``bootstrap_wait_s`` after the first one registered). auto_rebalance (the
    default): a server that holds nothing (it joined, or came back empty) gets its share of the slots, with
    no admin command. max_copies_per_step: slots that may start a copy in one placement step."""

    host: str = "127.0.0.1"
    port: int = 0
    data_dir: str | None = None
    replicas: int = 1
    num_slots: int = DEFAULT_NUM_SLOTS
    heartbeat_timeout_s: float = 3.0
    expect_servers: int = 1
    bootstrap_wait_s: float = 2.0
    auto_rebalance: bool = True
    max_workers: int = 256  # a connected client holds one in its long poll of the map
    max_copies_per_step: int | None = None
    probe_timeout_s: float = 0.5
    store: str | None = None
    leader_ttl_s: int = 2
    advertise: str | None = None  # host:port others reach this scheduler at (a standby names the leader by it)
    metrics_port: int = 0  # Prometheus /metrics: 0 off, -1 any free port (SchedulerHandle.metrics_port)
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise InvalidArgument(f"scheduler config: field 'replicas' must be >= 0, got {self.replicas}")
        if not self.heartbeat_timeout_s > 0:
            raise InvalidArgument("scheduler config: field 'heartbeat_timeout_s' must be > 0")
        if self.expect_servers < 1:
            raise InvalidArgument("scheduler config: field 'expect_servers' must be >= 1")
        if self.num_slots < 1:
            raise InvalidArgument("scheduler config: field 'num_slots' must be >= 1")
        if self.store is not None and not self.store.startswith("etcd://"):
            raise InvalidArgument(f"scheduler config: field 'store' must be etcd://HOST:PORT[,...], got {self.store!r}")
        if self.leader_ttl_s < 1:
            raise InvalidArgument("scheduler config: field 'leader_ttl_s' must be >= 1 (etcd leases count seconds)")
        if not -1 <= self.metrics_port <= 65535:
            raise InvalidArgument(f"scheduler config: field 'metrics_port' must be -1 (any free port), 0 (off) or a "
                                  f"port, got {self.metrics_port}")


def load_scheduler_config(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                          file: str | None = None) -> settings.Loaded[SchedulerConfig]:
    """The scheduler's settings (and where each came from): flags (field -> value, None: not given) >
    ``TIGANA_SCHEDULER_<FIELD>`` > ``TIGANA_<FIELD>`` > ``file`` (or ``TIGANA_SCHEDULER_CONFIG``; a
    ``scheduler:`` section when present) > defaults."""
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    file = file or flags.pop("config", None) or env.get("TIGANA_SCHEDULER_CONFIG") or None
    flags.pop("config", None)
    return settings.load(SchedulerConfig, flags=flags, env=env, file=file, section="scheduler",
                         env_prefixes=("TIGANA_SCHEDULER_", settings.ENV_PREFIX),
                         parsers={"metrics_port": settings.parse_metrics_port})
