"""``inflight.retry_plan``: when a failed part goes again (a pure decision; the re-routing itself runs on real
servers in test_client, test_resharding and the fault suite)."""

from __future__ import annotations

from tigana.ps.client.inflight import retry_plan
from tigana.ps.errors import DeadlineExceeded, Unavailable, WrongShard


def test_a_part_refused_by_a_server_behind_the_clients_map_goes_again_soon_by_the_same_map() -> None:
    behind = WrongShard("slots this server does not lead at epoch 31 (routed at epoch 34)", epoch=31)
    for attempt in (1, 5, 12):  # however many attempts a long rebalance took
        assert retry_plan(behind, 34, attempt, True, 0.05, 2.0) == (0.05, 0)


def test_a_part_refused_at_the_same_or_a_newer_epoch_waits_for_a_newer_map_with_a_growing_backoff() -> None:
    handing_over = WrongShard("slot 7 is being handed over to a new primary at epoch 16", epoch=16)
    assert retry_plan(handing_over, 16, 1, True, 0.05, 2.0) == (0.05, 17)
    assert retry_plan(handing_over, 16, 3, True, 0.05, 2.0) == (0.2, 17)
    assert retry_plan(handing_over, 16, 12, True, 0.05, 2.0) == (2.0, 17)
    newer = WrongShard("moved", epoch=20)
    assert retry_plan(newer, 16, 2, True, 0.05, 2.0) == (0.1, 20)


def test_other_errors_and_static_lists_back_off() -> None:
    assert retry_plan(Unavailable("down", epoch=3), 5, 2, True, 0.05, 2.0) == (0.1, 6)
    assert retry_plan(DeadlineExceeded("late"), 5, 4, True, 0.05, 2.0) == (0.4, 6)
    # a static shard list has no map to wait for: the backoff alone
    assert retry_plan(Unavailable("down"), 0, 3, False, 0.05, 2.0) == (0.2, 0)
    assert retry_plan(WrongShard("no", epoch=0), 0, 1, False, 0.05, 2.0) == (0.05, 0)
