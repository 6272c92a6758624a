"""Where this trainer sits among its peers: its rank, node and master address, read from the launcher's environment.

The same code runs under torchrun, srun (SLURM) and Kubeflow's PyTorchJob:

    torchrun / Kubeflow : RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT
    SLURM (srun)        : SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE, SLURM_NODEID

``ranks_per_node`` (``--ranks-per-node``) overrides node membership to simulate several nodes on one
machine: ranks ``[k*n, (k+1)*n)`` form node ``k``. Nodes are contiguous rank ranges, as every launcher assigns them.

No torch here: ``tigana train --nproc N`` reads these in a launcher that never imports torch (its trainer
processes do).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from tigana.ps.ops.local import free_port  # the port of a local job's rendezvous (MASTER_PORT)

__all__ = ["DistEnv", "free_port", "read_env"]


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
