"""An idle queue costs nothing (issue 13): a master whose depth report would repeat the last one to the same
synchronised mirrors sends none and asks for no timer (services/queue/replica_core.py
`_depth_known_to_all`), while an unsynchronised mirror, a newcomer or any change still gets reports."""

from __future__ import annotations

from services.queue.master import Publish, PublishOutcome
from services.queue.ops import Depth
from tests.replica_cores import TIMERS, Driven, fresh_master

INTERVAL = TIMERS.depth_report_interval_ms


def depth_reports(driven: Driven) -> list[Depth]:
    return [report for report in driven.said() if isinstance(report, Depth)]


def tick_intervals(driven: Driven, count: int) -> list[Depth]:
    """Tick `count` report intervals on; the depth reports broadcast meanwhile."""
    for _ in range(count):
        driven.tick(driven.now + INTERVAL)
        driven.confirm_ring()
    return depth_reports(driven)


def test_an_idle_master_with_every_mirror_synchronised_reports_once_then_sends_nothing_and_sets_no_timer() -> None:
    driven = fresh_master(synchronised=("node2",))
    assert len(tick_intervals(driven, 1)) == 1  # nobody was told the depth yet
    assert tick_intervals(driven, 5) == []
    assert driven.core.next_wakeup_ms() is None


def test_an_unsynchronised_mirror_keeps_getting_depth_reports() -> None:
    driven = fresh_master(synchronised=())
    assert len(tick_intervals(driven, 5)) == 5
    assert driven.core.next_wakeup_ms() is not None


def test_a_birth_gets_a_depth_report_at_once_even_when_nothing_changed() -> None:
    driven = fresh_master(synchronised=("node2",))
    tick_intervals(driven, 2)
    driven.run(driven.core.on_members_changed(["node2.c"], ["node2.b"], driven.now))
    assert [report.depth for report in depth_reports(driven)] == [0]


def test_a_change_makes_the_next_report_due_again() -> None:
    driven = fresh_master(synchronised=("node2",))
    tick_intervals(driven, 2)
    _, outcomes, effects = driven.core.publish([Publish(b"m", persistent=False)], driven.now)
    assert outcomes == [PublishOutcome.ACCEPTED]
    driven.run(effects)
    driven.confirm_ring()
    assert driven.core.next_wakeup_ms() is not None
    assert [report.depth for report in tick_intervals(driven, 1)] == [1]
    assert tick_intervals(driven, 3) == []
