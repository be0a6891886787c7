"""`make demo` in a shortened form: 4 seconds of traffic through a SIGKILL of the master, then the Spark
lifecycle job over what was recorded; nothing lost, duplicated or reordered, and the report is there."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ringq import tracing
from services import demo

pytestmark = pytest.mark.integration


def test_demo_runs_through_a_master_kill_and_reports_nothing_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path.parent)
    code = demo.main(["--seconds", "4", "--dir", tmp_path.name])  # relative, as `make demo` gives it
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "SIGKILL" in out and "promotion:" in out, out[-2000:]
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    figures = {k: summary[k] for k in ("lost", "duplicates", "order_violations", "confirmed", "delivered")}
    assert summary["lost"] == summary["duplicates"] == summary["order_violations"] == 0, figures
    assert summary["confirmed"] > 1000 and summary["delivered"] == summary["confirmed"], figures
    assert summary["failover"], "the fault is in the report"
    assert summary["traced"] > 0, "the nodes' spans were read (regression: a relative --trace-dir went astray)"
    assert {"publish → enqueue", "ring hop"} <= {s["label"] for s in summary["stages"]}, summary["stages"]
    assert (tmp_path / "report" / "report.md").stat().st_size > 0
    assert (tmp_path / "report" / "latency.png").stat().st_size > 0
    assert not tracing.enabled(), "the demo leaves tracing off in the process that ran it"
    assert "OTEL_TRACES_SAMPLER" not in os.environ, "nor does it change the environment (it sampled a later test)"
