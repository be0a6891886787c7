"""Fixtures shared by the tests: one real ZooKeeper server for the whole session."""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from ringq import _fork_safety  # noqa: F401  (before any test module imports grpc: see that module)
from tests.sim import parallel
from tests.zookeeper import SETUP_HINT, ZooKeeperServer, unavailable_reason


@pytest.fixture(scope="session")
def zookeeper() -> Iterator[str]:
    """A ZooKeeper server on 127.0.0.1 for the session: yields "127.0.0.1:PORT". Use a unique root per test."""
    problem = unavailable_reason()
    if problem is not None:
        pytest.fail(f"these tests need a ZooKeeper server: {problem}; {SETUP_HINT}", pytrace=False)
    with ZooKeeperServer() as server:
        yield server.hosts


LOG_TAIL_LINES = 60


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that ran a cluster under its tmp_path gets the tail of every process's log in its
    report, so a failure seen only in CI can be explained from CI's output."""
    report = yield
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and tmp_path is not None:
        for log in sorted(tmp_path.glob("**/logs/*.log")):
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            report.sections.append((f"log tail {log.relative_to(tmp_path)}", "\n".join(lines)))
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the simulations' worker processes (tests/sim/parallel.py), if any were started."""
    parallel.shutdown()
