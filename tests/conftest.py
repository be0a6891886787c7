"""Fixtures shared by the tests: one real ZooKeeper server for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.zookeeper import SETUP_HINT, ZooKeeperServer, unavailable_reason


@pytest.fixture(scope="session")
def zookeeper() -> Iterator[str]:
    """A ZooKeeper server on 127.0.0.1 for the session: yields "127.0.0.1:PORT". Use a unique root per test."""
    problem = unavailable_reason()
    if problem is not None:
        pytest.fail(f"these tests need a ZooKeeper server: {problem}; {SETUP_HINT}", pytrace=False)
    with ZooKeeperServer() as server:
        yield server.hosts
