"""`make sim-queues SEEDS=N`: run N seeded simulations of a mirrored durable queue (tests/sim/queue_sim.py).

A failing seed is printed with its error; replay it with `--seed S` (`--trace` prints every effect of
every replica, the record's changes and the faults).
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.sim.queue_sim import QueueSimulation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make sim-queues", description=__doc__)
    parser.add_argument("--seeds", type=int, default=2000, help="how many seeds to run (default 2000)")
    parser.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seed", type=int, help="replay one seed")
    parser.add_argument("--trace", action="store_true", help="print what happens (with --seed)")
    args = parser.parse_args(argv)
    seeds = [args.seed] if args.seed is not None else range(args.first, args.first + args.seeds)
    started = time.monotonic()
    checked = events = confirmed = deliveries = duplicates = given_up_runs = given_up = 0
    failures = 0
    for seed in seeds:
        simulation = QueueSimulation(seed)
        simulation.trace = args.trace
        try:
            simulation.run()
        except AssertionError as error:
            failures += 1
            print(f"FAIL {error}", file=sys.stderr)
            continue
        checked += 1
        events += simulation.scheduler.events
        confirmed += len(simulation.checker.confirmed)
        deliveries += simulation.checker.deliveries
        duplicates += simulation.checker.duplicates
        lost = len(simulation.checker.confirmed - set(simulation.checker.delivered))
        given_up_runs += 1 if lost else 0
        given_up += lost
    elapsed = time.monotonic() - started
    print(
        f"checked {checked} seeds ({failures} failed): {events} events, {confirmed} confirmed messages, "
        f"{deliveries} deliveries ({duplicates} duplicates of resent publishes) in {elapsed:.1f}s; "
        f"{given_up} confirmed messages given up in {given_up_runs} runs whose recovery wait ran out "
        "before every listed replica was back, the others' disks damaged"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
