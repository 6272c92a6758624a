"""``tigana bench train``: DeepFM training samples/s with its tables on the parameter server vs in-process.

Workload: synthetic Criteo-format data (13 dense, 26 sparse features with Zipf-distributed ids; vocabularies
the Kaggle set's capped at ``--vocab``), DeepFM with dim-16 embeddings and a (256, 128) MLP, batches made up
front so data generation is not timed. Every model trains with Adam on its dense layers and Adagrad on its
rows (server-side for the PS, ``torch.optim.Adagrad`` on sparse gradients locally).

Two clusters run side by side: the headline one as ``tigana train`` starts it (README: a scheduler, ``--shards``
daemons, ``--replicas`` copies of every slot, default 1, tables of the cluster's default durability, sync; or
``--durability``), and ``--shards`` static daemons with no scheduler and no replica.

Cases, one JSON line each (samples/s, the best of the rounds; the trainers take turns in every round), the
headline first:

- ``train_ps_vs_torchrec``   the headline: 1 trainer on the README's cluster, prefetch + staleness 1, the 26
                             tables fused into one PS table (ids salted per table; one pull and one push per
                             shard a step, the default of ``tigana train``), against TorchRec's
                             ``EmbeddingBagCollection`` trained in this process (only when torchrec is
                             importable; it is never a dependency). Its peer takes TorchRec's idiomatic path.
- ``train_ps_static_vs_torchrec``  the same trainer on the static cluster (no scheduler, no replica) against
                             TorchRec.
- ``train_ps_vs_static``     the README's cluster against the static one: what the scheduler, the replica and
                             its durability cost a trainer.
- ``train_ps_unfused``       26 separate PS tables on the README's cluster (26 tables a pull and a push) against
                             the fused run.
- ``train_ps``               the README's cluster against ``local nn.EmbeddingBag``: the same model on
                             ``LocalEmbeddingCollection`` in this process (sparse gradients).

Each line gives the CPU it cost, median over rounds: ``cpu_us_per_sample`` counts every process (this one, the
daemons and the scheduler of the case's cluster), since a PS case uses the daemons' cores, which in-process
peers never get; ``trainer_cpu_us_per_sample`` counts this process alone, what a trainer's host pays when the
servers run elsewhere (``peer_cpu_us_per_sample``, ``peer_trainer_cpu_us_per_sample``: the peer's). Each line
also says what the run did, measured rather than assumed: ``samples_per_round`` (every trainer trains every
batch once a round), ``round_seconds`` (the best round's), and for a PS case the client's pulls and pushes per
step (``pulls_per_step``, ``pushes_per_step``: 1 fused, one per table unfused), the PS tables the collection used
(``ps_tables``), the rows they hold at the end (``ps_rows``: every id the batches touched), and its cluster
(``replicas``: copies besides the primary, None for the static one; ``scheduler``; ``durability``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tigana import ps
from tigana.ps.allocator import ALLOCATOR_ENV, tune_allocator
from tigana.tools.bench.report import emit, log
from tigana.tools.bench.scale.resources import _self_cpu_s, process_cpu_s
from tigana.trainer.data import SyntheticCriteo
from tigana.trainer.data.synthetic import CRITEO_KAGGLE_CARDINALITIES
from tigana.trainer.embedding import PSEmbeddingBags, TableOptions
from tigana.trainer.local import LocalEmbeddingCollection
from tigana.trainer.models import build_model
from tigana.trainer.types import Batch, FeatureSpec

DIM = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (about a minute)")
    parser.add_argument("--batch-size", type=int, default=2048, help="samples per step (default 2048)")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed round (default 30, quick 10)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per case (default 9, quick 5)")
    parser.add_argument("--vocab", type=int, default=100_000, help="cap on each feature's vocabulary")
    parser.add_argument("--shards", type=int, default=2, help="shard daemons of each cluster (default 2)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="copies of every slot besides its primary on the headline cluster, placed by its "
                             "scheduler (default 1, as tigana train starts it; 0: none)")
    parser.add_argument("--durability", choices=("sync", "async"), default=None,
                        help="the headline cluster's PS tables (default: the cluster's, sync where slots have a "
                             "copy)")


@dataclass(frozen=True)
class _Cluster:
    """A cluster the PS cases train on: its client, the pids of its processes (daemons and scheduler, whose CPU
    a case on it counts) and what it is (``replicas`` None: static daemons, no scheduler)."""

    client: ps.Client
    pids: list[int]
    replicas: int | None
    durability: str | None

    @property
    def figures(self) -> dict[str, Any]:
        return dict(replicas=self.replicas, scheduler=self.replicas is not None, durability=self.durability)


class _Trainer:
    """One DeepFM and its optimizers; ``epoch()`` trains on every batch once and returns the samples."""

    def __init__(self, embeddings: nn.Module, batches: list[Batch], sparse_params: list[nn.Parameter] = (),
                 collection: PSEmbeddingBags | None = None, cluster: _Cluster | None = None) -> None:
        torch.manual_seed(0)
        self.model = build_model("deepfm", embeddings, 13)
        self.batches, self.collection, self.cluster = batches, collection, cluster
        self.dense_opt = torch.optim.Adam(self.model.dense_parameters(), lr=1e-3)
        self.sparse_opt = torch.optim.Adagrad(list(sparse_params), lr=0.05) if sparse_params else None

    def epoch(self) -> int:
        n = 0
        for i, batch in enumerate(self.batches):
            if self.collection is not None and i + 1 < len(self.batches):
                self.collection.prefetch(self.batches[i + 1].sparse)
            loss = F.binary_cross_entropy_with_logits(self.model(batch.dense, batch.sparse), batch.labels)
            self.dense_opt.zero_grad(set_to_none=True)
            if self.sparse_opt is not None:
                self.sparse_opt.zero_grad(set_to_none=True)
            loss.backward()
            self.dense_opt.step()
            if self.sparse_opt is not None:
                self.sparse_opt.step()
            n += len(batch)
        if self.collection is not None:
            self.collection.flush()  # every push applied: the samples are done
        return n


def _torchrec_collection(features: list[FeatureSpec], cards: dict[str, int], batches: list[Batch]
                         ) -> nn.Module | None:
    """TorchRec's fused EmbeddingBagCollection as an EmbeddingCollection, or None when torchrec is absent.

    TorchRec's idiomatic path: each batch's ``KeyedJaggedTensor`` is made once, with its ids already bounded by
    each table's size, as a data pipeline hands them over (untimed, like our batches); a step is the EBC's
    forward and ``KeyedTensor.values().view(B, F, D)``, no per-step copy."""
    try:
        import torchrec  # noqa: F401
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except Exception as exc:  # noqa: BLE001 - any import failure means "no peer"
        log(f"torchrec peer skipped: {type(exc).__name__}: {exc}")
        return None
    names = [f.name for f in features]
    configs = [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=cards[n], feature_names=[n])
               for n in names]
    ebc = FusedEmbeddingBagCollection(tables=configs, optimizer_type=torch.optim.Adagrad,
                                      optimizer_kwargs={"lr": 0.05}, device=torch.device("cpu"))
    sizes = torch.tensor([cards[n] for n in names])
    kjts = {}
    for batch in batches:
        sparse = batch.sparse
        per_feature = sparse.lengths.view(len(names), sparse.batch_size).sum(1)
        values = torch.remainder(sparse.values, sizes.repeat_interleave(per_feature))
        kjts[id(sparse)] = KeyedJaggedTensor(keys=names, values=values, lengths=sparse.lengths)

    class _TorchRec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc, self.feature_names, self.dim = ebc, names, DIM

        def forward(self, sparse) -> torch.Tensor:
            return self.ebc(kjts[id(sparse)]).values().view(sparse.batch_size, len(names), DIM)

    return _TorchRec()


def run(args: argparse.Namespace) -> int:
    tune_allocator(top_pad=64 << 20)
    steps = args.steps or (10 if args.quick else 30)
    repeats = args.repeats or (5 if args.quick else 9)
    bs = args.batch_size
    vocab = tuple(min(v, args.vocab) for v in CRITEO_KAGGLE_CARDINALITIES)
    gen = SyntheticCriteo(vocab_sizes=vocab, seed=0)
    log(f"bench train: making {steps} batches of {bs} synthetic Criteo rows")
    batches = list(gen.batches(bs, bs * steps))
    features = gen.feature_specs()
    cards = {f.name: v for f, v in zip(features, vocab, strict=True)}
    params = dict(model="deepfm", batch_size=bs, steps=steps, repeats=repeats, dim=DIM, sparse_features=26,
                  shards=args.shards, trainers=1, staleness=1, prefetch=True, threads=torch.get_num_threads(),
                  vocab_cap=args.vocab, statistic=f"best of {repeats} rounds")
    durability = args.durability or ("sync" if args.replicas else None)

    env = dict(os.environ, TIGANA_SNAPSHOT_ON_SHUTDOWN="0", **ALLOCATOR_ENV)
    with contextlib.ExitStack() as stack:
        readme = stack.enter_context(ps.LocalCluster(args.shards, replicas=args.replicas, env=env))
        static = stack.enter_context(ps.LocalCluster(args.shards, replicas=None, env=env))
        clusters = {
            "readme": _Cluster(stack.enter_context(ps.connect(readme.target)),
                               [p.pid for p in readme.procs + readme.scheduler_procs], args.replicas, durability),
            "static": _Cluster(stack.enter_context(ps.connect(static.addresses)), [p.pid for p in static.procs],
                               None, None)}
        local_coll = LocalEmbeddingCollection(features, DIM, cards, sparse_grad=True, seed=0)
        trainers = {"local": _Trainer(local_coll, batches, list(local_coll.parameters()))}
        for case, where, fused in (("train_ps", "readme", "bench_train_fused"), ("train_ps_unfused", "readme", None),
                                   ("train_ps_static", "static", "bench_train_fused")):
            cluster = clusters[where]
            specs = [FeatureSpec(f.name, table=f"bench_train_{f.name}", pooling=f.pooling) for f in features]
            coll = PSEmbeddingBags(cluster.client, specs, DIM, fused_table=fused,
                                   options=TableOptions(optimizer=ps.Adagrad(lr=0.05), staleness=1,
                                                        durability=cluster.durability))
            trainers[case] = _Trainer(coll, batches, collection=coll, cluster=cluster)
        peer = _torchrec_collection(features, cards, batches)
        if peer is not None:
            trainers["torchrec"] = _Trainer(peer, batches)
        rates, samples, calls, cpu = _interleaved(trainers, repeats)
        ps_figures = {}
        for case, trainer in trainers.items():
            if trainer.collection is None:
                continue
            coll, client = trainer.collection, trainer.cluster.client
            per_step = {k: v / (steps * (repeats + 1)) for k, v in calls[case].items()}
            ps_figures[case] = dict(pulls_per_step=per_step["pulls"], pushes_per_step=per_step["pushes"],
                                    ps_tables=len(coll.ps_tables),
                                    ps_rows=sum(client.describe_table(t).rows for t in coll.ps_tables),
                                    **trainer.cluster.figures)
    best = {name: max(v) for name, v in rates.items()}
    median = {name: statistics.median(v) for name, v in rates.items()}

    def line(case: str, ours: str, peer: str, peer_name: str, fused: bool) -> None:
        emit(case, "samples/s", best[ours], peer_name, best[peer], fused_tables=fused, **params,
             value_median=round(median[ours], 1), peer_value_median=round(median[peer], 1),
             ratio_median=round(median[ours] / median[peer], 4), samples_per_round=samples[ours],
             cpu_us_per_sample=round(statistics.median(cpu[ours]["all"]), 1),
             trainer_cpu_us_per_sample=round(statistics.median(cpu[ours]["trainer"]), 1),
             peer_cpu_us_per_sample=round(statistics.median(cpu[peer]["all"]), 1),
             peer_trainer_cpu_us_per_sample=round(statistics.median(cpu[peer]["trainer"]), 1),
             round_seconds=round(samples[ours] / best[ours], 4), **ps_figures[ours])

    readme_name = f"tigana PS, {args.shards} static shards, no scheduler, no replica"
    if "torchrec" in rates:
        line("train_ps_vs_torchrec", "train_ps", "torchrec", "torchrec EmbeddingBagCollection", True)
        line("train_ps_static_vs_torchrec", "train_ps_static", "torchrec", "torchrec EmbeddingBagCollection", True)
    line("train_ps_vs_static", "train_ps", "train_ps_static", readme_name, True)
    line("train_ps_unfused", "train_ps_unfused", "train_ps", "the fused PS run", False)
    line("train_ps", "train_ps", "local", "local nn.EmbeddingBag", True)
    return 0


def _interleaved(trainers: dict[str, _Trainer], repeats: int
                 ) -> tuple[dict[str, list[float]], dict[str, int], dict[str, dict[str, int]],
                            dict[str, dict[str, list[float]]]]:
    """(samples/s of each trainer in each of ``repeats`` rounds, its samples per round, the pulls and pushes its
    cluster's client made while it trained, warm-up included, and the CPU microseconds per sample of each round:
    ``all`` over every process, this one and the processes of the trainer's cluster, whose CPU only the PS
    cases use, so in-process peers are not flattered by the cores they leave idle; ``trainer`` this process
    alone). The trainers take turns in every round (one untimed warm-up round first), so a client's counters
    move for one trainer at a time. The lines report the best round: on a shared machine other processes only
    ever slow a round down. The medians come along (``value_median``, ``ratio_median``), since the best of a
    few noisy rounds favours whichever case spreads more."""
    timings: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, dict[str, list[float]]] = {name: {"all": [], "trainer": []} for name in trainers}
    samples: dict[str, int] = {}
    calls = {name: {"pulls": 0, "pushes": 0} for name in trainers}
    for round_ in range(repeats + 1):
        for name, trainer in trainers.items():
            cluster = trainer.cluster
            pids = cluster.pids if cluster is not None else []
            before = cluster.client.stats() if cluster is not None else None
            own0, others0 = _self_cpu_s(), sum(process_cpu_s(pid) for pid in pids)
            t0 = time.perf_counter()
            n = trainer.epoch()
            elapsed = time.perf_counter() - t0
            own = _self_cpu_s() - own0
            others = sum(process_cpu_s(pid) for pid in pids) - others0
            if cluster is not None:
                after = cluster.client.stats()
                for k in calls[name]:
                    calls[name][k] += after[k] - before[k]
            if samples.setdefault(name, n) != n:
                raise RuntimeError(f"bench train: {name} trained {n} samples in a round, {samples[name]} before")
            if round_:
                timings[name].append(n / elapsed)
                cpu[name]["all"].append((own + others) / n * 1e6)
                cpu[name]["trainer"].append(own / n * 1e6)
        if round_:
            log("  round " + str(round_) + ": " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in timings.items()))
    return timings, samples, calls, cpu


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
