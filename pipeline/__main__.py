"""`python -m pipeline`: run the lifecycle job from the command line.

    python -m pipeline --history DIR_OR_FILE [...] [--spans DIR_OR_FILE ...] [--out DIR] [--master local[*]]
                       [--conf KEY=VALUE ...] [--fail-on-violation]

Responsible for: arguments, the console summary and the exit status. Guarantees: exit 0 after a
run (violations or not) unless `--fail-on-violation` is given and lost + duplicates + order
violations is non-zero (exit 1); a missing input or an input directory without history files exits 2
with one line on stderr (`pipeline: error: ...`), as do bad arguments, before Spark starts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipeline.inputs import InputError
from pipeline.lifecycle import DEFAULT_MASTER, DEFAULT_OUT, run_lifecycle
from pipeline.summary import Summary


def _conf_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pipeline",
        description="Per-message lifecycle, stage latencies, throughput, failover window and delivery guarantees "
        "from ringq client histories (and span files, when given).",
    )
    p.add_argument(
        "--history",
        nargs="+",
        required=True,
        metavar="DIR_OR_FILE",
        help="history files, or directories holding history-*.jsonl (else *.jsonl other than spans-*.jsonl)",
    )
    p.add_argument(
        "--spans", nargs="*", default=[], metavar="DIR_OR_FILE", help="span files, or directories holding spans-*.jsonl"
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--master", default=DEFAULT_MASTER, help=f"Spark master (default {DEFAULT_MASTER})")
    p.add_argument(
        "--conf",
        action="append",
        default=[],
        type=_conf_pair,
        metavar="KEY=VALUE",
        help="a Spark setting for the session the job starts (repeatable)",
    )
    p.add_argument(
        "--fail-on-violation", action="store_true", help="exit 1 when anything is lost, duplicated or out of order"
    )
    return p


def exit_status(summary: Summary, fail_on_violation: bool) -> int:
    return 1 if fail_on_violation and summary.violation_count else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        summary = run_lifecycle(args.history, args.spans, args.out, master=args.master, conf=dict(args.conf))
    except InputError as error:
        print(f"pipeline: error: {error}", file=sys.stderr)
        return 2
    print(summary.text())
    return exit_status(summary, args.fail_on_violation)


if __name__ == "__main__":
    sys.exit(main())
