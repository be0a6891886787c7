"""A node's choice of gRPC's I/O path (services/grpc_io.py): made before grpc loads, never over the operator's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.grpc_io import POLLER_IO_EXPERIMENTS, prefer_poller_io

ROOT = Path(__file__).resolve().parent.parent


def test_the_poller_path_is_chosen_when_the_operator_chose_nothing() -> None:
    environ: dict[str, str] = {}
    prefer_poller_io(environ)
    assert environ == {"GRPC_EXPERIMENTS": POLLER_IO_EXPERIMENTS}


def test_an_operators_choice_wins_even_an_empty_one() -> None:
    for chosen in ("", "-event_engine_client"):
        environ = {"GRPC_EXPERIMENTS": chosen}
        prefer_poller_io(environ)
        assert environ == {"GRPC_EXPERIMENTS": chosen}


def test_the_node_module_makes_the_choice_before_grpc_is_imported() -> None:
    # gRPC reads GRPC_EXPERIMENTS when it loads: set any later, it would change nothing. sys.modules keeps
    # the order in which a fresh interpreter imported them.
    script = (
        "import os, sys\n"
        "os.environ.pop('GRPC_EXPERIMENTS', None)\n"
        "import services.node\n"
        "order = list(sys.modules)\n"
        "print(order.index('services.grpc_io') < order.index('grpc'), os.environ['GRPC_EXPERIMENTS'])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split() == ["True", POLLER_IO_EXPERIMENTS]
