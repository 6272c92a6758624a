"""Finite gradients whose update would not be: a push is rejected, with nothing applied, when the optimizer's
result (weights or state) would not be finite, as a push holding NaN/Inf is; with ``nonfinite_grads=
"skip_rows"`` those ids are dropped instead. Before, |g| = 2e19 (g² past float32's largest value) wrote an
infinite Adagrad accumulator (the row froze), an infinite FTRL ``n`` (NaN weights at the next push), and NaN
Adam weights on the numba backend where numpy's were finite. Both backends now take the same decisions and
compute the same rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tigana import embeddings as emb
from tigana.embeddings import _kernels

BACKENDS = ["numpy"] + (["numba"] if _kernels.AVAILABLE else [])
DIM = 4
OPTIMIZERS = {"sgd": emb.SGD(lr=0.1), "adagrad": emb.Adagrad(lr=0.1), "rowwise_adagrad": emb.RowWiseAdagrad(lr=0.1),
              "adam": emb.Adam(lr=0.1), "ftrl": emb.FTRL(alpha=0.1)}


def _table(opt: str, backend: str, **config) -> emb.EmbeddingTable:
    table = emb.EmbeddingTable(emb.TableConfig("clicks", dim=DIM, optimizer=OPTIMIZERS[opt], backend=backend,
                                               seed=1, **config))
    table.push(np.arange(5), np.full((5, DIM), 0.5, np.float32))
    return table


def _observed(table: emb.EmbeddingTable) -> tuple:
    stats = table.stats()
    return table.checksum(), len(table), table.step, stats["pushes"], stats["rows_updated"]


def _finite(table: emb.EmbeddingTable) -> bool:
    rows = table.export_rows()
    return bool(np.isfinite(rows.weights).all() and np.isfinite(rows.state).all())


def _push(table: emb.EmbeddingTable, ids: np.ndarray, grads: np.ndarray) -> bool:
    """True when applied; False when rejected, in which case the table must be exactly as it was."""
    before = _observed(table)
    try:
        table.push(ids, grads)
    except emb.InvalidArgument as err:
        assert _observed(table) == before
        if "NaN/Inf" in str(err):  # the screen: duplicates' gradients summed past float32 (the caller's case)
            raise
        assert "'clicks'" in str(err) and "'grads'" in str(err) and "non-finite" in str(err)
        return False
    assert _finite(table)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_a_2e19_gradient_never_leaves_a_non_finite_row(opt: str, backend: str) -> None:
    table = _table(opt, backend)
    grads = np.full((3, DIM), 2e19, np.float32)
    grads[1] = -2e19
    applied = _push(table, np.array([1, 2, 77]), grads)  # two stored rows and a new id
    assert applied == (opt in ("sgd", "adam"))  # g² overflows Adagrad's, row-wise Adagrad's and FTRL's state
    if not applied:
        assert not table.contains(np.array([77]))[0]  # the rejected push inserted nothing
    assert _push(table, np.array([1]), np.full((1, DIM), 0.5, np.float32))  # the row still trains
    assert _finite(table)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_accumulator_that_would_overflow_is_rejected_not_frozen(backend: str) -> None:
    table = _table("adagrad", backend)
    pushes = [_push(table, np.array([3]), np.full((1, DIM), 1.5e19, np.float32)) for _ in range(3)]
    assert pushes == [True, False, False]  # 2.25e38 fits, 4.5e38 does not
    w = table.pull(np.array([3]))
    assert _push(table, np.array([3]), np.full((1, DIM), 1e18, np.float32))
    assert not np.array_equal(table.pull(np.array([3])), w)  # not frozen: a gradient still moves the row


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_skip_rows_drops_only_the_ids_whose_update_would_not_be_finite(opt: str, backend: str) -> None:
    table = _table(opt, backend, nonfinite_grads="skip_rows")
    reference = _table(opt, backend)
    grads = np.full((4, DIM), 0.25, np.float32)
    grads[1] = 3e38  # id 2: g² overflows every optimizer's state but SGD's (which has none)
    ids = np.array([1, 2, 3, 2])
    table.push(ids, grads)
    assert _finite(table)
    skipped = table.stats()["nonfinite_rows_skipped"]
    if opt == "sgd":  # w - 0.1 * 3.25e38 is finite: applied
        reference.push(ids, grads)
        assert skipped == 0
    else:  # both rows of id 2 dropped; ids 1 and 3 applied exactly as alone
        reference.push(np.array([1, 3]), grads[[0, 2]])
        assert skipped == 2
    assert table.checksum() == reference.checksum()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(opt=st.sampled_from(sorted(OPTIMIZERS)),
       pushes=st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=1, max_size=6),
                                 st.floats(0.0, 38.0), st.sampled_from([1.0, -1.0])), min_size=1, max_size=5))
def test_both_backends_take_the_same_decisions_and_compute_the_same_rows(opt: str, pushes: list) -> None:
    if len(BACKENDS) < 2:
        pytest.skip("numba is not installed")
    tables = [_table(opt, b) for b in BACKENDS]
    # The backends may round each step differently (numba fuses multiply-adds): one ulp of the largest value a
    # row has held, which a later push can cancel down to a small weight (sgd: w - lr*1e3 then + lr*1e3).
    peak = {"weights": 0.0, "state": 0.0}
    for ids, exponent, sign in pushes:  # gradients from 1 to 1e38 (duplicate ids may sum past float32: NaN/Inf)
        ids = np.array(ids, np.int64)
        scale = np.linspace(0.5, 1.0, DIM, dtype=np.float32)
        grads = (np.float32(sign * 10.0 ** exponent) * scale)[None, :].repeat(ids.size, axis=0)
        outcomes = []
        for t in tables:
            try:
                outcomes.append(_push(t, ids, grads))
            except emb.InvalidArgument as err:  # the screen of NaN/Inf sums of duplicates: before any optimizer
                assert "NaN/Inf" in str(err)
                outcomes.append(None)
        assert outcomes[0] == outcomes[1], (ids, grads[0], outcomes)
        a, b = (t.export_rows() for t in tables)
        order_a, order_b = np.argsort(a.ids), np.argsort(b.ids)
        np.testing.assert_array_equal(a.ids[order_a], b.ids[order_b])
        for field in ("weights", "state"):
            x, y = getattr(a, field)[order_a], getattr(b, field)[order_b]
            peak[field] = max(peak[field], float(np.abs(x).max(initial=0.0)))
            atol = max(1e-6, 16 * float(np.spacing(np.float32(peak[field]))))
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=atol, err_msg=field)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float16_row_is_checked_as_it_will_be_stored(backend: str) -> None:
    """float16 storage overflows at 65504: an update to 7e4 would store Inf, so it is refused; bfloat16 (the
    float32 range) takes it."""
    for dtype, applied in (("float16", False), ("bfloat16", True)):
        table = emb.EmbeddingTable(emb.TableConfig("clicks", dim=DIM, optimizer=emb.SGD(lr=1.0), backend=backend,
                                                   dtype=dtype))
        table.push(np.arange(3), np.zeros((3, DIM), np.float32))
        assert _push(table, np.array([1, 5]), np.full((2, DIM), -7e4, np.float32)) == applied
        assert _finite(table)
