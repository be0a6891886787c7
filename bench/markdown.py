"""Benchmark results into docs/benchmarks.md: one marked section per benchmark, replaced in place, and the
command that produced them."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path


def command_line(module: str, make_target: str, argv: Sequence[str] | None) -> str:
    """The command a section names: `make TARGET` when make ran the benchmark as it is (no arguments of
    its own), else `python -m MODULE` with the arguments it was given."""
    if argv is None and os.environ.get("MAKELEVEL"):
        return f"make {make_target}"
    return " ".join(["python -m", module, *(sys.argv[1:] if argv is None else argv)])


def replace_marked(path: Path, begin: str, end: str, text: str) -> None:
    """Put `text` (which starts with `begin` and ends with `end`) in place of the marked section of
    `path`, or append it; everything else in the file is kept."""
    current = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in current and end in current:
        before, rest = current.split(begin, 1)
        current = before + text + rest.split(end, 1)[1]
    else:
        current = current.rstrip("\n") + "\n\n" + text + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(current)
