"""The process groups a trainer talks over (``init_distributed``): the default world group, one group per node
(every rank belongs to its node's group), the group of node leaders (local rank 0 of every node), and a second
node group reserved for sparse gradient aggregation so its collectives never interleave with the dense
all-reduce's. Where this process sits among its peers (``DistEnv``, ``read_env``) is ``tigana.trainer.launcher_env``.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tigana.trainer.elastic import restart_count
from tigana.trainer.launcher_env import DistEnv, free_port, read_env

__all__ = ["DistEnv", "Groups", "collective_device", "default_backend", "device_for_backend", "free_port",
           "init_distributed", "read_env", "shutdown"]

log = logging.getLogger(__name__)


@dataclass
class Groups:
    """The process groups of an initialized job. ``leaders`` is None on ranks that are not node leaders.

    Thread-safety: collectives on one group must be issued in the same order on every member.
    """

    env: DistEnv
    node: dist.ProcessGroup | None
    leaders: dist.ProcessGroup | None
    sparse_node: dist.ProcessGroup | None

    @property
    def hierarchical(self) -> bool:
        """True when there is more than one node and more than one rank per node (else flat is the same)."""
        return self.env.num_nodes > 1 and self.env.local_world_size > 1


def default_backend() -> str:
    """NCCL when CUDA is present, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for_backend(backend: str) -> torch.device:
    """Where a tensor handed to a collective of a group on ``backend`` must live: the CUDA device this process
    set (``init_distributed`` selects it) for an NCCL-only group, which has no transport for CPU tensors, the
    CPU for every other backend (gloo, MPI, or a mixed ``"cpu:gloo,cuda:nccl"`` one)."""
    return torch.device("cuda") if str(backend).lower() == "nccl" else torch.device("cpu")


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """``device_for_backend`` of ``group`` (default: the world group). Small control collectives (step flags,
    timings, sparse aggregation) build their tensors here, so that they run on NCCL, our default with CUDA."""
    return device_for_backend(dist.get_backend(group))


def init_distributed(env: DistEnv, backend: str | None = None, timeout_s: float = 300.0) -> Groups:
    """Join the job (``env.world_size`` processes rendezvous at MASTER_ADDR:MASTER_PORT over TCP) and build
    the node, leader and sparse-aggregation groups. Every rank must call it. A one-process job still gets a
    (trivial) process group so the rest of the trainer needs no special case."""
    backend = backend or default_backend()
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=timeout_s)
        # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE) and keeps it across restarts: every
        # generation of workers gets its own key prefix, or a new one reads its predecessors' addresses.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"

        def rendezvous() -> None:
            store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                                  is_master=env.rank == 0 and not agent_store, timeout=timeout)
            store = dist.PrefixStore(f"tigana/generation-{restart_count()}", store)
            dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size,
                                    timeout=timeout)

        if env.world_size > 1:
            log.info("rank %d waiting for the job's %d ranks at %s:%d (at most %.0f s; Ctrl-C stops)", env.rank,
                     env.world_size, env.master_addr, env.master_port, timeout_s)
        _interruptible(rendezvous, "tigana-rendezvous")
    node = leaders = sparse = None
    # new_group must be called by every rank for every group, in the same order.
    for node_index in range(env.num_nodes):
        ranks = list(range(node_index * env.local_world_size, (node_index + 1) * env.local_world_size))
        group = dist.new_group(ranks)
        if node_index == env.node_rank:
            node = group
    for node_index in range(env.num_nodes):
        ranks = list(range(node_index * env.local_world_size, (node_index + 1) * env.local_world_size))
        group = dist.new_group(ranks)
        if node_index == env.node_rank:
            sparse = group
    group = dist.new_group(env.leader_ranks)
    if env.is_leader:
        leaders = group
    return Groups(env=env, node=node, leaders=leaders, sparse_node=sparse)


def _interruptible(fn: Callable[[], None], name: str) -> None:
    """Run ``fn`` in a helper thread while this one waits, so that Ctrl-C (KeyboardInterrupt, raised here)
    ends a wait on peers that torch's C++ rendezvous would otherwise hold for its whole timeout (it releases the
    GIL but never returns to Python to see the signal). ``fn``'s exception is raised here."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the waiting thread
            errors.append(exc)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if errors:
        raise errors[0]


def shutdown() -> None:
    """Leave the job (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
