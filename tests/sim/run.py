"""`make sim SEEDS=N`: run N seeded ring simulations and print what was checked.

A failing seed is printed with its error; replay it with `--seed S`.
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.sim.simulator import Simulation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make sim", description=__doc__)
    parser.add_argument("--seeds", type=int, default=2000, help="how many seeds to run (default 2000)")
    parser.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seed", type=int, help="replay one seed")
    args = parser.parse_args(argv)
    seeds = [args.seed] if args.seed is not None else range(args.first, args.first + args.seeds)
    started = time.monotonic()
    checked = events = deliveries = 0
    failures: list[str] = []
    for seed in seeds:
        try:
            sim = Simulation(seed).run()
        except AssertionError as error:
            failures.append(str(error))
            print(f"FAIL {error}", file=sys.stderr)
            continue
        checked += 1
        events += sim.events
        deliveries += sim.checker.deliveries
    elapsed = time.monotonic() - started
    print(
        f"checked {checked} seeds ({len(failures)} failed): {events} events, {deliveries} deliveries in {elapsed:.1f}s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
