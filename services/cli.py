"""The `ringq` command: run a coordinator or a node in the foreground, or manage a local cluster.

    ringq coordinator [FLAGS]        (ringq coordinator --help; also a --config file and RINGQ_* variables)
    ringq node --id ID --coordinator HOST:PORT [FLAGS]                    (ringq node --help; likewise)
    ringq cluster up --nodes N --dir DIR [--base-port P] [--timeout S] [--tls] [--resume | --fresh] [-- NODE_FLAGS]
    ringq certs ca|node|coordinator|user --dir DIR [--id NODE_ID] [--name USER] [--host NAME ...]
    ringq cluster status --dir DIR
    ringq cluster start|stop|kill NODE --dir DIR [--timeout S]
    ringq cluster down --dir DIR [--timeout S]

Bad usage exits 2 with one line on stderr (`ringq: error: ...`); a cluster operation that fails exits 1
with one line (`ringq: ...`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from ringq._version import __version__
from services import certs, cluster
from services.arguments import OneLineParser, node_id_argument

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


def _run_process(name: str, argv: list[str]) -> int:
    """`ringq node ...` and `ringq coordinator ...`: the process's own main, with its own flags, file and
    environment (services/config.py), so every setting exists once."""
    module_name = {"node": "services.node", "coordinator": "services.coordinator.__main__"}[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name not in (module_name, "services", "services.coordinator"):
            raise
        raise cluster.ClusterError(f"the {name} ({module_name}) is not available in this installation") from exc
    process_main = cast(Callable[..., int | None], module.main)
    return process_main(argv, prog=f"ringq {name}") or 0


def _cluster_up(args: argparse.Namespace) -> int:
    if args.base_port and args.base_port + args.nodes > 65535:
        raise _UsageError(f"--base-port {args.base_port} leaves no room for {args.nodes} nodes below port 65536")
    state = cluster.RESUME if args.resume else cluster.FRESH if args.fresh else cluster.NEW
    _check_node_args(args.node_args)
    info = cluster.up(
        args.nodes,
        args.dir,
        base_port=args.base_port,
        timeout=args.timeout,
        tls=args.tls,
        state=state,
        node_args=args.node_args,
    )
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


def parse_command(argv: Sequence[str]) -> argparse.Namespace:
    """`ringq ARGV` parsed as running it would parse it (node and coordinator by their own parsers, their
    settings in `command`'s namespace; no --config file or RINGQ_* variables are read): for tools that
    check command lines, such as the tests of docker/."""
    if argv and argv[0] in ("node", "coordinator"):
        if argv[0] == "node":
            from services.node import parser as process_parser
        else:
            from services.coordinator.__main__ import build_parser as process_parser
        parsed = process_parser(f"ringq {argv[0]}").parse_args(list(argv[1:]))
        parsed.command = argv[0]
        return parsed
    return build_parser().parse_args(list(argv))


def _check_node_args(node_args: Sequence[str]) -> None:
    """_UsageError unless every node would accept `node_args` (checked before anything starts)."""
    from services.node import parser as node_parser

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            node_parser("node flags").parse_args(["--id", "node1", "--coordinator", "127.0.0.1:1", *node_args])
    except SystemExit:
        raise _UsageError(said.getvalue().strip().removeprefix("node flags: error: ")) from None


def _cluster_node(args: argparse.Namespace) -> int:
    """ringq cluster start|stop|kill NODE --dir DIR."""
    if args.action == "start":
        if args.node == cluster.COORDINATOR:
            process = cluster.restart_coordinator(args.dir, timeout=args.timeout)
        else:
            process = cluster.start_node(args.dir, args.node, timeout=args.timeout)
        print(f"{process.name}  pid {process.pid}  {process.address}")
        return 0
    sig = signal.SIGTERM if args.action == "stop" else signal.SIGKILL
    if cluster.kill(args.dir, args.node, sig, timeout=args.timeout):
        print(f"{args.node} {'stopped' if args.action == 'stop' else 'killed'}")
    else:
        print(f"{args.node} was not running")
    return 0


def _cluster_down(args: argparse.Namespace) -> int:
    stopped = cluster.down(args.dir, timeout=args.timeout)
    print(f"stopped {', '.join(stopped)}" if stopped else f"nothing running in {args.dir.resolve()}")
    return 0


# ---------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The `ringq` argument parser; each leaf command sets `handler`."""
    parser = _Parser(prog="ringq", description="ringq: a strictly ordered message broker.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"ringq {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(group: Any, name: str, help_text: str, handler: _Handler | None) -> argparse.ArgumentParser:
        sub = cast(argparse.ArgumentParser, group.add_parser(name, help=help_text, allow_abbrev=False))
        if handler is not None:
            sub.set_defaults(handler=handler)
        return sub

    # Listed for help; main() hands their arguments to the process itself (_run_process).
    command(commands, "coordinator", "run the coordinator in the foreground (ringq coordinator --help)", None)
    command(commands, "node", "run a broker node in the foreground (ringq node --help)", None)

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
    start.add_argument(
        "node_args",
        nargs="*",
        metavar="NODE_FLAG",
        help="after --: flags for every node, e.g. -- --failure-timeout-ms 1000 (ringq node --help); "
        "kept for `cluster start`",
    )
    show = command(actions, "status", "show each process and whether it is alive", _cluster_status)
    one = [
        command(
            actions,
            "start",
            "start NODE again (a dead one), or a new node, with the cluster's node flags",
            _cluster_node,
        ),
        command(actions, "stop", "stop NODE (SIGTERM)", _cluster_node),
        command(actions, "kill", "kill NODE (SIGKILL)", _cluster_node),
    ]
    for sub in one:
        sub.add_argument("node", type=_node_id, metavar="NODE", help="a node id (or coordinator, to stop or kill it)")
        sub.add_argument("--timeout", type=_seconds, default=20.0, metavar="S", help="seconds to wait")
    for sub in (start, stop, show, *one):
        sub.add_argument("--dir", required=True, type=Path, metavar="DIR", help="the cluster's directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ringq` with `argv` (default: sys.argv[1:]); returns the exit code."""
    given = list(sys.argv[1:] if argv is None else argv)
    if given and given[0] in ("node", "coordinator"):
        try:
            return _run_process(given[0], given[1:])
        except cluster.ClusterError as exc:
            print(f"ringq: {exc.message}", file=sys.stderr)
            return 1
    parser = build_parser()
    args = parser.parse_args(given)
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
