"""TorchRec's DLRM training loop on Criteo-format data, its ``EmbeddingBagCollection`` swapped for the PS drop-in.

    dense (B, 13) ──DenseArch──┐
    26 categorical features ───┴─> PSEmbeddingBagCollection (rows on the shard servers) ─> InteractionArch
        ─> OverArch ─> logit;  DLRMTrain: BCE loss.  Dense layers: torch's Adagrad;  tables: the servers' Adagrad

The one-module swap (everything else is TorchRec's own example loop)::

    - ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    + ebc = PSEmbeddingBagCollection(client, tables, options=TableOptions(optimizer=ps.Adagrad(lr=...)))

Run it::

    python examples/torchrec_dlrm.py --steps 50                       # seeded synthetic rows in the Criteo format
    python examples/torchrec_dlrm.py --data train.txt --steps 200     # a Criteo DAC/Kaggle text file
    python examples/torchrec_dlrm.py --scheduler host:7100 ...        # a running cluster (default: a local one)
    python examples/torchrec_dlrm.py --servers h1:7101,h2:7101 ...    # or its shard servers (a static cluster)
    python examples/torchrec_dlrm.py --local ...                      # TorchRec's own EmbeddingBagCollection

A Criteo text row is ``label \\t I1..I13 \\t C1..C26``: integer counts and hexadecimal category hashes, any
field may be empty. The dense features enter as log(1 + max(x, 0)); each category is ``int(hex) %
num_embeddings`` (the hashing TorchRec's Criteo pipeline uses). The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torchrec import EmbeddingBagCollection
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tigana import ps
from tigana.trainer import PSEmbeddingBagCollection, TableOptions


def synthetic_criteo(path: Path, rows: int, seed: int = 0) -> Path:
    """Write ``rows`` seeded rows in the Criteo text format (a few empty fields, a click rate near 25%)."""
    rng = np.random.default_rng(seed)
    ints = rng.poisson(3.0, size=(rows, len(DEFAULT_INT_NAMES))).astype(str)
    cats = np.char.mod("%08x", rng.zipf(1.3, size=(rows, len(DEFAULT_CAT_NAMES))) % 100_000)
    labels = (rng.random(rows) < 0.25).astype(int).astype(str)
    table = np.concatenate([labels[:, None], ints, cats], axis=1)
    table[rng.random(table.shape) < 0.05] = ""
    table[:, 0] = labels
    path.write_text("".join("\t".join(r) + "\n" for r in table))
    return path


def read_criteo(path: Path, num_embeddings: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels (N,) float32, dense (N, 13) float32, categories (N, 26) int64) of a Criteo text file."""
    fields = np.array([line.rstrip("\n").split("\t") for line in path.open()], dtype=object)
    fields[fields == ""] = "0"
    labels = fields[:, 0].astype(np.float32)
    dense = np.log1p(np.maximum(fields[:, 1:14].astype(np.float64), 0)).astype(np.float32)
    return labels, dense, (hex_ids(fields[:, 14:40].astype("S16")) % np.uint64(num_embeddings)).astype(np.int64)


def hex_ids(text: np.ndarray) -> np.ndarray:
    """Hexadecimal strings (bytes, up to 16 digits, any shape) -> their uint64 values, without a Python loop: each digit's value from a table, weighted by 16 ** its place from the right."""
    width = text.dtype.itemsize
    chars = text.reshape(-1).view(np.uint8).reshape(-1, width)  # NUL-padded on the right
    digit = np.zeros(256, np.uint64)
    digit[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint64)
    digit[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16, dtype=np.uint64)
    used = chars != 0
    place = used.sum(1, keepdims=True) - 1 - np.arange(width)  # 16 ** place for each used digit
    values = (digit[chars] << (np.uint64(4) * np.clip(place, 0, None).astype(np.uint64))) * used
    return values.sum(1, dtype=np.uint64).reshape(text.shape)


def batches(labels: np.ndarray, dense: np.ndarray, cats: np.ndarray, batch_size: int) -> Iterator[Batch]:
    """TorchRec ``Batch``es, one id per categorical feature and sample (the KJT is feature-major)."""
    for lo in range(0, labels.shape[0] - batch_size + 1, batch_size):
        ids = cats[lo:lo + batch_size]  # (B, 26)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(DEFAULT_CAT_NAMES),
                                                  values=torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1)),
                                                  lengths=torch.ones(ids.size, dtype=torch.int64))
        yield Batch(dense_features=torch.from_numpy(dense[lo:lo + batch_size]), sparse_features=kjt,
                    labels=torch.from_numpy(labels[lo:lo + batch_size]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, help="a Criteo text file (default: synthetic rows)")
    parser.add_argument("--rows", type=int, default=4096, help="synthetic rows to write without --data")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--num-embeddings", type=int, default=100_000)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--scheduler", help="a running cluster's scheduler (default: start a local cluster)")
    parser.add_argument("--servers", help="or its shard servers, host:port,host:port (a static cluster)")
    parser.add_argument("--local", action="store_true", help="TorchRec's own EmbeddingBagCollection instead")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or synthetic_criteo(Path(tmp) / "train.txt", args.rows)
        labels, dense, cats = read_criteo(data, args.num_embeddings)
        cluster = None if args.local or args.scheduler or args.servers else \
            ps.LocalCluster(shards=2, replicas=None, data_dir=Path(tmp) / "ps")
        client = None
        try:
            tables = [EmbeddingBagConfig(name=f"t_{name}", embedding_dim=args.dim, num_embeddings=args.num_embeddings,
                                         feature_names=[name]) for name in DEFAULT_CAT_NAMES]
            if args.local:
                ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
            else:
                client = ps.connect(scheduler=args.scheduler) if args.scheduler else \
                    ps.connect(args.servers or cluster.addresses)
                ebc = PSEmbeddingBagCollection(client, tables, table_prefix="dlrm_",
                                               options=TableOptions(optimizer=ps.Adagrad(lr=args.lr)))
            model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=len(DEFAULT_INT_NAMES),
                                   dense_arch_layer_sizes=[64, args.dim], over_arch_layer_sizes=[64, 1]))
            optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)  # dense only, unless --local
            losses: list[float] = []
            while len(losses) < args.steps:
                for batch in batches(labels, dense, cats, args.batch_size):
                    loss, _ = model(batch)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    losses.append(float(loss.detach()))
                    if len(losses) == args.steps:
                        break
            quarter = max(1, len(losses) // 4)
            summary = {"steps": len(losses), "embeddings": "torchrec" if args.local else "ps",
                       "loss_first": float(np.mean(losses[:quarter])), "loss_last": float(np.mean(losses[-quarter:])),
                       "rows": None if client is None else sum(client.describe_table(f"dlrm_{t.name}").rows
                                                               for t in tables)}
            print(json.dumps(summary))
        finally:
            if client is not None:
                client.close()
            if cluster is not None:
                cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
