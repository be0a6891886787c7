"""`make demo-ring`: a local 3-node GM ring, traffic through a member kill, and what each member delivered.

Starts a coordinator and three nodes on 127.0.0.1 (in var/demo-ring), joins one
member per node, has the members on node1 and node2 broadcast numbered
messages with confirms for about ten seconds, kills node3 with SIGKILL half
way, and prints, per surviving member, what it delivered from each publisher
and whether anything was missing, duplicated or out of order. Stops the
cluster at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import sys
import time
from pathlib import Path

from ringq.group import DeliveryCheck, GroupMembership
from services import cluster

NODE_ARGS = [
    "--failure-timeout-ms",
    "600",
    "--heartbeat-interval-ms",
    "100",
    "--grace-ms",
    "100",
    "--log-level",
    "WARNING",
]
GROUP = "demo"


async def _publish(membership: GroupMembership, stop: asyncio.Event, confirmed: list[int]) -> None:
    sequence = 0
    while not stop.is_set():
        bodies = [f"{membership.member_id} message {sequence + k}".encode() for k in range(50)]
        _, last = await membership.broadcast(bodies, confirmed=True)
        sequence += len(bodies)
        confirmed[0] = last
        await asyncio.sleep(0.01)


async def _run(directory: Path, seconds: float) -> int:
    info = cluster.up(3, directory, node_args=NODE_ARGS)
    print(
        f"cluster up in {directory}: coordinator {info.coordinator.address}, "
        + ", ".join(f"{n.name} {n.address}" for n in info.nodes)
    )
    members = {node.name: await GroupMembership.join(node.address, GROUP) for node in info.nodes}
    for name, membership in members.items():
        print(f"  {name}: member {membership.member_id} joined (view {membership.joined.view_version})")
    checks = {name: DeliveryCheck(m.joined) for name, m in members.items()}
    followers = [asyncio.ensure_future(checks[name].follow(m)) for name, m in members.items()]
    stop = asyncio.Event()
    confirmed = {name: [0] for name in ("node1", "node2")}
    publishers = [asyncio.ensure_future(_publish(members[name], stop, confirmed[name])) for name in confirmed]
    started = time.monotonic()
    killed = False
    while (elapsed := time.monotonic() - started) < seconds:
        if not killed and elapsed > seconds / 2:
            cluster.kill(directory, "node3", signal.SIGKILL)
            killed = True
            print(f"\n  SIGKILL node3 (member {members['node3'].member_id}) at {elapsed:.1f}s")
        line = "  ".join(f"{name} delivered {check.delivered:>7,}" for name, check in checks.items())
        print(f"\r  {elapsed:4.1f}s  confirmed {sum(c[0] for c in confirmed.values()):>7,}  {line}", end="", flush=True)
        await asyncio.sleep(0.2)
    stop.set()
    await asyncio.gather(*publishers)
    survivors = {name: checks[name] for name in ("node1", "node2")}
    publisher_ids = {members[name].member_id: name for name in confirmed}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(
        all(check.last.get(pid, 0) >= confirmed[name][0] for pid, name in publisher_ids.items())
        and members["node3"].member_id in check.deaths
        for check in survivors.values()
    ):
        await asyncio.sleep(0.05)
    print("\n\nWhat each surviving member delivered:")
    failures = 0
    for name, check in survivors.items():
        parts = []
        for pid, publisher in publisher_ids.items():
            parts.append(f"from {publisher} #{check.start_after.get(pid, 0) + 1}..#{check.last.get(pid, 0)}")
        dead = "reported" if members["node3"].member_id in check.deaths else "NOT reported"
        problems = f"{len(check.problems)} problems" if check.problems else "no hole, no duplicate, in order"
        print(f"  {name}: {check.delivered:,} messages ({'; '.join(parts)}); {problems}; node3's death {dead}")
        failures += len(check.problems) + (dead != "reported")
    for publisher, name in publisher_ids.items():
        print(f"  {name} published and had confirmed {confirmed[name][0]:,} messages ({publisher})")
    lasts = {tuple(check.last.get(pid, 0) for pid in publisher_ids) for check in survivors.values()}
    same = len(lasts) == 1
    print(f"  survivors agree on every publisher's sequence: {'yes' if same else 'NO'}")
    for membership in (members["node1"], members["node2"]):
        await membership.close()
    for follower in followers:
        follower.cancel()
    return 0 if failures == 0 and same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo-ring", description=__doc__)
    parser.add_argument("--dir", type=Path, default=Path("var/demo-ring"), help="cluster directory")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to publish (default 10)")
    args = parser.parse_args(argv)
    cluster.down(args.dir)
    shutil.rmtree(args.dir, ignore_errors=True)
    try:
        code = asyncio.run(_run(args.dir, args.seconds))
    finally:
        stopped = cluster.down(args.dir)
        print(f"cluster down ({', '.join(stopped)} stopped); logs in {args.dir / 'logs'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
