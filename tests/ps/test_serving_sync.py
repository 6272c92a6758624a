"""Continuous sync to serving on real processes: the export log (``tigana admin export --follow``, in process and
as a CLI) against a real ``ps.LocalCluster``, ``tigana serve`` as a child process, and the standalone reader of
docs/serving.md in an interpreter that cannot import Tigana. Every process a test starts, it stops by its handle."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from tigana import ps
from tigana.embeddings.slab import TIME_TICKS
from tigana.proto import serving_pb2 as spb
from tigana.ps.errors import InvalidArgument
from tigana.ps.ops.local import stop_process
from tigana.ps.serving import ServingClient, load_serve_config
from tigana.ps.serving.exportlog import ExportFollower, read_log, read_manifest
from tigana.tools.bench.serving_sync import health_status, spawn_follow, spawn_serve, wait_serving

pytestmark = pytest.mark.timeout(180)

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ps.LocalCluster]:
    """A scheduler and 2 shard daemons, shared by this module's tests (each uses its own table)."""
    c = ps.LocalCluster(2, replicas=0, data_dir=tmp_path_factory.mktemp("serving-cluster"))
    try:
        yield c
    finally:
        c.close(timeout=30)


def _ledger_table(client: ps.Client, name: str, dim: int = 4) -> None:
    # SGD(lr=1) from zero rows with gradients of -1: a row's every element counts the pushes applied to it
    client.create_table(name, dim=dim, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())


def test_follow_writes_ordered_atomic_deltas_and_misses_no_acknowledged_push(cluster, tmp_path: Path) -> None:
    out = tmp_path / "log"
    with ps.connect(cluster.target) as client:
        _ledger_table(client, "ledger")
        client.push("ledger", np.arange(500), -np.ones((500, 4), np.float32)).result()
        ledger = np.zeros(2000, np.int64)
        ledger[:500] = 1
        lock, stop = threading.Lock(), threading.Event()
        problems: list[str] = []
        reads = [0]

        def push_loop() -> None:
            rng = np.random.default_rng(1)
            while not stop.is_set():
                ids = rng.choice(2000, 50, replace=False)
                client.push("ledger", ids, -np.ones((50, 4), np.float32)).result()
                with lock:  # acknowledged: counted
                    ledger[ids] += 1

        def read_loop() -> None:  # a reader racing the writer: every entry it is shown is whole
            while not stop.is_set():
                before = read_manifest(out)
                try:
                    m, ids, rows = read_log(out, verify=True)  # checksums of every file of every entry
                except FileNotFoundError:
                    after = read_manifest(out)
                    if before is not None and after["base"]["seq"] == before["base"]["seq"]:
                        problems.append(f"an entry named by the manifest is missing: {before}")
                    continue
                except Exception as exc:  # noqa: BLE001 - reported below
                    if before is not None:
                        problems.append(f"{type(exc).__name__}: {exc}")
                    continue
                entries = [m["base"], *m["deltas"]]
                seqs = [e["seq"] for e in entries]
                if seqs != sorted(set(seqs)) or m["seq"] != seqs[-1] or rows.shape != (ids.size, 4):
                    problems.append(f"entries out of order or torn: {seqs}, seq {m['seq']}, {rows.shape}")
                for prev, e in zip(entries, entries[1:], strict=False):
                    if e["since"] > prev["time"]:
                        problems.append(f"a gap between {prev['path']} (cut {prev['time']}) and {e['path']} "
                                        f"(since {e['since']})")
                reads[0] += 1

        threads = [threading.Thread(target=push_loop), threading.Thread(target=read_loop)]
        follower = ExportFollower(client, "ledger", out, interval_s=0.2, overlap_s=0.0, full_every=4)
        for t in threads:
            t.start()
        try:
            bases = set()
            for _ in range(14):
                with lock:
                    acked = ledger.copy()
                follower.step()
                m, ids, rows = read_log(out)
                bases.add(m["base"]["seq"])
                held = np.zeros(2000, np.int64)
                held[ids] = rows[:, 0].astype(np.int64)
                missing = np.flatnonzero(held < acked)
                assert missing.size == 0, f"acknowledged pushes missing from the log after {m['seq']}: {missing[:10]}"
                time.sleep(0.1)
        finally:
            stop.set()
            for t in threads:
                t.join()
        client.flush()
        # A row's time is rounded up to the next 1/128 s (``slab.TIME_TICKS``), so a delta may repeat rows written
        # within a tick before its ``since`` (never miss one). The exact count the restarted follower's first delta
        # is checked for below needs this cut a tick past the last push (it failed once when the cut came <8 ms
        # after it: 24 repeated rows).
        time.sleep(2 / TIME_TICKS)
        follower.step()
        m, ids, rows = read_log(out)
        np.testing.assert_array_equal(ids, np.flatnonzero(ledger))
        np.testing.assert_array_equal(rows, np.repeat(ledger[ids, None], 4, axis=1).astype(np.float32))
        np.testing.assert_array_equal(rows, client.pull("ledger", ids, insert=False))
        assert len(bases) >= 3  # compactions happened: a new full export every 4 deltas
        names = sorted(p.name for p in out.iterdir())
        assert not [n for n in names if ".tmp-" in n]  # no temp folder left behind
        kept = [n for n in names if re.match(r"(full|delta)-\d{8}$", n)]
        assert len(kept) <= 2 * (4 + 1)  # entries older than the previous base were pruned
        assert all(int(n[-8:]) >= min(bases - {max(bases)}) for n in kept)

        # one follower per log; a restarted one resumes it, after removing what a crash could leave behind
        with pytest.raises(ps.InvalidArgument, match="another follower"):
            ExportFollower(client, "ledger", out)
        follower.close()
        seq = m["seq"]
        (out / f".delta-{seq + 1:08d}.tmp-1").mkdir()  # a crash mid-entry
        (out / f"delta-{seq + 1:08d}").mkdir()  # a crash between an entry's rename and the manifest
        with ExportFollower(client, "ledger", out, overlap_s=0.0) as again:
            assert not (out / f"delta-{seq + 1:08d}").exists() and not (out / f".delta-{seq + 1:08d}.tmp-1").exists()
            client.push("ledger", np.array([3]), -np.ones((1, 4), np.float32)).result()
            entry = again.step()
            assert entry["seq"] == seq + 1 and entry["rows"] == 1 and entry["since"] == m["time"]
            ledger[3] += 1
            m, ids, rows = read_log(out)
            np.testing.assert_array_equal(rows[:, 0], ledger[ids])
    assert not problems, problems[:5]
    assert reads[0] > 5


