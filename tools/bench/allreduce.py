"""``tigana bench allreduce``: hierarchical vs flat all-reduce of DeepFM's dense gradients, 4 ranks as 2 x 2.

Four gloo ranks on this machine, arranged as 2 simulated nodes of 2 ranks. The payload is DeepFM's dense
gradients (26 sparse features of dim 16, 13 dense, MLP (256, 128)) cut into DDP's 25 MiB buckets. Cases:

- ``allreduce_time``: milliseconds to average every bucket once, hierarchical (reduce in the node, all-reduce
  among leaders, broadcast in the node) vs flat (one world all-reduce); median over the repeats.
- ``allreduce_cross_node_bytes``: bytes that cross node boundaries per all-reduce under the ring model
  (``tigana.trainer.allreduce.cross_node_bytes``): loopback has no real node boundary to count on.
- ``allreduce_fp16_time``: the hierarchical all-reduce with fp16 compression (DDP's wrapper) vs flat fp32.

On one machine every "node" shares the same memory bus, so the time case shows the overhead of the extra steps
rather than the inter-node saving; the bytes case is what a real 2-node job saves on its network.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tigana.tools.bench.report import emit, log
from tigana.trainer.allreduce import cross_node_bytes, flat_all_reduce, hierarchical_all_reduce
from tigana.trainer.distributed import free_port, init_distributed, read_env, shutdown

BUCKET_BYTES = 25 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed all-reduces per case (default 30, quick 8)")


def deepfm_gradient_sizes() -> list[int]:
    """Element counts of DeepFM's dense parameters (what DDP all-reduces), for the Criteo shape."""
    from tigana.trainer.local import LocalEmbeddingCollection
    from tigana.trainer.models import build_model
    from tigana.trainer.types import FeatureSpec

    features = [FeatureSpec(f"C{i + 1}") for i in range(26)]
    model = build_model("deepfm", LocalEmbeddingCollection(features, 16, 4), 13)
    return [p.numel() for p in model.dense_parameters()]


def _buckets(sizes: list[int]) -> list[int]:
    out, current = [], 0
    for n in reversed(sizes):  # DDP fills buckets in reverse parameter order
        if current and (current + n) * 4 > BUCKET_BYTES:
            out.append(current)
            current = 0
        current += n
    return out + ([current] if current else [])


def _worker(rank: int, world: int, port: int, buckets: list[int], repeats: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    groups = init_distributed(read_env(ranks_per_node=2), backend="gloo")
    try:
        tensors = [torch.randn(n, generator=torch.Generator().manual_seed(rank)) for n in buckets]

        def hier(dtype: torch.dtype) -> None:
            for t in tensors:
                x = t.to(dtype).div_(world)
                hierarchical_all_reduce(x, groups)
                t.copy_(x)

        def flat() -> None:
            for t in tensors:
                flat_all_reduce(t.div_(world))

        cases = {"hierarchical": lambda: hier(torch.float32), "flat": flat,
                 "hierarchical_fp16": lambda: hier(torch.float16)}
        times: dict[str, list[float]] = {k: [] for k in cases}
        for i in range(repeats + 2):
            for name, fn in cases.items():  # take turns, so a slow spell hits every case
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                if i >= 2:
                    times[name].append(time.perf_counter() - t0)
        if rank == 0:
            Path(out).write_text(json.dumps({k: statistics.median(v) * 1000 for k, v in times.items()}))
    finally:
        shutdown()


def run(args: argparse.Namespace) -> int:
    repeats = args.repeats or (8 if args.quick else 30)
    sizes = deepfm_gradient_sizes()
    buckets = _buckets(sizes)
    nbytes = 4 * sum(sizes)
    params = dict(model="deepfm", ranks=4, nodes=2, ranks_per_node=2, backend="gloo", gradient_bytes=nbytes,
                  buckets=len(buckets), repeats=repeats)
    log(f"bench allreduce: {sum(sizes):,} gradient elements in {len(buckets)} bucket(s), 4 gloo ranks as 2 x 2")
    with tempfile.TemporaryDirectory(prefix="tigana-bench-allreduce-") as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_worker, args=(4, free_port(), buckets, repeats, out), nprocs=4, join=True,
                           start_method="spawn")
        ms = json.loads(Path(out).read_text())
    emit("allreduce_time", "ms", ms["hierarchical"], "flat all-reduce", ms["flat"], **params)
    emit("allreduce_cross_node_bytes", "bytes", cross_node_bytes(nbytes, 2, 2, "hierarchical"), "flat all-reduce",
         cross_node_bytes(nbytes, 2, 2, "flat"), model_of_bytes="ring", **params)
    emit("allreduce_fp16_time", "ms", ms["hierarchical_fp16"], "flat all-reduce (fp32)", ms["flat"], **params)
    emit("allreduce_fp16_cross_node_bytes", "bytes", cross_node_bytes(nbytes // 2, 2, 2, "hierarchical"),
         "flat all-reduce (fp32)", cross_node_bytes(nbytes, 2, 2, "flat"), model_of_bytes="ring", **params)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
