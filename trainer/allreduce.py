"""Dense gradient synchronization: a hierarchical all-reduce as a DDP communication hook.

    node 0: r0 r1 ──reduce──> r0 ─┐
                                  ├─ all-reduce among leaders ─> r0 ──broadcast──> r0 r1
    node 1: r2 r3 ──reduce──> r2 ─┘                              r2 ──broadcast──> r2 r3

Only the leaders' all-reduce crosses node boundaries, so inter-node traffic scales with the number of nodes,
not ranks. The flat fallback is DDP's own all-reduce; fp16/bf16 compression wraps either with DDP's hooks.

The hook runs its three collectives synchronously (one bucket at a time): issuing them from future callbacks
could interleave two buckets' collectives differently on different ranks.
"""

from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from tigana.trainer.distributed import Groups

Mode = Literal["hierarchical", "flat"]
Compression = Literal["none", "fp16", "bf16"]
MODES = ("hierarchical", "flat")
COMPRESSIONS = ("none", "fp16", "bf16")


def hierarchical_all_reduce(tensor: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Sum ``tensor`` over every rank, in place: reduce to the node leader, all-reduce among leaders,
    broadcast back within the node. Every rank must call it with a tensor of the same shape and dtype."""
    env = groups.env
    leader = env.node_ranks[0]
    if env.local_world_size > 1:
        dist.reduce(tensor, dst=leader, group=groups.node)
    if env.is_leader and env.num_nodes > 1:
        dist.all_reduce(tensor, group=groups.leaders)
    if env.local_world_size > 1:
        dist.broadcast(tensor, src=leader, group=groups.node)
    return tensor


def flat_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over every rank with one all-reduce on the world group, in place."""
    dist.all_reduce(tensor)
    return tensor


def hierarchical_hook(state: Groups, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket over all ranks with ``hierarchical_all_reduce``."""
    tensor = bucket.buffer()
    tensor.div_(state.env.world_size)
    hierarchical_all_reduce(tensor, state)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def register_hook(model: DistributedDataParallel, groups: Groups, mode: Mode = "hierarchical",
                  compression: Compression = "none") -> str:
    """Install the dense all-reduce on a DDP model; returns a name for what was installed.

    ``hierarchical`` falls back to flat when it would change nothing (one node, or one rank per node).
    """
    if mode not in MODES:
        raise ValueError(f"allreduce mode {mode!r} is not one of {MODES}")
    if compression not in COMPRESSIONS:
        raise ValueError(f"allreduce compression {compression!r} is not one of {COMPRESSIONS}")
    if compression == "bf16" and dist.get_backend() != "nccl":
        raise ValueError("allreduce compression 'bf16' needs the NCCL backend (DDP's bf16 hook); "
                         "use 'fp16' with gloo")
    if mode == "hierarchical" and groups.hierarchical:
        if compression == "fp16":
            model.register_comm_hook(groups, default_hooks.fp16_compress_wrapper(hierarchical_hook))
        elif compression == "bf16":
            model.register_comm_hook(groups, default_hooks.bf16_compress_wrapper(hierarchical_hook))
        else:
            model.register_comm_hook(groups, hierarchical_hook)
        name = "hierarchical"
    else:
        if compression == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif compression == "bf16":
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        name = "flat"
    return name if compression == "none" else f"{name}+{compression}"


def cross_node_bytes(nbytes: int, num_nodes: int, ranks_per_node: int, mode: Mode) -> int:
    """Bytes that cross node boundaries to all-reduce ``nbytes`` once, under the ring model.

    A ring all-reduce over ``k`` members sends ``2(k-1)/k * nbytes`` on each of its ``k`` links. Flat: the
    world ring (ranks in order, nodes contiguous) has ``num_nodes`` links that leave a node. Hierarchical: only
    the leaders' ring (``num_nodes`` members, every link between nodes) crosses; node-local reduce and broadcast
    stay inside.
    """
    if num_nodes <= 1:
        return 0
    world = num_nodes * ranks_per_node
    k = world if mode == "flat" else num_nodes
    return int(round(num_nodes * 2 * (k - 1) / k * nbytes))
