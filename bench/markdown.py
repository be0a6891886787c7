"""Benchmark results into docs/benchmarks.md: one marked section per benchmark, replaced in place."""

from __future__ import annotations

from pathlib import Path


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
