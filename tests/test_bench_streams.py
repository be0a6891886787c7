"""The pure parts of `make bench-streams`: figures from recorded events, the table, the NATS config. No broker."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from bench import bench_streams
from bench.nats_cluster import config_text
from bench.stream_clients import ClientConfig, _Drain, _Schedule
from bench.stream_metrics import (
    NS,
    duplicates,
    failover_figures,
    longest_gap,
    lost,
    order_violations,
    per_second,
    rate,
    ratio,
    spread,
)

MS = 1_000_000


def test_rate_counts_events_in_the_half_open_window() -> None:
    times = [0, NS // 2, NS, 2 * NS - 1, 2 * NS]
    assert rate(times, NS, 2 * NS) == 2.0  # NS and 2 NS - 1; 2 NS is outside
    assert rate(times, 0, 2 * NS) == 2.0
    assert rate(times, 5, 5) == 0.0


def test_longest_gap_counts_both_bounds() -> None:
    assert longest_gap([], 0, 10) == (10, 10)
    assert longest_gap([2, 3, 9], 0, 10) == (6, 9)
    assert longest_gap([1, 2, 3], 0, 10) == (7, 10)  # nothing after 3: the gap runs to the end
    assert longest_gap([-5, 15], 0, 10) == (10, 10)  # events outside the window do not count
    assert longest_gap([1], 5, 5) == (0, 5)


def test_lost_duplicates_and_order_violations() -> None:
    confirmed = [0, 1, 2, 3, 4, 5, 5]  # 5 confirmed twice (sent again)
    delivered = [0, 2, 1, 3, 3, 5, 4, 2]
    assert lost(confirmed, delivered) == 0
    assert lost(confirmed, [0, 1, 2]) == 3
    assert duplicates(delivered) == 2  # the second 3, the second 2
    # 1 after 2 and 4 after 5 are out of order; the duplicates (3, 2) are not order violations
    assert order_violations(delivered) == 2
    assert order_violations([0, 1, 2, 3]) == 0
    assert order_violations([]) == 0


def test_failover_figures_from_a_recorded_history() -> None:
    kill = 10 * NS
    # confirms every 100 ms, none from the kill until 11.5 s; deliveries every 100 ms, none from 9.95 s to 12 s
    confirm_ns = [t * 100 * MS for t in range(80, 100)] + [t * 100 * MS for t in range(115, 130)]
    confirmed = list(range(len(confirm_ns)))
    delivered_ns = [t * 100 * MS for t in range(80, 100)] + [12 * NS + t * 100 * MS for t in range(15)]
    delivered = [*range(20), 21, 20, *range(22, 34), 33]  # one out of order, one duplicate, 34 never delivered
    f = failover_figures(confirm_ns, confirmed, delivered_ns, delivered, kill, 13 * NS)
    assert f.confirm_gap_s == pytest.approx(1.6)  # 9.9 s to 11.5 s
    assert f.confirms_resumed_s == pytest.approx(1.5)
    assert f.delivery_gap_s == pytest.approx(2.1)  # 9.9 s to 12 s
    assert f.deliveries_resumed_s == pytest.approx(2.0)
    assert f.gap_s == pytest.approx(2.1)
    assert f.lost == 1
    assert f.duplicates == 1
    assert f.order_violations == 1
    assert f.confirmed == 35
    assert f.delivered == 34


def test_failover_gap_runs_to_the_end_of_sending_when_service_never_resumes() -> None:
    kill = 5 * NS
    times = [t * 100 * MS for t in range(50)]  # up to 4.9 s
    f = failover_figures(times, list(range(50)), times, list(range(50)), kill, 8 * NS)
    assert f.gap_s == pytest.approx(3.1)
    assert f.confirms_resumed_s == pytest.approx(3.0)


def test_per_second_buckets() -> None:
    assert per_second([0, 1, NS, 3 * NS - 1, 3 * NS, -1], 0, 3) == [2, 1, 1]


def test_spread_and_ratio() -> None:
    s = spread([3.0, 1.0, None, 2.0])
    assert (s.median, s.low, s.high, s.count) == (2.0, 1.0, 3.0, 3)
    assert s.text(".1f") == "2.0 (1.0-3.0)"
    assert spread([5]).text(",.0f") == "5"
    assert spread([None]).text(".1f") == "-"
    assert ratio(spread([4.0]), spread([2.0])) == 2.0
    assert ratio(spread([4.0]), spread([0.0])) is None
    assert ratio(spread([]), spread([2.0])) is None


def test_schedule_paces_and_bounds_in_flight() -> None:
    unthrottled = _Schedule(ClientConfig(system="nats", addresses=[], name="s", messages=5, max_in_flight=3))
    unthrottled.start()
    assert [seq for seq, _ in unthrottled.due(0)] == [0, 1, 2]
    assert unthrottled.due(3) == []
    assert [seq for seq, _ in unthrottled.due(1)] == [3, 4]  # only 5 messages
    assert unthrottled.sending_over()
    paced = _Schedule(ClientConfig(system="nats", addresses=[], name="s", rate=1000.0, seconds=60))
    paced.start()
    paced.started_ns -= 10 * MS  # 10 ms ago: 11 messages due (0 .. 10)
    due = paced.due(0)
    assert 11 <= len(due) <= 13
    assert [stamp - paced.started_ns for _, stamp in due[:3]] == [0, MS, 2 * MS]  # scheduled send times


def test_drain_waits_for_every_confirmed_message_or_idleness() -> None:
    ctx = multiprocessing.get_context("spawn")
    stop, expected = ctx.Event(), ctx.Value("q", 0)
    drain = _Drain(ClientConfig(system="nats", addresses=[], name="s", idle_s=60.0, drain_s=60.0), stop, expected)
    drain.delivered(0)
    assert not drain.finished()  # not stopped yet
    expected.value = 2
    stop.set()
    assert not drain.finished()
    drain.delivered(1)
    assert drain.finished()
    idle = _Drain(ClientConfig(system="nats", addresses=[], name="s", idle_s=0.0, drain_s=60.0), stop, expected)
    time.sleep(0.01)
    assert idle.finished()  # nothing came for idle_s


def test_nats_config_binds_loopback_with_its_own_store(tmp_path: Path) -> None:
    text = config_text("n1", 20001, 20002, [20004, 20006], tmp_path / "store")
    assert 'listen: "127.0.0.1:20001"' in text
    assert 'listen: "127.0.0.1:20002"' in text
    assert '"nats-route://127.0.0.1:20004", "nats-route://127.0.0.1:20006"' in text
    assert f'store_dir: "{tmp_path / "store"}"' in text
    assert 'server_name: "n1"' in text


def test_table_has_a_ratio_column_per_reference() -> None:
    results = {k: bench_streams.SystemResults() for k in bench_streams.SYSTEMS}
    for key, tp in (("rabbitmq", 1000.0), ("nats", 2000.0), ("ringq", 4000.0)):
        results[key].throughput.append(bench_streams.ThroughputResult(tp, tp / 2, ""))
    header, right = bench_streams.table_header(list(bench_streams.SYSTEMS))
    assert header[-2:] == ["ringq / RabbitMQ quorum", "ringq / NATS R3 file"]
    assert len(right) == len(header)
    rows = bench_streams.table_rows(results, list(bench_streams.SYSTEMS))
    confirmed = rows[0]
    assert confirmed[:2] == ["throughput", "confirmed msgs/s"]
    assert confirmed[2:] == ["1,000", "2,000", "4,000", "4.00x", "2.00x"]
    assert all(len(r) == len(header) for r in rows)
    assert rows[3][2:] == ["-", "-", "-", "-", "-"]  # no failover run: nothing measured, no ratio
