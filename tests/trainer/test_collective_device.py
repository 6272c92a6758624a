"""The trainer's small control collectives (the per-step flags, the closing timings, hierarchical sparse
aggregation) build their tensors on the device the group's backend can carry: an NCCL-only group (our default
when CUDA is present) has no transport for CPU tensors, so a CPU tensor there kills the job at its first step.

There is no GPU in CI, so the rule is asserted on its own (``device_for_backend``), the three call sites are
checked to hand the collective exactly the tensor placement the rule picks (a stand-in collective that, like
NCCL, refuses CPU tensors), and real gloo ranks check that the collectives still compute the right thing."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tigana.trainer import loop
from tigana.trainer.distributed import collective_device, device_for_backend, free_port, shutdown
from tigana.trainer.embedding import aggregate


def test_nccl_collectives_go_to_the_cuda_device_and_every_other_backend_to_the_cpu() -> None:
    assert device_for_backend("nccl") == torch.device("cuda")
    assert device_for_backend(dist.Backend.NCCL) == torch.device("cuda")
    assert device_for_backend("gloo") == torch.device("cpu")
    assert device_for_backend("mpi") == torch.device("cpu")
    assert device_for_backend("cpu:gloo,cuda:nccl") == torch.device("cpu")  # a mixed group carries CPU tensors


class _Sent(Exception):
    """Raised by the stand-in collective once it has seen its tensor."""


@pytest.fixture
def nccl_like(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Make the call sites believe their group is NCCL-only, whose device here is ``meta`` (there is no CUDA in
    CI). The stand-in collectives record the device of every tensor handed to them and, like NCCL, fail on a
    CPU tensor; otherwise they stop the call (a meta tensor holds no values to read back)."""
    seen: list[torch.device] = []
    meta = torch.device("meta")
    for module in (loop, aggregate):
        monkeypatch.setattr(module, "collective_device", lambda group=None: meta, raising=False)

    def collective(*args: object, **kwargs: object) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
        seen.extend(t.device for t in tensors)
        if any(t.device.type == "cpu" for t in tensors):
            raise RuntimeError("No backend type associated with device type cpu")
        raise _Sent

    for name in ("all_reduce", "all_gather", "gather"):
        monkeypatch.setattr(dist, name, collective)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    return seen


@pytest.mark.parametrize("call", ["step_flags", "max_time", "aggregate"])
def test_each_control_collective_hands_nccl_a_tensor_on_its_device(nccl_like: list[torch.device],
                                                                   call: str) -> None:
    with pytest.raises(_Sent):
        if call == "step_flags":
            loop._step_flags(True, 2)
        elif call == "max_time":
            loop._max_time(10, 1.5, 2)
        else:
            ids = [torch.tensor([3, 5], dtype=torch.int64), torch.tensor([7], dtype=torch.int64)]
            aggregate._aggregate(ids, [torch.ones(2, 4), torch.ones(1, 4)], object(), 4)
    assert nccl_like and all(d == torch.device("meta") for d in nccl_like), nccl_like


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        assert collective_device() == torch.device("cpu")
        samples, slowest = loop._max_time(100 * (rank + 1), 1.0 + rank, world)
        assert (samples, slowest) == (300.0, 2.0)
        # rank 0 sends ids 1, 2 and rank 1 sends 2, 3 for one table: the leader holds their sums
        ids = [torch.tensor([1 + rank, 2 + rank], dtype=torch.int64)]
        grads = [torch.full((2, 3), float(rank + 1))]
        out_ids, out_grads = aggregate._aggregate(ids, grads, dist.group.WORLD, 3)
        if rank == 0:
            got = dict(zip(out_ids[0].tolist(), out_grads[0][:, 0].tolist(), strict=True))
            assert got == {1: 1.0, 2: 3.0, 3: 2.0}
            assert out_grads[0].device == torch.device("cpu")
        else:
            assert out_ids[0].numel() == 0
    finally:
        shutdown()


@pytest.mark.timeout(120)
def test_control_collectives_compute_the_same_on_real_gloo_ranks() -> None:
    mp.spawn(_worker, args=(2, free_port()), nprocs=2, join=True)
