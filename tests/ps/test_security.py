"""TLS, mutual TLS, tokens and roles on a real cluster (a scheduler and shard daemons as processes), with
certificates made at test time (trustme). Refused callers change nothing; tokens never reach a log."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from tigana import ps
from tigana.proto import scheduler_pb2 as spb
from tigana.proto import scheduler_pb2_grpc as spb_grpc
from tigana.ps.ops import admin
from tigana.ps.security import Security, read_token, read_tokens
from tigana.ps.shard.config import ServerConfig
from tigana.ps.shard.daemon import start_server

pytest.importorskip("trustme")
pytestmark = pytest.mark.timeout(240)

TRAINER, ADMIN = "trainer-token-3f9a", "admin-token-77c1"  # what the pki fixture (conftest) writes


@pytest.fixture(scope="module")
def cluster(pki, tmp_path_factory):
    flags = ["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"], "--require-client-cert",
             "--auth-token-file", pki["trainer"], "--admin-token-file", pki["admin"]]
    me = Security(tls_cert=pki["ccert"], tls_key=pki["ckey"], tls_ca=pki["ca"], token=ADMIN)
    c = ps.LocalCluster(2, replicas=1, data_dir=tmp_path_factory.mktemp("secure"), security_flags=flags,
                        client_security=me)
    try:
        yield c, me
    finally:
        c.close(timeout=30)


def _connect(cluster, pki, token: str | None = "trainer", cert: bool = True, **kw) -> ps.Client:
    return ps.connect(scheduler=cluster.scheduler, tls_ca=pki["ca"], tls_cert=pki["ccert"] if cert else None,
                      tls_key=pki["ckey"] if cert else None, auth_token_file=pki[token] if token else None,
                      timeout_s=5, failover_timeout_s=3, **kw)


def test_tls_mutual_tls_tokens_and_roles(cluster, pki) -> None:
    c, me = cluster
    with _connect(c, pki) as trainer:  # the trainer's credential: create tables, pull, push
        trainer.create_table("sec", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        trainer.push("sec", np.arange(100), -np.ones((100, 4), np.float32)).result()
        np.testing.assert_array_equal(trainer.pull("sec", np.arange(100)), np.ones((100, 4)))
        # admin operations need the admin credential: refused, and nothing changes
        with pytest.raises(ps.PermissionDenied, match="admin credential"):
            trainer.drop_table("sec")
        with pytest.raises(ps.PermissionDenied):
            trainer.checkpoint(str(c.data_dir / "ckpt-trainer"))
    check = admin.verify(c.scheduler, security=me)  # replication between the servers runs over mutual TLS
    assert check["differing"] == [] and check["copies_checked"] == c.num_slots
    with _connect(c, pki, token="admin") as root:
        assert root.list_tables() == ["sec"]
        root.checkpoint(str(c.data_dir / "ckpt"))
        np.testing.assert_array_equal(root.pull("sec", np.arange(100), insert=False), np.ones((100, 4)))


def test_refused_callers_change_nothing(cluster, pki) -> None:
    c, me = cluster
    with _connect(c, pki) as trainer:
        trainer.create_table("sec2", dim=4, optimizer=ps.SGD(lr=1.0), initializer=ps.Zeros())
        trainer.push("sec2", np.arange(50), -np.ones((50, 4), np.float32)).result()
    bad_token = c.data_dir / "bad.token"
    bad_token.write_text("not-the-token")
    pki_bad = dict(pki, bad=str(bad_token))
    with pytest.raises(ps.Unauthenticated, match="credential refused"):
        _connect(c, pki_bad, token="bad")
    with pytest.raises(ps.Unauthenticated, match="no credential"):
        _connect(c, pki, token=None)
    with pytest.raises(ps.Unavailable):  # mutual TLS: no client certificate, no connection
        _connect(c, pki, cert=False)
    with pytest.raises(ps.Unavailable):  # plaintext to a TLS server
        ps.connect(scheduler=c.scheduler, timeout_s=3)
    with grpc.insecure_channel(c.addresses[0]) as channel:  # straight to a shard, no TLS
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/tigana.v1.Shard/DropTable")(b"\n\x04sec2", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with _connect(c, pki, token="admin") as root:
        np.testing.assert_array_equal(root.pull("sec2", np.arange(50), insert=False), np.ones((50, 4)))
    logs = "".join(p.read_text(errors="replace") for p in c.data_dir.glob("*.log"))
    assert TRAINER not in logs and ADMIN not in logs and "not-the-token" not in logs
    assert "refused" in logs  # the scheduler logs refusals (method and reason, not the token)


def test_a_trainer_can_neither_end_a_handover_nor_declare_a_server_dead(cluster, pki) -> None:
    """``HandoverReady`` ends a primary hand-over (the old primary says it drained): a trainer's credential is
    refused, even with a forged epoch far ahead, and the map does not move. ``ReportUnreachable`` is a
    client's to send, but only makes the scheduler probe the server: a live server reported stays up."""
    c, me = cluster
    before = admin.shard_map(c.scheduler, security=me)
    trainer = Security(tls_cert=pki["ccert"], tls_key=pki["ckey"], tls_ca=pki["ca"], token=TRAINER)
    with trainer.channel(c.scheduler) as channel:
        stub = spb_grpc.SchedulerStub(channel)
        slots = np.arange(before.num_slots, dtype="<i4").tobytes()
        with pytest.raises(grpc.RpcError) as err:
            stub.HandoverReady(spb.HandoverReadyRequest(reporter=before.servers[0].id, slots=slots,
                                                        epoch=before.epoch + 1_000_000), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
        assert "admin credential" in err.value.details()
        reply = stub.ReportUnreachable(spb.ReportUnreachableRequest(address=c.addresses[0], reporter="client"),
                                       timeout=10)
        assert reply.accepted
    time.sleep(2.0)  # the probe the report started has answered
    after = admin.shard_map(c.scheduler, security=me)
    assert [s.id for s in after.servers] == [s.id for s in before.servers]
    assert all(s.up for s in after.servers), after.summary()


def test_a_token_without_tls_is_refused_unless_loopback_is_allowed(tmp_path, pki) -> None:
    with pytest.raises(ps.InvalidArgument, match="tokens need TLS"):
        ServerConfig(auth_token_file=pki["trainer"]).security()
    handle = start_server(ServerConfig(port=0, data_dir=str(tmp_path / "s"), auth_token_file=pki["trainer"],
                                       admin_token_file=pki["admin"], allow_insecure_loopback=True))
    try:
        assert handle.wait_ready(30)
        with ps.connect([handle.address], auth_token_file=pki["admin"], allow_insecure_loopback=True) as client:
            client.create_table("plain", dim=4)
            assert client.pull("plain", np.arange(3)).shape == (3, 4)
        with ps.connect([handle.address], allow_insecure_loopback=True, max_attempts=1) as anonymous, \
                pytest.raises((ps.Unauthenticated, ps.Unavailable)):
            anonymous.list_tables()
        rendered = handle.metrics.render().decode()
        assert "tigana_auth_rejected_total" in rendered
    finally:
        handle.close(grace=1.0)


def test_limits_answer_resource_exhausted(tmp_path) -> None:
    handle = start_server(ServerConfig(port=0, data_dir=str(tmp_path / "lim"), max_rows_per_request=1000))
    try:
        assert handle.wait_ready(30)
        with ps.connect([handle.address], max_attempts=1) as client:
            client.create_table("lim", dim=4)
            with pytest.raises(ps.ResourceExhausted, match=r"table 'lim'.*1000 per request"):
                client.pull("lim", np.arange(5000))
            assert client.describe_table("lim").rows == 0  # refused before anything was inserted
    finally:
        handle.close(grace=1.0)


def test_the_memory_budget_bounds_the_whole_daemon(tmp_path) -> None:
    """``--memory-budget`` is the daemon's, shared by its tables: many tables together spill, they do not each
    get the whole budget."""
    budget = 4 << 20
    handle = start_server(ServerConfig(port=0, data_dir=str(tmp_path / "mem"), memory_budget=budget))
    try:
        assert handle.wait_ready(30)
        with ps.connect([handle.address]) as client:
            for k in range(4):
                client.create_table(f"m{k}", dim=16, optimizer=ps.Adagrad(lr=0.1))
                client.pull(f"m{k}", np.arange(40_000))  # ~40k rows x ~150 B each: far past a quarter budget
            stats = client.server_stats()[handle.address]
        # the budget governs resident rows (the slab keeps the capacity a batch once needed; it is not freed)
        resident = sum(t["rows_resident"] * (t["row_bytes"] + 18) for t in stats.values())
        spilled = sum(t["rows_spilled"] for t in stats.values())
        assert spilled > 0 and resident <= 1.05 * budget, (resident, spilled)
        assert sum(t["rows"] for t in stats.values()) == 4 * 40_000
        with ps.connect([handle.address]) as client:  # spilled rows come back intact
            assert client.pull("m0", np.arange(10)).shape == (10, 16)
    finally:
        handle.close(grace=1.0)


def test_tokens_expire_and_rotate_without_a_restart(tmp_path) -> None:
    """A token file line may carry ``expires=``; the server re-reads the file when it changes."""
    trainer, admin_file = tmp_path / "trainer.token", tmp_path / "admin.token"
    trainer.write_text("old-token expires=2020-01-01T00:00:00Z\n")
    admin_file.write_text("# the admin credential\nroot-token\n")
    handle = start_server(ServerConfig(port=0, data_dir=str(tmp_path / "s"), auth_token_file=str(trainer),
                                       admin_token_file=str(admin_file), allow_insecure_loopback=True))
    sends = {name: tmp_path / f"{name}.send" for name in ("old", "new")}
    sends["old"].write_text("old-token\n")
    sends["new"].write_text("new-token\n")
    try:
        assert handle.wait_ready(30)
        for name, why in (("old", "credential expired"), ("new", "credential refused")):
            with ps.connect([handle.address], auth_token_file=str(sends[name]), allow_insecure_loopback=True,
                            max_attempts=1) as client, pytest.raises(ps.Unauthenticated, match=why):
                client.list_tables()
        trainer.write_text("old-token expires=2020-01-01T00:00:00Z\nnew-token\n")  # rotation: no restart
        deadline = time.monotonic() + 10
        while True:
            try:
                with ps.connect([handle.address], auth_token_file=str(sends["new"]), allow_insecure_loopback=True,
                                max_attempts=1) as client:
                    assert client.list_tables() == []
                break
            except ps.Unauthenticated:
                assert time.monotonic() < deadline, "the rotated token was never accepted"
                time.sleep(0.2)
        assert 'reason="expired"' in handle.metrics.render().decode()
    finally:
        handle.close(grace=1.0)


def test_token_files_are_checked_when_read(tmp_path) -> None:
    bad = tmp_path / "bad.token"
    bad.write_text("tok expires=tomorrow\n")
    with pytest.raises(ps.InvalidArgument, match=r"line 1: 'expires' is not an ISO 8601 time") as err:
        read_tokens(bad)
    assert "tok" not in str(err.value).replace("token", "")
    bad.write_text("tok expires=2020-01-01\n")
    with pytest.raises(ps.InvalidArgument, match="every token in it has expired"):
        read_token(bad)
