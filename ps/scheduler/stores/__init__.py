"""Where the scheduler keeps its state (the shard map and the placement it moves toward).

- ``file``: the ``MapStore`` interface, the state's encoding, and ``FileMapStore`` (the scheduler's data dir);
- ``etcd``: ``EtcdMapStore``, etcd with the scheduler's leader lease fencing every write (imported only when a
  config names it).
"""

from tigana.ps.scheduler.stores.file import FileMapStore, MapStore, SchedulerState

__all__ = ["FileMapStore", "MapStore", "SchedulerState"]
