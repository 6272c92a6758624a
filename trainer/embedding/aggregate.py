"""Hierarchical sparse aggregation: the ranks of one node gather their (ids, grads) at the node leader,
which sums the rows of equal ids and pushes once for the node."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F

from tigana.trainer.distributed import collective_device
from tigana.trainer.embedding.plan import _group


def _aggregate(ids: list[torch.Tensor], grads: list[torch.Tensor], group: dist.ProcessGroup,
               dim: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gather every node rank's (ids, grads) per table at the node leader and sum rows of equal ids there.

    Returns the merged ids and grads on the leader (group rank 0) and empty ones elsewhere, on the CPU. Every
    rank of the group must call it with the same number of tables. What crosses the group is on the device its
    backend carries (``collective_device``: CUDA for NCCL).
    """
    members = dist.get_world_size(group)
    leader = dist.get_global_rank(group, 0)
    me = dist.get_rank(group)
    device = collective_device(group)
    counts = torch.tensor([t.numel() for t in ids], dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(members)]
    dist.all_gather(all_counts, counts, group=group)
    all_counts = [c.cpu() for c in all_counts]
    totals = [int(c.sum()) for c in all_counts]
    width = max(totals)
    empty_ids = [ids[0].new_empty(0) for _ in ids]
    empty_grads = [grads[0].new_empty(0, dim) for _ in grads]
    if width == 0:
        return (ids, grads) if me == 0 else (empty_ids, empty_grads)
    flat_ids = torch.zeros(width, dtype=torch.int64, device=device)
    flat_grads = torch.zeros(width, dim, dtype=torch.float32, device=device)
    n = totals[me]
    flat_ids[:n] = torch.cat(ids)
    flat_grads[:n] = torch.cat(grads)
    if me == 0:
        id_list = [torch.empty_like(flat_ids) for _ in range(members)]
        grad_list = [torch.empty_like(flat_grads) for _ in range(members)]
    else:
        id_list = grad_list = None
    dist.gather(flat_ids, id_list, dst=leader, group=group)
    dist.gather(flat_grads, grad_list, dst=leader, group=group)
    if me != 0:
        return empty_ids, empty_grads
    id_list, grad_list = [t.cpu() for t in id_list], [t.cpu() for t in grad_list]
    per_rank_ids = [torch.split(id_list[r][:totals[r]], all_counts[r].tolist()) for r in range(members)]
    per_rank_grads = [torch.split(grad_list[r][:totals[r]], all_counts[r].tolist()) for r in range(members)]
    out_ids, out_grads = [], []
    for t in range(len(ids)):
        t_ids = torch.cat([per_rank_ids[r][t] for r in range(members)])
        t_grads = torch.cat([per_rank_grads[r][t] for r in range(members)])
        if t_ids.numel() == 0:
            out_ids.append(t_ids)
            out_grads.append(t_grads)
            continue
        uniq, _, order, starts = _group(t_ids.numpy())
        summed = F.embedding_bag(torch.from_numpy(order), t_grads.contiguous(), torch.from_numpy(starts), mode="sum")
        out_ids.append(torch.from_numpy(uniq))
        out_grads.append(summed)
    return out_ids, out_grads
