"""The pure parts of `make soak` (bench/soak.py): memory growth and the flatness verdict, lost and duplicate
counts, the report and its Markdown section. No broker."""

from __future__ import annotations

from pathlib import Path

from bench import soak
from bench.markdown import replace_marked
from bench.process_stats import MIB
from bench.soak import Sample, SoakRun, count_duplicates, flat_verdict, missing, node_growth


def _sample(minute: int, node1: float, node2: float) -> Sample:
    rss = {"node1": int(node1 * MIB), "node2": int(node2 * MIB)}
    cpu = {"node1": 0.5, "node2": 0.25} if minute else {}
    return Sample(minute, minute * 60.0, rss, 10, minute * 1000, minute * 990, 0, cpu)


def _run(samples: list[Sample]) -> SoakRun:
    run = SoakRun("make soak", "2026-01-01 00:00 UTC", 30, 10_000, 2, "0.2.0", "abc", "setup text", "node1")
    run.samples = samples
    return run


def test_growth_is_measured_from_the_warm_up_sample() -> None:
    samples = [_sample(0, 40, 40), _sample(1, 90, 60), _sample(2, 100, 50), _sample(3, 104, 48), _sample(4, 108, 55)]
    node1, node2 = node_growth(samples, warmup_minutes=2)
    assert (node1.node, node1.warm_rss, node1.end_rss) == ("node1", 100 * MIB, 108 * MIB)
    assert abs(node1.growth - 0.08) < 1e-9
    assert abs(node1.max_deviation - 0.08) < 1e-9 and node1.max_deviation_minute == 4
    # node2 went down 4 % then up 10 %: the largest deviation is the rise, the minutes before warm-up don't count
    assert abs(node2.growth - 0.10) < 1e-9
    assert abs(node2.max_deviation - 0.10) < 1e-9 and node2.max_deviation_minute == 4


def test_a_drop_counts_as_a_deviation_too() -> None:
    samples = [_sample(2, 100, 100), _sample(3, 85, 100), _sample(4, 100, 100)]
    node1, _ = node_growth(samples, warmup_minutes=2)
    assert node1.growth == 0.0
    assert abs(node1.max_deviation - 0.15) < 1e-9 and node1.max_deviation_minute == 3


def test_flat_within_ten_percent_is_met_at_the_bound_and_missed_beyond_it() -> None:
    flat = [_sample(2, 100, 100), _sample(3, 110, 95), _sample(4, 105, 100)]
    met, text = flat_verdict(node_growth(flat, 2), flat, 2)
    assert met, text
    assert text.startswith("flat within 10 %")
    grown = [_sample(2, 100, 100), _sample(3, 105, 100), _sample(4, 111, 100)]
    met, text = flat_verdict(node_growth(grown, 2), grown, 2)
    assert not met
    assert "node1" in text and "11.0 %" in text and "minute 4" in text


def test_a_run_that_ends_with_the_warm_up_has_no_verdict() -> None:
    samples = [_sample(0, 50, 50), _sample(1, 51, 51), _sample(2, 52, 52)]
    met, text = flat_verdict(node_growth(samples, 2), samples, 2)
    assert not met and text.startswith("not measured")
    assert flat_verdict([], [], 2) == (False, "not flat within 10 %: no memory samples")


def test_lost_are_confirmed_sequence_numbers_never_delivered() -> None:
    assert missing([0, 1, 2, 3, 5], [3, 1, 0, 4, 4], 6) == [2, 5]
    assert missing([], [], 0) == []
    assert missing([0, 1], [1, 0, 7], 2) == []  # a stray number past the range is ignored


def test_duplicates_are_second_deliveries_without_the_redelivered_flag() -> None:
    seqs = [0, 1, 2, 1, 2, 2, 3]
    flags = [0, 0, 0, 1, 0, 0, 0]  # 1 again but flagged; 2 twice more unflagged
    assert count_duplicates(seqs, flags) == 2
    assert count_duplicates([], []) == 0
    assert count_duplicates([4, 4], [1, 1]) == 0  # the first delivery of 4 was flagged: still a first


def test_the_report_and_section_show_every_minute_and_the_verdict(tmp_path: Path) -> None:
    run = _run([_sample(0, 50, 50), _sample(1, 98, 97), _sample(2, 100, 100), _sample(3, 101, 103)])
    run.published, run.confirmed, run.delivered, run.lost, run.lost_still_queued = 3000, 3000, 2990, 10, 4
    text = soak.report_text(run)
    assert "node1 (master) RSS MiB" in text and "node2 RSS MiB" in text
    assert "0.75" in text  # the nodes' CPU over minute 1, cores
    assert "lost (confirmed, never delivered): 10 (4 of them still in the queue" in text
    assert "verdict: met: flat within 10 %" in text
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    replace_marked(doc, soak.MARK_BEGIN, soak.MARK_END, soak.section(run))
    replace_marked(doc, soak.MARK_BEGIN, soak.MARK_END, soak.section(run))
    written = doc.read_text()
    assert written.count(soak.SECTION_TITLE) == 1 and "kept" in written
    assert "Command: `make soak`" in written and "| 3 | 101.0 | 103.0 |" in written
    run.minutes = 3
    assert "(shortened: 3 minutes)" in soak.section(run)
