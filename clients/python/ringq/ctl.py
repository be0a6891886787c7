"""`ringqctl`: administer a ringq cluster through its coordinator.

    ringqctl [--coordinator HOST:PORT[,HOST:PORT...]] [--json] COMMAND ...

Commands: cluster_status, set_policy, clear_policy, list_policies,
list_queues, list_leases. Human tables by default, `--json` for scripts.
Errors print one line with the gRPC status and message and exit 1; usage
errors exit 2. With several coordinators, each is tried in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import json_format

from ringq.v1 import coordinator_pb2, coordinator_pb2_grpc

DEFAULT_COORDINATOR = os.environ.get("RINGQ_COORDINATOR", "127.0.0.1:7000")
T = TypeVar("T")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"ringqctl: error: {' '.join(message.split())}\n")


class Coordinators:
    """Calls the first coordinator that answers, in the order given."""

    def __init__(self, addresses: Sequence[str], timeout: float = 5.0) -> None:
        self.addresses = list(addresses)
        self.timeout = timeout

    def call(
        self, method: Callable[[coordinator_pb2_grpc.CoordinatorServiceStub], Callable[..., T]], request: Any
    ) -> T:
        last: grpc.RpcError | None = None
        for address in self.addresses:
            with grpc.insecure_channel(address) as channel:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
                try:
                    return method(stub)(request, timeout=self.timeout)
                except grpc.RpcError as error:
                    if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
                    last = error
        assert last is not None
        raise last


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def _as_json(message: Any) -> Any:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _definition_text(definition_json: str) -> str:
    try:
        definition = json.loads(definition_json or "{}")
    except ValueError:
        return definition_json
    return " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in sorted(definition.items()))


def cluster_status(c: Coordinators, args: argparse.Namespace) -> tuple[Any, str]:
    status = c.call(lambda s: s.ClusterStatus, coordinator_pb2.ClusterStatusRequest())
    now = time.time() * 1000
    rows = [
        [
            n.node,
            n.address,
            "yes" if n.alive else "NO",
            "yes" if n.draining else "no",
            f"{(now - n.last_heartbeat_unix_ms) / 1000:.1f}s ago" if n.last_heartbeat_unix_ms else "never",
        ]
        for n in status.nodes
    ]
    text = _table(rows, ["node", "address", "alive", "draining", "last heartbeat"])
    coordinators = ", ".join(f"{e.address} ({'alive' if e.alive else 'not answering'})" for e in status.coordinators)
    text += f"\n\nstore: {status.store_kind}; coordinators: {coordinators or 'none registered'}"
    return _as_json(status), text


def set_policy(c: Coordinators, args: argparse.Namespace) -> tuple[Any, str]:
    policy = coordinator_pb2.Policy(
        vhost=args.vhost,
        name=args.name,
        pattern=args.pattern,
        definition_json=args.definition,
        priority=args.priority,
        apply_to=args.apply_to,
    )
    response = c.call(lambda s: s.SetPolicy, coordinator_pb2.SetPolicyRequest(policy=policy))
    return _as_json(
        response
    ), f"policy {args.name!r} set in vhost {args.vhost!r}; {response.queues_changed} queue(s) changed"


def clear_policy(c: Coordinators, args: argparse.Namespace) -> tuple[Any, str]:
    request = coordinator_pb2.ClearPolicyRequest(vhost=args.vhost, name=args.name)
    response = c.call(lambda s: s.ClearPolicy, request)
    return _as_json(response), f"policy {args.name!r} cleared; {response.queues_changed} queue(s) changed"


def list_policies(c: Coordinators, args: argparse.Namespace) -> tuple[Any, str]:
    response = c.call(lambda s: s.ListPolicies, coordinator_pb2.ListPoliciesRequest(vhost=args.vhost or ""))
    rows = [
        [p.vhost, p.name, p.pattern, p.apply_to, str(p.priority), _definition_text(p.definition_json)]
        for p in response.policies
    ]
    return _as_json(response), _table(rows, ["vhost", "name", "pattern", "apply-to", "priority", "definition"])


def list_queues(c: Coordinators, args: argparse.Namespace) -> tuple[Any, str]:
    response = c.call(lambda s: s.ListQueues, coordinator_pb2.ListQueuesRequest(vhost=args.vhost or ""))
    rows = [
        [
            q.vhost,
            q.name,
            q.master,
            ",".join(q.mirrors) or "-",
            ",".join(q.synchronised_mirrors) or "-",
            q.policy or "-",
        ]
        for q in response.queues
    ]
    return _as_json(response), _table(rows, ["vhost", "name", "master", "mirrors", "synchronised", "policy"])


def list_leases(c: Coordinators, args: argparse.Namespace) -> tuple[Any, str]:
    response = c.call(lambda s: s.ListLeases, coordinator_pb2.ListLeasesRequest())
    now = time.time() * 1000
    rows = [
        [
            lease.name,
            lease.holder or "-",
            str(lease.token),
            f"{(lease.expires_at_unix_ms - now) / 1000:.1f}s" if lease.holder else "-",
        ]
        for lease in response.leases
    ]
    return _as_json(response), _table(rows, ["name", "holder", "token", "expires in"])


def parser() -> argparse.ArgumentParser:
    out = _Parser(prog="ringqctl", description="Administer a ringq cluster.", allow_abbrev=False)
    out.add_argument(
        "--coordinator",
        default=DEFAULT_COORDINATOR,
        help="HOST:PORT of coordinators, comma-separated (default $RINGQ_COORDINATOR or 127.0.0.1:7000)",
    )
    out.add_argument("--json", action="store_true", help="print JSON instead of a table")
    out.add_argument("--timeout", type=float, default=5.0, help="seconds per call (default 5)")
    commands = out.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Callable[[Coordinators, argparse.Namespace], tuple[Any, str]], text: str) -> Any:
        sub = commands.add_parser(name, help=text, description=text)
        sub.set_defaults(run=run)
        return sub

    command("cluster_status", cluster_status, "nodes, their liveness, coordinators and the store kind")
    sub = command("set_policy", set_policy, "create or replace a policy, applied to existing queues at once")
    sub.add_argument("-p", "--vhost", default="/", help="vhost (default /)")
    sub.add_argument("name")
    sub.add_argument("pattern", help="regular expression searched in queue names")
    sub.add_argument("definition", help='JSON object, e.g. \'{"ha-mode":"exactly","ha-params":2}\'')
    sub.add_argument("--priority", type=int, default=0)
    sub.add_argument("--apply-to", default="queues", choices=["queues", "all"])
    sub = command("clear_policy", clear_policy, "delete a policy")
    sub.add_argument("-p", "--vhost", default="/")
    sub.add_argument("name")
    for name, run, text in (
        ("list_policies", list_policies, "list policies"),
        ("list_queues", list_queues, "list queues: master, mirrors, synchronised mirrors, policy"),
    ):
        sub = command(name, run, text)
        sub.add_argument("-p", "--vhost", default="", help="only this vhost")
    command("list_leases", list_leases, "list leases: holder, fencing token, expiry")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    coordinators = Coordinators([a.strip() for a in args.coordinator.split(",") if a.strip()], args.timeout)
    try:
        as_json, text = args.run(coordinators, args)
    except grpc.RpcError as error:
        print(f"ringqctl: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    print(json.dumps(as_json, indent=2, sort_keys=True) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
