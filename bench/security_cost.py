"""`make bench-security`: what TLS and authentication cost, measured beside plaintext in one run.

Runs ringq's W1 (confirmed publishes), W2 saturated (delivered msgs/s, latency) and W2 at a fixed
2,000 msgs/s (latency at moderate load) on a fresh 3-node cluster per run, alternately plaintext and
with mutual TLS between members, TLS to clients and every call authenticated as a user (the method of
bench/ringq_workloads.py), and reports the median, min and max of each side and their ratio.

    python -m bench.security_cost [--runs N] [--quick] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.markdown import replace_marked
from bench.reference.rabbitmq_workloads import FIXED_RATE, Durations, WorkloadResult
from bench.ringq_workloads import RingqCluster, run_w1, run_w2

MARK_BEGIN = "<!-- security-cost:begin -->"
MARK_END = "<!-- security-cost:end -->"
SIDES = {"plaintext": False, "TLS + auth": True}
Figure = Callable[[dict[str, WorkloadResult]], float | None]
FIGURES: list[tuple[str, Figure, str]] = [
    ("W1 confirmed msgs/s", lambda r: r["W1"].rate, ",.0f"),
    ("W2 delivered msgs/s", lambda r: r["W2"].rate, ",.0f"),
    ("W2 p50 ms (saturated)", lambda r: r["W2"].p50_ms, ".1f"),
    ("W2 p99 ms (saturated)", lambda r: r["W2"].p99_ms, ".1f"),
    (f"W2 at {FIXED_RATE:,.0f} msgs/s p50 ms", lambda r: r["W2-fixed"].p50_ms, ".2f"),
    (f"W2 at {FIXED_RATE:,.0f} msgs/s p99 ms", lambda r: r["W2-fixed"].p99_ms, ".2f"),
]


def one_run(tls: bool, durations: Durations) -> dict[str, WorkloadResult]:
    with RingqCluster(tls=tls) as rc:
        return {
            "W1": run_w1(rc, durations),
            "W2": run_w2(rc, durations),
            "W2-fixed": run_w2(rc, durations, rate=FIXED_RATE, queue="ha.w2fixed"),
        }


def _cell(values: Sequence[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.security_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per side, alternating (default 3)")
    parser.add_argument("--quick", action="store_true", help="shorter workloads (a smoke run)")
    parser.add_argument("--write", type=Path, help="put the result into this Markdown file")
    args = parser.parse_args(argv)
    durations = Durations.quick() if args.quick else Durations()
    figures: dict[str, dict[str, list[float]]] = {side: {name: [] for name, _, _ in FIGURES} for side in SIDES}
    for run in range(args.runs):
        for side, tls in SIDES.items():
            results = one_run(tls, durations)
            for name, figure, _ in FIGURES:
                value = figure(results)
                if value is not None:
                    figures[side][name].append(value)
            shown = ", ".join(f"{name} {figure(results) or 0:,.2f}" for name, figure, _ in FIGURES)
            print(f"run {run + 1} {side}: {shown}", flush=True)
    command = " ".join(["python -m bench.security_cost", *(argv if argv is not None else sys.argv[1:])])
    rows = []
    for name, _, fmt in FIGURES:
        plain, secure = figures["plaintext"][name], figures["TLS + auth"][name]
        ratio = statistics.median(secure) / statistics.median(plain) if plain and secure else float("nan")
        rows.append(f"| {name} | {_cell(plain, fmt)} | {_cell(secure, fmt)} | {ratio:.2f} |")
    text = "\n".join(
        [
            MARK_BEGIN,
            "## The cost of security: TLS and authentication beside plaintext",
            "",
            f"`{command}`: ringq's W1 and W2 (3 nodes, 256 B messages, the method of the section above) on "
            f"a fresh cluster per run, alternately plaintext and with mutual TLS between members, TLS to "
            f"clients and every call authenticated (Basic credentials, Argon2id checked once per client "
            f"and remembered), {args.runs} runs each: median (min-max).",
            "",
            "| figure | plaintext | TLS + auth | ratio |",
            "|---|---:|---:|---:|",
            *rows,
            MARK_END,
        ]
    )
    print(text)
    if args.write:
        replace_marked(args.write, MARK_BEGIN, MARK_END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
