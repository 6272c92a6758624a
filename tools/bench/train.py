"""``tigana bench train``: DeepFM training samples/s with its tables on the parameter server vs in-process.

Workload: synthetic Criteo-format data (13 dense, 26 sparse features with Zipf-distributed ids; vocabularies
the Kaggle set's capped at ``--vocab``), DeepFM with dim-16 embeddings and a (256, 128) MLP, batches made up
front so data generation is not timed. Every model trains with Adam on its dense layers and Adagrad on its
rows (server-side for the PS, ``torch.optim.Adagrad`` on sparse gradients locally).

Cases, one JSON line each (samples/s, the best of the rounds; the trainers take turns in every round):

- ``train_ps``          1 trainer + 2 shard daemons, prefetch + staleness 1, the 26 tables fused into one PS
                        table (ids salted per table): one pull and one push per shard a step (the default of
                        ``tigana train``)
- ``train_ps_unfused``  the same with 26 separate PS tables: 26 pulls and 26 pushes a step
  each against ``local nn.EmbeddingBag``: the same model on ``LocalEmbeddingCollection`` in this process
  (sparse gradients), measured in the same run;
- ``train_ps_vs_torchrec``: ``train_ps`` against TorchRec's ``EmbeddingBagCollection`` trained locally
  (only when torchrec is importable; it is never a dependency).

Each line also gives the CPU it cost: ``cpu_us_per_sample`` and ``peer_cpu_us_per_sample`` (median over rounds) count
every process, this one and the shard daemons, since the PS case uses the daemons' cores, which the in-process
peers never get. Each line also says what the run did, measured rather than assumed: ``samples_per_round`` (every trainer trains
every batch once a round), ``round_seconds`` (the best round's), and for the PS cases the client's pulls and
pushes per step (``pulls_per_step``, ``pushes_per_step``: 1 fused, one per table unfused), the PS tables the
collection used (``ps_tables``) and the rows they hold at the end (``ps_rows``: every id the batches touched).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

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
    parser.add_argument("--shards", type=int, default=2, help="shard daemons of the PS cases (default 2)")


class _Trainer:
    """One DeepFM and its optimizers; ``epoch()`` trains on every batch once and returns the samples."""

    def __init__(self, embeddings: nn.Module, batches: list[Batch], sparse_params: list[nn.Parameter] = (),
                 collection: PSEmbeddingBags | None = None) -> None:
        torch.manual_seed(0)
        self.model = build_model("deepfm", embeddings, 13)
        self.batches, self.collection = batches, collection
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

    env = dict(os.environ, TIGANA_SNAPSHOT_ON_SHUTDOWN="0", **ALLOCATOR_ENV)
    with ps.LocalCluster(args.shards, replicas=None, env=env) as cluster:
        client = ps.connect(cluster.addresses)
        try:
            local_coll = LocalEmbeddingCollection(features, DIM, cards, sparse_grad=True, seed=0)
            trainers = {"local": _Trainer(local_coll, batches, list(local_coll.parameters()))}
            for case, fused in (("train_ps", "bench_train_fused"), ("train_ps_unfused", None)):
                specs = [FeatureSpec(f.name, table=f"bench_train_{f.name}", pooling=f.pooling) for f in features]
                coll = PSEmbeddingBags(client, specs, DIM, fused_table=fused,
                                       options=TableOptions(optimizer=ps.Adagrad(lr=0.05), staleness=1))
                trainers[case] = _Trainer(coll, batches, collection=coll)
            peer = _torchrec_collection(features, cards, batches)
            if peer is not None:
                trainers["torchrec"] = _Trainer(peer, batches)
            rates, samples, calls, cpu = _interleaved(trainers, repeats, client, [p.pid for p in cluster.procs])
            ps_figures = {}
            for case in ("train_ps", "train_ps_unfused"):
                coll = trainers[case].collection
                per_step = {k: v / (steps * (repeats + 1)) for k, v in calls[case].items()}
                ps_figures[case] = dict(pulls_per_step=per_step["pulls"], pushes_per_step=per_step["pushes"],
                                        ps_tables=len(coll.ps_tables),
                                        ps_rows=sum(client.describe_table(t).rows for t in coll.ps_tables))
        finally:
            client.close()
    best = {name: max(v) for name, v in rates.items()}
    median = {name: statistics.median(v) for name, v in rates.items()}

    def line(case: str, ours: str, peer: str, peer_name: str, fused: bool) -> None:
        emit(case, "samples/s", best[ours], peer_name, best[peer], fused_tables=fused, **params,
             value_median=round(median[ours], 1), peer_value_median=round(median[peer], 1),
             ratio_median=round(median[ours] / median[peer], 4), samples_per_round=samples[ours],
             cpu_us_per_sample=round(statistics.median(cpu[ours]), 1),
             peer_cpu_us_per_sample=round(statistics.median(cpu[peer]), 1),
             round_seconds=round(samples[ours] / best[ours], 4), **ps_figures[ours])

    for case, fused in (("train_ps", True), ("train_ps_unfused", False)):
        line(case, case, "local", "local nn.EmbeddingBag", fused)
    if "torchrec" in rates:
        line("train_ps_vs_torchrec", "train_ps", "torchrec", "torchrec EmbeddingBagCollection", True)
    return 0


def _interleaved(trainers: dict[str, _Trainer], repeats: int, client: ps.Client, daemons: list[int]
                 ) -> tuple[dict[str, list[float]], dict[str, int], dict[str, dict[str, int]], dict[str, list[float]]]:
    """(samples/s of each trainer in each of ``repeats`` rounds, its samples per round, the pulls and pushes
    ``client`` made while it trained, warm-up included, and the CPU microseconds per sample of each round over
    every process: this one and the shard ``daemons``, whose CPU only the PS cases use, so in-process peers are
    not flattered by the cores they leave idle). The trainers take turns in every round (one untimed
    warm-up round first), so the client's counters move for one trainer at a time. The lines report the best
    round: on a shared machine other processes only ever slow a round down. The medians come along
    (``value_median``, ``ratio_median``), since the best of a few noisy rounds favours whichever case spreads
    more."""
    timings: dict[str, list[float]] = {name: [] for name in trainers}
    cpu: dict[str, list[float]] = {name: [] for name in trainers}
    samples: dict[str, int] = {}
    calls = {name: {"pulls": 0, "pushes": 0} for name in trainers}
    for round_ in range(repeats + 1):
        for name, trainer in trainers.items():
            before = client.stats()
            cpu0 = _self_cpu_s() + sum(process_cpu_s(pid) for pid in daemons)
            t0 = time.perf_counter()
            n = trainer.epoch()
            elapsed = time.perf_counter() - t0
            cpu_s = _self_cpu_s() + sum(process_cpu_s(pid) for pid in daemons) - cpu0
            after = client.stats()
            for k in calls[name]:
                calls[name][k] += after[k] - before[k]
            if samples.setdefault(name, n) != n:
                raise RuntimeError(f"bench train: {name} trained {n} samples in a round, {samples[name]} before")
            if round_:
                timings[name].append(n / elapsed)
                cpu[name].append(cpu_s / n * 1e6)
        if round_:
            log("  round " + str(round_) + ": " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in timings.items()))
    return timings, samples, calls, cpu


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))
