"""The `ringq` command: run a coordinator or a node in the foreground, or manage a local cluster.

    ringq coordinator [--listen HOST:PORT] [--ready-file PATH] [--store sqlite] [--db PATH]
    ringq coordinator [--listen HOST:PORT] [--ready-file PATH] --store zookeeper --zookeeper HOSTS [--zookeeper-root Z]
    ringq node --id ID --coordinator HOST:PORT [--listen HOST:PORT] [--advertise HOST:PORT] [--ready-file PATH]
               [--data-dir DIR] [--trace-dir DIR] [--log-level L] [timing flags]
    ringq cluster up --nodes N --dir DIR [--base-port P] [--timeout S] [--tls] [--resume | --fresh]
    ringq certs ca|node|coordinator|user --dir DIR [--id NODE_ID] [--name USER] [--host NAME ...]
    ringq cluster status --dir DIR
    ringq cluster down --dir DIR [--timeout S]

Bad usage exits 2 with one line on stderr (`ringq: error: ...`); a cluster operation that fails exits 1
with one line (`ringq: ...`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from services import certs, cluster
from services.arguments import OneLineParser, address_argument, node_id_argument

_Handler = Callable[[argparse.Namespace], int]


class _Parser(OneLineParser):
    """Every ringq subcommand reports usage errors as `ringq: error: ...`."""

    error_prefix = "ringq"


class _UsageError(Exception):
    """A problem with the arguments found after parsing; reported like an argparse error."""


def _port(text: str) -> int:
    if not text.isascii() or not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port between 0 and 65535, got {text!r}")
    return int(text)


def _node_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of nodes, got {text!r}") from None
    if not 1 <= count <= cluster.MAX_NODES:
        raise argparse.ArgumentTypeError(f"must be between 1 and {cluster.MAX_NODES}, got {count}")
    return count


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _node_id(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"expected a node id without spaces, got {text!r}")
    return text


# ---------------------------------------------------------------------------------------------- handlers


def _run_coordinator(args: argparse.Namespace) -> int:
    from services.coordinator.__main__ import main as coordinator_main

    argv = ["--listen", args.listen, "--store", args.store]
    for flag, value in (
        ("--db", args.db),
        ("--zookeeper", args.zookeeper),
        ("--zookeeper-root", args.zookeeper_root),
        ("--ready-file", args.ready_file),
        ("--tls-ca", args.tls_ca),
        ("--tls-cert", args.tls_cert),
        ("--tls-key", args.tls_key),
        ("--default-user", args.default_user),
        ("--max-queues-per-vhost", args.max_queues_per_vhost),
    ):
        if value is not None:
            argv += [flag, value]
    coordinator_main(argv, prog="ringq")
    return 0


_NODE_FLAGS = (
    "listen",
    "coordinator",
    "ready_file",
    "advertise",
    "flush_interval_ms",
    "heartbeat_interval_ms",
    "failure_timeout_ms",
    "grace_ms",
    "membership_check_ms",
    "recovery_wait_ms",
    "data_dir",
    "trace_dir",
    "log_level",
    "cluster_listen",
    "cluster_advertise",
    "certificate_listen",
    "tls_ca",
    "tls_cert",
    "tls_key",
)


def _run_node(args: argparse.Namespace) -> int:
    argv = ["--id", args.id]
    for field in _NODE_FLAGS:
        value = getattr(args, field)
        if value is not None:
            argv += [f"--{field.replace('_', '-')}", str(value)]
    try:
        module = importlib.import_module("services.node")
    except ModuleNotFoundError as exc:
        if exc.name not in ("services.node", "services"):
            raise
        raise cluster.ClusterError("the broker node (services.node) is not available in this installation") from exc
    node_main = cast(Callable[[list[str] | None], int | None], module.main)
    return node_main(argv) or 0


def _cluster_up(args: argparse.Namespace) -> int:
    if args.base_port and args.base_port + args.nodes > 65535:
        raise _UsageError(f"--base-port {args.base_port} leaves no room for {args.nodes} nodes below port 65536")
    state = cluster.RESUME if args.resume else cluster.FRESH if args.fresh else cluster.NEW
    info = cluster.up(args.nodes, args.dir, base_port=args.base_port, timeout=args.timeout, tls=args.tls, state=state)
    width = max(len(p.name) for p in info.processes)
    for process in info.processes:
        print(f"{process.name:<{width}}  pid {process.pid:<7}  {process.address}")
    print(f"logs: {info.logs}")
    if info.tls:
        print(f"TLS: clients trust {certs.ca_paths(info.tls_dir).certificate}")
    return 0


def _certs(args: argparse.Namespace) -> int:
    hosts = args.host or list(certs.DEFAULT_HOSTS)
    if args.kind == "ca":
        issued = certs.ensure_ca(args.dir)
    elif args.kind == "coordinator":
        issued = certs.issue_coordinator(args.dir, hosts)
    elif args.kind == "user":
        if args.name is None:
            raise _UsageError("ringq certs user needs --name USER")
        issued = certs.issue_user(args.dir, args.name)
    else:
        if args.id is None:
            raise _UsageError("ringq certs node needs --id NODE_ID")
        issued = certs.issue_node(args.dir, args.id, hosts)
    print(f"certificate {issued.certificate}")
    print(f"key         {issued.key}")
    print(f"CA          {certs.ca_paths(Path(args.dir)).certificate}")
    return 0


def _cluster_status(args: argparse.Namespace) -> int:
    rows = [("NAME", "PID", "ADDRESS", "ALIVE")]
    rows += [(p.name, str(p.pid), p.address, "yes" if alive else "no") for p, alive in cluster.status(args.dir)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _cluster_down(args: argparse.Namespace) -> int:
    stopped = cluster.down(args.dir, timeout=args.timeout)
    print(f"stopped {', '.join(stopped)}" if stopped else f"nothing running in {args.dir.resolve()}")
    return 0


# ---------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The `ringq` argument parser; each leaf command sets `handler`."""
    parser = _Parser(prog="ringq", description="ringq: a strictly ordered message broker.", allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(group: Any, name: str, help_text: str, handler: _Handler | None) -> argparse.ArgumentParser:
        sub = cast(argparse.ArgumentParser, group.add_parser(name, help=help_text, allow_abbrev=False))
        if handler is not None:
            sub.set_defaults(handler=handler)
        return sub

    coordinator = command(commands, "coordinator", "run the coordinator in the foreground", _run_coordinator)
    coordinator.add_argument(
        "--listen", type=address_argument, default="127.0.0.1:7000", help="HOST:PORT (port 0: any)"
    )
    coordinator.add_argument("--store", choices=("sqlite", "zookeeper"), default="sqlite", help="where records live")
    coordinator.add_argument("--db", help="sqlite: the SQLite file (created if absent; default coordinator.db)")
    coordinator.add_argument("--zookeeper", metavar="HOSTS", help="zookeeper: the ensemble, HOST:PORT[,HOST:PORT...]")
    coordinator.add_argument("--zookeeper-root", metavar="ZNODE", help="zookeeper: the root znode (default /ringq)")
    coordinator.add_argument("--ready-file", help="write the bound HOST:PORT here once listening")
    coordinator.add_argument(
        "--default-user", help="a new cluster's administrator (default guest; password: $RINGQ_DEFAULT_PASSWORD)"
    )
    coordinator.add_argument("--max-queues-per-vhost", metavar="N", help="queues one vhost may have (default 20000)")
    _tls_arguments(coordinator)

    node = command(commands, "node", "run a broker node in the foreground", _run_node)
    node.add_argument("--id", required=True, type=_node_id, help="this node's id")
    node.add_argument("--listen", type=address_argument, default="127.0.0.1:7001", help="HOST:PORT (port 0: any)")
    node.add_argument("--coordinator", required=True, type=address_argument, help="the coordinator's HOST:PORT")
    node.add_argument("--ready-file", help="write the bound HOST:PORT here once serving")
    node.add_argument("--flush-interval-ms", type=_positive_int, metavar="N")
    node.add_argument("--heartbeat-interval-ms", type=_positive_int, metavar="N")
    node.add_argument("--failure-timeout-ms", type=_positive_int, metavar="N")
    node.add_argument("--grace-ms", type=_positive_int, metavar="N")
    node.add_argument("--membership-check-ms", type=_positive_int, metavar="N")
    node.add_argument("--recovery-wait-ms", type=_positive_int, metavar="N")
    node.add_argument("--advertise", type=address_argument, help="HOST:PORT peers and clients dial (default --listen)")
    node.add_argument("--data-dir", help="where durable queues keep their messages (default data/ID)")
    node.add_argument("--trace-dir", help="also write spans as JSON lines here (docs/observability.md)")
    node.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    node.add_argument("--cluster-listen", type=address_argument, help="with TLS: HOST:PORT for cluster members")
    node.add_argument("--cluster-advertise", type=address_argument, help="with TLS: HOST:PORT members should dial")
    node.add_argument(
        "--certificate-listen", type=address_argument, help="with TLS: HOST:PORT for clients with a user certificate"
    )
    _tls_arguments(node)

    issue = command(
        commands, "certs", "make a cluster CA and member certificates (development; docs/security.md)", _certs
    )
    issue.add_argument(
        "kind", choices=("ca", "node", "coordinator", "user"), help="what to make (the CA is made if missing)"
    )
    issue.add_argument("--dir", required=True, type=Path, metavar="DIR", help="where the CA and certificates live")
    issue.add_argument("--id", type=node_id_argument, help="node: its id")
    issue.add_argument("--name", metavar="USER", help="user: the user the certificate authenticates as")
    issue.add_argument(
        "--host",
        action="append",
        metavar="NAME",
        help="a host name or IP clients dial (repeat; default localhost, 127.0.0.1)",
    )

    local = command(commands, "cluster", "start, inspect or stop a local cluster on 127.0.0.1", None)
    actions = local.add_subparsers(dest="action", required=True, metavar="ACTION")
    start = command(actions, "up", "start a coordinator and N nodes", _cluster_up)
    start.add_argument("--nodes", required=True, type=_node_count, metavar="N", help=f"1..{cluster.MAX_NODES}")
    start.add_argument(
        "--base-port", type=_port, default=0, metavar="P", help="coordinator on P, node k on P+k (0: any free)"
    )
    start.add_argument(
        "--timeout", type=_seconds, default=20.0, metavar="S", help="seconds to wait for every process to be ready"
    )
    start.add_argument("--tls", action="store_true", help="make certificates in DIR/tls and run with mutual TLS")
    earlier = start.add_mutually_exclusive_group()
    earlier.add_argument("--resume", action="store_true", help="start on DIR's earlier state (queues, users, ...)")
    earlier.add_argument("--fresh", action="store_true", help="delete DIR's earlier state first (keeps DIR/tls)")
    stop = command(actions, "down", "stop the cluster (SIGTERM, then SIGKILL)", _cluster_down)
    stop.add_argument("--timeout", type=_seconds, default=10.0, metavar="S", help="seconds to wait before SIGKILL")
    show = command(actions, "status", "show each process and whether it is alive", _cluster_status)
    for sub in (start, stop, show):
        sub.add_argument("--dir", required=True, type=Path, metavar="DIR", help="the cluster's directory")
    return parser


def _tls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", metavar="PEM", help="the cluster CA certificate")
    parser.add_argument("--tls-cert", metavar="PEM", help="this member's certificate")
    parser.add_argument("--tls-key", metavar="PEM", help="this member's private key")


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ringq` with `argv` (default: sys.argv[1:]); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = cast(_Handler, args.handler)
    try:
        return handler(args)
    except _UsageError as exc:
        parser.error(str(exc))
    except cluster.ClusterError as exc:
        print(f"ringq: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"ringq: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