# ---------------------------------------------------------------------------------------------------------------


def _guide_reader() -> str:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    return next(b for b in blocks if "def read_export_log" in b)


DRIVER = """
import sys
try:
    import tigana  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("tigana is importable here")
ids, rows, manifest = read_export_log(sys.argv[1])
out, found = lookup(ids, rows, np.load(sys.argv[2]))
np.savez(sys.argv[3], ids=ids, rows=rows, out=out, found=found, seq=manifest["seq"])
"""


def _raw_lookup(address: str, payload: bytes) -> grpc.RpcError | bytes:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/tigana.v1.Serving/Lookup")
        try:
            return call(payload, timeout=5)
        except grpc.RpcError as err:
            return err


def test_export_follow_and_serve_cli_end_to_end(cluster, tmp_path: Path) -> None:
    out = tmp_path / "log"
    procs: list[subprocess.Popen] = []
    try:
        with ps.connect(cluster.target) as client:
            client.create_table("emb", dim=8, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
            held = np.arange(-300, 700, dtype=np.int64)
            rng = np.random.default_rng(2)
            client.push("emb", held, rng.normal(size=(held.size, 8)).astype(np.float32)).result()

            # the server starts before the log exists: health NOT_SERVING, lookups UNAVAILABLE
            serve, address = spawn_serve(out, tmp_path / "serve.log", poll=0.05, extra=["--max-ids", "5000"])
            procs.append(serve)
            assert health_status(address) == health_pb2.HealthCheckResponse.NOT_SERVING
            with ServingClient(address) as serving, pytest.raises(ps.Unavailable):
                serving.lookup(held[:3])
            follow = spawn_follow(cluster.scheduler, "emb", out, tmp_path / "follow.log", interval=0.3,
                                  extra=["--full-every", "5"])
            procs.append(follow)
            wait_serving(address, timeout=60)

            with ServingClient(address) as serving:
                rows, found = serving.lookup(held)
                assert found.all()
                np.testing.assert_array_equal(rows, client.pull("emb", held, insert=False))
                unknown = np.array([10**12, -(2**63), 2**63 - 1, 701], np.int64)
                rows, found = serving.lookup(unknown)
                assert not found.any() and (rows == 0).all()  # --default zeros

                # a push becomes visible within a bounded time (interval + export + poll, with slack)
                client.push("emb", np.array([5, 9000]), np.ones((2, 8), np.float32)).result()
                want = client.pull("emb", np.array([5, 9000]), insert=False)
                acked, deadline = time.monotonic(), time.monotonic() + 5.0
                while True:
                    rows, found = serving.lookup(np.array([5, 9000]))
                    if found.all() and np.array_equal(rows, want):
                        break
                    assert time.monotonic() < deadline, "a push did not reach tigana serve within 5 s"
                    time.sleep(0.01)
                assert time.monotonic() - acked < 5.0

                # bad input: INVALID_ARGUMENT naming the field, and the server lives on
                for payload, field in ((b"\xff\x01\x02garbage", "malformed"),
                                       (spb.ServingLookupRequest(ids=b"1234567").SerializeToString(), "'ids'"),
                                       (spb.ServingLookupRequest(ids=np.zeros(5001, np.int64).tobytes())
                                        .SerializeToString(), "'ids'"),
                                       (spb.ServingLookupRequest(ids=held[:2].tobytes(), table="other")
                                        .SerializeToString(), "'table'")):
                    err = _raw_lookup(address, payload)
                    assert isinstance(err, grpc.RpcError), f"{field}: answered"
                    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details(), err.details()
                rows, found = serving.lookup(held[:10], table="emb")
                assert found.all() and serve.poll() is None
                assert health_status(address) == health_pb2.HealthCheckResponse.SERVING

                # the follower stops cleanly on SIGTERM; the server catches up with the last entry
                stop_process(follow)
                assert follow.returncode == 0, (tmp_path / "follow.log").read_text()[-2000:]
                m = read_manifest(out)
                deadline = time.monotonic() + 10
                while serving.info().seq < m["seq"] or serving.info().data_time < m["time"]:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                info = serving.info()
                assert info.table == "emb" and info.dim == 8 and info.rows == held.size + 1

                # docs/serving.md's standalone reader, in an interpreter that cannot import tigana: the same rows
                query = np.concatenate([held, [9000, 123456789]]).astype(np.int64)
                np.save(tmp_path / "query.npy", query)
                script = "import sys\nsys.modules['tigana'] = None\n" + _guide_reader() + DRIVER
                subprocess.run([sys.executable, "-I", "-c", script, str(out), str(tmp_path / "query.npy"),
                                str(tmp_path / "read.npz")], check=True, timeout=60, capture_output=True)
                got = np.load(tmp_path / "read.npz")
                assert int(got["seq"]) == m["seq"]
                rows, found = serving.lookup(query)
                np.testing.assert_array_equal(got["found"], found)
                np.testing.assert_array_equal(got["out"], rows)
                rows, found = serving.lookup(got["ids"])
                assert found.all()
                np.testing.assert_array_equal(got["rows"], rows)

            stop_process(serve)  # SIGTERM: a clean exit
            assert serve.returncode == 0, (tmp_path / "serve.log").read_text()[-2000:]
    finally:
        for proc in procs:
            stop_process(proc)


def test_serve_state_is_always_one_whole_log_entry(cluster, tmp_path: Path, monkeypatch) -> None:
    """``tigana serve``'s follower against the reference reader after every entry, with folds and compactions;
    a concurrent reader only ever sees the table as of some whole entry; the default-row policies."""
    from tigana.ps.serving import tables as serving

    monkeypatch.setattr(serving, "_FOLD_MIN_ROWS", 40)  # fold often: the base is rebuilt under the reader
    out = tmp_path / "log"
    with ps.connect(cluster.target) as client:
        _ledger_table(client, "state", dim=3)
        client.push("state", np.arange(300), -np.ones((300, 3), np.float32)).result()
        follower = ExportFollower(client, "state", out, interval_s=0.1, overlap_s=0.0, full_every=3)
        follower.step()
        reader = serving.LogFollower(out, "mean")
        assert reader.poll() and reader.state.size == 300
        np.testing.assert_allclose(reader.state.default_row, np.ones(3))  # the mean row
        expected: dict[int, np.ndarray] = {}
        query = np.arange(-5, 700, dtype=np.int64)

        def reference() -> None:
            m, ids, rows = read_log(out)
            want, _ = serving.TableState.build("state", ids, rows, 0.0, seq=0, base_seq=0, log_id="",
                                               data_time=0.0).lookup(query)
            found = np.isin(query, ids)
            expected[m["seq"]] = np.where(found[:, None], want, np.nan)

        reference()
        stop, seen, bad = threading.Event(), [0], []

        def look() -> None:
            while not stop.is_set():
                state = reader.state  # what a Lookup reads: one attribute, once
                rows, found = state.lookup(query)
                want = expected.get(state.seq)
                if want is None:
                    continue
                if not np.array_equal(np.where(found[:, None], rows, np.nan), want, equal_nan=True):
                    bad.append(state.seq)
                seen[0] += 1

        thread = threading.Thread(target=look)
        thread.start()
        try:
            rng = np.random.default_rng(5)
            for _ in range(10):
                ids = np.unique(rng.integers(0, 700, 60))
                client.push("state", ids, -np.ones((ids.size, 3), np.float32)).result()
                follower.step()
                reference()  # recorded before the follower may show it
                assert reader.poll()
                rows, found = reader.state.lookup(query)
                np.testing.assert_array_equal(np.where(found[:, None], rows, np.nan), expected[reader.state.seq])
                time.sleep(0.05)
        finally:
            stop.set()
            thread.join()
        assert not bad and seen[0] > 10
        assert reader.deltas_applied >= 5 and reader.state.base_seq > 1  # compactions were reloaded
        assert not reader.poll()  # nothing new: no swap
        # the other default policies
        assert serving.default_policy("zeros") == ps.Unseen(0.0) and serving.default_policy("2.5") == ps.Unseen(2.5)
        assert serving.default_policy("initial") == ps.Unseen(None) and serving.default_policy("mean") == "mean"
        for bad in ("median", "nan", "inf", ""):
            with pytest.raises(ps.InvalidArgument, match="--unseen"):
                serving.default_policy(bad)
        const = serving.LogFollower(out, 2.5)
        const.poll()
        rows, found = const.state.lookup(np.array([10**15], np.int64))
        assert not found[0] and (rows == 2.5).all()


def test_serve_with_tls_tokens_and_metrics(cluster, pki, tmp_path: Path) -> None:
    """``tigana serve`` with mutual TLS, token files and ``--metrics-port auto``: a trainer's or an admin's token
    looks up; no token, a wrong one, no client certificate or plaintext are refused and counted; the metrics
    show the lookups, the ids found and missed, and the table and log position served."""
    import json
    import urllib.request

    from tigana.ps.security import NONE, Security

    trainer_token, admin_token = (Path(pki[k]).read_text().strip() for k in ("trainer", "admin"))
    out = tmp_path / "log"
    with ps.connect(cluster.target) as client:
        _ledger_table(client, "secure")
        client.push("secure", np.arange(50), -np.ones((50, 4), np.float32)).result()
        ExportFollower(client, "secure", out, interval_s=0.1, overlap_s=0.0).step()
    flags = ["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"], "--require-client-cert",
             "--auth-token-file", pki["trainer"], "--admin-token-file", pki["admin"], "--metrics-port", "auto"]
    log_path = tmp_path / "serve.log"
    serve, address = spawn_serve(out, log_path, extra=flags)

    def who(token: str | None = trainer_token, cert: bool = True) -> Security:
        return Security(tls_cert=pki["ccert"] if cert else None, tls_key=pki["ckey"] if cert else None,
                        tls_ca=pki["ca"], token=token)

    try:
        metrics_port = json.loads(log_path.with_suffix(".ready.json").read_text())["metrics_port"]
        assert metrics_port
        query = np.array([1, 2, 10**9], np.int64)
        with ServingClient(address, security=who()) as serving:
            deadline = time.monotonic() + 30
            while True:
                try:
                    rows, found = serving.lookup(query)
                    break
                except ps.Unavailable:  # the first full export is still loading
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            assert found.tolist() == [True, True, False] and (rows[:2] == 1).all() and (rows[2] == 0).all()
        with ServingClient(address, security=who(admin_token)) as serving:
            assert serving.lookup(query)[1].sum() == 2
        for security, error in ((who(None), ps.Unauthenticated), (who("not-a-token"), ps.Unauthenticated),
                                (who(cert=False), ps.Unavailable), (NONE, ps.Unavailable)):
            with ServingClient(address, security=security, timeout_s=5) as serving, pytest.raises(error):
                serving.lookup(query)
        assert serve.poll() is None
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        metrics = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line and not line.startswith("#")}
        assert metrics['tigana_serving_lookups_total{code="OK"}'] == 2
        assert metrics['tigana_serving_ids_total{found="true"}'] == 4
        assert metrics['tigana_serving_ids_total{found="false"}'] == 2
        assert metrics['tigana_auth_rejected_total{method="Lookup",reason="missing"}'] == 1
        assert metrics['tigana_auth_rejected_total{method="Lookup",reason="invalid"}'] == 1
        assert metrics["tigana_serving_ready"] == 1 and metrics["tigana_serving_rows"] == 50
        assert metrics["tigana_serving_seq"] >= 1 and metrics["tigana_serving_data_age_seconds"] >= 0
        assert metrics["tigana_serving_lookup_seconds_count"] == 2
        for token in (trainer_token, admin_token):
            assert token not in log_path.read_text()
    finally:
        stop_process(serve)
    assert serve.returncode == 0, log_path.read_text()[-2000:]


