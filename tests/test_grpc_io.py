"""The choice of gRPC's I/O path (ringq/_grpc_io.py, and services/grpc_io.py for the nodes): made before grpc
loads, in the SDK's processes and in the nodes, never over the user's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ringq._grpc_io import POLLER_IO_EXPERIMENTS, prefer_poller_io

ROOT = Path(__file__).resolve().parent.parent


def test_the_poller_path_is_chosen_when_the_user_chose_nothing() -> None:
    environ: dict[str, str] = {}
    prefer_poller_io(environ)
    assert environ == {"GRPC_EXPERIMENTS": POLLER_IO_EXPERIMENTS}


def test_a_users_choice_wins_even_an_empty_one() -> None:
    for chosen in ("", "-event_engine_client"):
        environ = {"GRPC_EXPERIMENTS": chosen}
        prefer_poller_io(environ)
        assert environ == {"GRPC_EXPERIMENTS": chosen}


@pytest.mark.parametrize("module", ["ringq", "ringq.aio", "services.node"])
def test_importing_the_sdk_or_a_node_makes_the_choice_before_grpc_is_imported(module: str) -> None:
    """The SDK's producers and consumers take the nodes' path too (issue 13: at 2,000 msgs/s, p50 1.55 -> 1.50
    ms and p99 3.11 -> 2.78 ms over 10 alternations; saturated W2 +8 %). gRPC reads GRPC_EXPERIMENTS when it
    loads: set any later, it would change nothing. sys.modules keeps the order in which a fresh interpreter
    imported them."""
    script = (
        "import os, sys\n"
        "os.environ.pop('GRPC_EXPERIMENTS', None)\n"
        f"import {module}\n"
        "order = list(sys.modules)\n"
        "print(order.index('ringq._grpc_io') < order.index('grpc'), os.environ['GRPC_EXPERIMENTS'])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split() == ["True", POLLER_IO_EXPERIMENTS]
