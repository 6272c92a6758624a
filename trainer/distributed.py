"""Where this trainer sits among its peers, and the process groups the trainer talks over.

Ranks and node membership come from the launcher's environment, so the same code runs under torchrun,
srun (SLURM) and Kubeflow's PyTorchJob:

    torchrun / Kubeflow : RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT
    SLURM (srun)        : SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE, SLURM_NODEID

``ranks_per_node`` (``--ranks-per-node``) overrides node membership to simulate several nodes on one
machine: ranks ``[k*n, (k+1)*n)`` form node ``k``. Nodes are contiguous rank ranges, as every launcher assigns them.

Process groups (``init_distributed``): the default world group, one group per node (every rank belongs to its
node's group), the group of node leaders (local rank 0 of every node), and a second node group reserved for
sparse gradient aggregation so its collectives never interleave with the dense all-reduce's.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tigana.trainer.elastic import restart_count

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job. ``node_rank`` is the node's index; ranks of a node are contiguous."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def is_leader(self) -> bool:
        """Local rank 0: the rank that speaks for its node."""
        return self.local_rank == 0

    @property
    def node_ranks(self) -> list[int]:
        """Global ranks of this node, leader first."""
        start = self.node_rank * self.local_world_size
        return list(range(start, start + self.local_world_size))

    @property
    def leader_ranks(self) -> list[int]:
        """Global rank of every node's leader."""
        return list(range(0, self.world_size, self.local_world_size))


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            try:
                return int(str(value).split("(")[0].split(",")[0])  # SLURM writes e.g. "2(x3)"
            except ValueError as exc:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from exc
    return None


def read_env(ranks_per_node: int | None = None, environ: Mapping[str, str] | None = None) -> DistEnv:
    """The DistEnv described by the launcher's variables (torchrun first, then SLURM; a single process without).

    Raises ValueError naming the variable when the values are inconsistent (e.g. a world size that is not a
    multiple of the ranks per node).
    """
    env = os.environ if environ is None else environ
    rank = _int(env, "RANK", "SLURM_PROCID")
    world = _int(env, "WORLD_SIZE", "SLURM_NTASKS")
    rank = 0 if rank is None else rank
    world = 1 if world is None else world
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    local_world = _int(env, "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")
    if ranks_per_node is not None:
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1")
        local_world = ranks_per_node
    if local_world is None:
        local_world = world
    if world % local_world:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of the ranks per node ({local_world})")
    if ranks_per_node is not None:
        local_rank, node_rank = rank % local_world, rank // local_world
    else:
        local_rank = _int(env, "LOCAL_RANK", "SLURM_LOCALID")
        node_rank = _int(env, "GROUP_RANK", "SLURM_NODEID")
        local_rank = rank % local_world if local_rank is None else local_rank
        node_rank = rank // local_world if node_rank is None else node_rank
        if node_rank * local_world + local_rank != rank:
            raise ValueError(f"RANK={rank} is not GROUP_RANK*LOCAL_WORLD_SIZE+LOCAL_RANK "
                             f"({node_rank}*{local_world}+{local_rank}); nodes must hold contiguous ranks")
    addr = env.get("MASTER_ADDR") or _slurm_master(env) or "127.0.0.1"
    port = _int(env, "MASTER_PORT")
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                   node_rank=node_rank, master_addr=addr, master_port=29500 if port is None else port)


def _slurm_master(env: Mapping[str, str]) -> str | None:
    """First host of SLURM_JOB_NODELIST for the simple forms ("host", "host1,host2", "pre[1-4,7]")."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    first = nodelist.split(",")[0]
    if "[" in nodelist:
        prefix, rest = nodelist.split("[", 1)
        first = prefix + rest.split("]")[0].split(",")[0].split("-")[0]
    return first


def free_port() -> int:
    """A TCP port free on loopback right now (for MASTER_PORT of a local job)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