def test_serve_settings_flags_over_tigana_variables_over_defaults() -> None:
    env = {"TIGANA_METRICS_PORT": "auto", "TIGANA_ALLOW_INSECURE_LOOPBACK": "yes", "TIGANA_AUTH_TOKEN_FILE": "/t",
           "TIGANA_PORT": "7000", "TIGANA_MAX_IDS": "5"}  # a shard server's own settings: not serve's
    config = load_serve_config({"source": "log", "auth_token_file": "/flag", "metrics_host": None}, env)
    assert (config.metrics_port, config.allow_insecure_loopback, config.auth_token_file) == (-1, True, "/flag")
    assert (config.port, config.max_ids, config.metrics_host) == (0, 1_000_000, "127.0.0.1")
    with pytest.raises(InvalidArgument, match="metrics_port"):
        load_serve_config({"source": "log", "metrics_port": "eighty"}, {})


def test_deltas_carry_tombstones_so_evicted_rows_leave_serving(cluster, tmp_path: Path) -> None:
    """Rows the cap evicts between two entries are in the next delta's deleted.npy: the reference reader and
    ``tigana serve``'s follower forget them, and the log's table equals a fresh full export's."""
    from tigana.ps.serving import tables as serving

    out = tmp_path / "log"
    with ps.connect(cluster.target) as client:
        client.create_table("evicting", dim=2, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros(),
                            eviction=ps.Eviction(max_rows=40))  # per shard
        client.push("evicting", np.arange(60), -np.ones((60, 2), np.float32)).result()
        with ExportFollower(client, "evicting", out, interval_s=0.1, overlap_s=0.0) as follower:
            follower.step()
            reader = serving.LogFollower(out, "zeros")
            assert reader.poll() and reader.state.size == 60
            time.sleep(0.02)  # past the 1/128 s a row's time is rounded to
            client.push("evicting", np.arange(100, 160), -np.ones((60, 2), np.float32)).result()
            entry = follower.step()
            assert entry["rows"] > 0 and entry["deleted"] > 0  # new rows, and the old ones the cap evicted
            full = tmp_path / "full"
            client.export("evicting", str(full))
            want_ids = np.load(full / "ids.npy")
            m, ids, rows = read_log(out)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(rows, np.load(full / "rows.npy"))
            assert reader.poll()
            _, found = reader.state.lookup(np.arange(200))
            np.testing.assert_array_equal(np.flatnonzero(found), want_ids)
            assert reader.state.size == want_ids.size


