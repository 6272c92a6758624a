"""The row a read-only pull gives an id the table does not hold (``unseen``: ``tigana.embeddings.unseen``), on
real shard servers: zeros, a number or the initial row, per request; stored rows read as they are; nothing is
inserted; a bad policy is refused naming the table and the field, and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from tigana import ps
from tigana.embeddings import EmbeddingTable, Normal, TableConfig

DIM = 4


def test_the_unseen_policy_parses_its_values_and_refuses_the_rest() -> None:
    assert ps.Unseen.parse("zeros") == ps.Unseen(0.0) and str(ps.Unseen(0.0)) == "zeros"
    assert ps.Unseen.parse("initial") == ps.Unseen(None) and str(ps.Unseen(None)) == "initial"
    assert ps.Unseen.parse("-0.5") == ps.Unseen(-0.5) and ps.Unseen.parse(2) == ps.Unseen(2.0)
    for policy in (ps.Unseen(0.0), ps.Unseen(None), ps.Unseen(0.125)):
        assert ps.Unseen.parse(str(policy)) == policy  # the text both places read
    for bad in ("mean", "", "nan", "inf", "0.1x", None, True):
        with pytest.raises(ValueError, match="field 'x' must be 'zeros', 'initial' or a finite number"):
            ps.Unseen.parse(bad, what="field 'x'")
    with pytest.raises(ValueError, match="initializer"):
        ps.Unseen(None).rows(np.arange(3), DIM)


def test_a_tables_read_only_pull_reads_unseen_ids_as_the_policy_says() -> None:
    table = EmbeddingTable(TableConfig("t", dim=DIM, initializer=Normal(std=0.5), seed=3))
    table.push(np.array([1, 2]), np.ones((2, DIM), np.float32))
    stored = table.pull(np.array([1, 2]))
    ids = np.array([1, 7, 2, 8, 7])
    initial = table.pull(ids, insert=False)  # no policy: the initial rows
    np.testing.assert_array_equal(initial[[0, 2]], stored)
    np.testing.assert_array_equal(initial[[1, 4]], ps.Unseen(None).rows(np.array([7, 7]), DIM, table._initial))
    zeros = table.pull(ids, insert=False, unseen=ps.Unseen(0.0))
    np.testing.assert_array_equal(zeros[[0, 2]], stored)
    assert (zeros[[1, 3, 4]] == 0).all()
    assert (table.pull(ids, insert=False, unseen=ps.Unseen(0.25))[[1, 3, 4]] == np.float32(0.25)).all()
    np.testing.assert_array_equal(table.pull(ids, insert=False, unseen=ps.Unseen(None)), initial)
    assert len(table) == 2  # nothing inserted


def test_read_only_pulls_on_shard_servers_read_unseen_ids_as_asked(shard_servers) -> None:
    ids = np.arange(0, 3000, 7, dtype=np.int64)  # on both shards
    new = ids + 1
    both = np.concatenate([ids, new])
    with ps.connect([h.address for h in shard_servers], timeout_s=20) as client:
        client.create_table("u", dim=DIM, initializer=ps.Normal(std=0.5), seed=11)
        client.push("u", ids, np.ones((ids.size, DIM), np.float32)).result(timeout=20)
        stored = client.pull("u", ids)
        initial = client.pull("u", both, insert=False)  # the default of a bare client: the initial rows
        np.testing.assert_array_equal(initial[:ids.size], stored)
        assert np.abs(initial[ids.size:]).sum() > 0
        for policy, want in (("zeros", 0.0), ("-1.5", -1.5), (ps.Unseen(0.5), 0.5)):
            got = client.pull_async("u", both, insert=False, unseen=policy).result(timeout=20)
            np.testing.assert_array_equal(got[:ids.size], stored)
            assert (got[ids.size:] == np.float32(want)).all(), policy
        np.testing.assert_array_equal(client.pull("u", both, insert=False, unseen="initial"), initial)
        many = client.pull_many(["u", "u"], [new, ids], insert=False, unseen="zeros")
        assert (many[0].result(timeout=20) == 0).all()
        np.testing.assert_array_equal(many[1].result(timeout=20), stored)
        assert client.describe_table("u").rows == ids.size  # nothing inserted

        # bad input: refused naming the table and the field, nothing sent or changed
        with pytest.raises(ps.InvalidArgument, match=r"\['u'\]: field 'unseen' must be"):
            client.pull("u", new, insert=False, unseen="median")
        with pytest.raises(ps.InvalidArgument, match="field 'unseen' applies to read-only pulls"):
            client.pull("u", new, unseen="zeros")
        assert client.describe_table("u").rows == ids.size
