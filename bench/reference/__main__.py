"""`python -m bench.reference`: the RabbitMQ reference measurements of `make bench`.

Starts a 3-node RabbitMQ cluster (Debian's rabbitmq-server) on 127.0.0.1 with
classic queues mirrored on every node, runs W1, W2 (batched acks), W2 with one
ack per message, W2 at a fixed rate and W3 (see bench/reference/
rabbitmq_workloads.py for the method), prints a table, stops the cluster.
`--quick` shortens every run; `--json PATH` also writes the report as JSON.
`make bench` (bench/bench_queues.py) runs the same beside ringq and NATS.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from bench.reference.rabbitmq_cluster import SETUP_HINT, unavailable_reason
from bench.reference.rabbitmq_workloads import FIXED_RATE, WORKLOADS, format_table, run_reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (about a minute in all)")
    parser.add_argument(
        "--only", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)} (W3 runs last)"
    )
    parser.add_argument("--rate", type=float, default=FIXED_RATE, help="the fixed rate of W2@rate and W3, msgs/s")
    parser.add_argument("--json", type=Path, help="also write the report to this file as JSON")
    args = parser.parse_args(argv)
    problem = unavailable_reason()
    if problem is not None:
        print(f"cannot run the RabbitMQ reference: {problem}; {SETUP_HINT}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the cluster's context manager stops every node
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(128 + signal.SIGTERM))
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    began = time.monotonic()
    load = os.getloadavg()
    report = run_reference(
        quick=args.quick,
        only=only,
        rate=args.rate,
        progress=lambda message: print(f"[reference] {message}", file=sys.stderr, flush=True),
    )
    print(f"RabbitMQ {report.rabbitmq_version} on Erlang/OTP {report.erlang_version}, {report.nodes} nodes")
    print(report.setup)
    print(f"load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    print(format_table(report.results))
    print(f"({time.monotonic() - began:.0f} s in all)")
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