def test_a_table_dropped_and_recreated_or_restored_reaches_serving_as_a_full_export(cluster, tmp_path: Path) -> None:
    """The new table's servers know no removals from before it existed, so the follower's next delta would be
    incomplete: it writes a full export instead, and serving forgets every row of the old table (no operator
    step, no new log). The same for a checkpoint restored over the table."""
    from tigana.ps.serving import tables as serving

    out = tmp_path / "log"
    with ps.connect(cluster.target) as client:
        client.create_table("again", dim=2, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        client.push("again", np.arange(100), -np.ones((100, 2), np.float32)).result()
        ckpt = tmp_path / "ckpt"
        client.checkpoint(str(ckpt), ["again"])
        with ExportFollower(client, "again", out, interval_s=0.1, overlap_s=0.0) as follower:
            follower.step()
            reader = serving.LogFollower(out, "zeros")
            assert reader.poll() and reader.state.size == 100
            client.drop_table("again")
            client.create_table("again", dim=2, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
            client.push("again", np.arange(200, 230), -2 * np.ones((30, 2), np.float32)).result()
            entry = follower.step()
            assert entry["path"].startswith("full-") and entry["rows"] == 30
            assert reader.poll()
            _, found = reader.state.lookup(np.arange(300))
            np.testing.assert_array_equal(np.flatnonzero(found), np.arange(200, 230))
            # restored over it: the checkpoint's 100 rows, and none of the 30
            client.restore_checkpoint(str(ckpt))
            entry = follower.step()
            assert entry["path"].startswith("full-") and entry["rows"] == 100
            assert reader.poll()
            rows, found = reader.state.lookup(np.arange(300))
            np.testing.assert_array_equal(np.flatnonzero(found), np.arange(100))
            np.testing.assert_array_equal(rows[:100], np.ones((100, 2), np.float32))
