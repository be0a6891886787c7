"""Run the coordinator:

    python -m services.coordinator [--listen HOST:PORT] [--ready-file PATH] [--health-listen HOST:PORT]
        [--store sqlite] [--db PATH]
        --store zookeeper --zookeeper HOST:PORT[,HOST:PORT...] [--zookeeper-root /ZNODE]

Bad usage exits 2 with one line on stderr; a ZooKeeper that cannot be reached at start exits 1 with one line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from services import config, tls
from services.arguments import OneLineParser, address_argument, address_problem
from services.coordinator.server import DEFAULT_MAX_QUEUES_PER_VHOST, serve
from services.coordinator.store import StoreUnavailable

DEFAULT_DB = "./coordinator.db"
DEFAULT_ZOOKEEPER_ROOT = "/ringq"


def _hosts(text: str) -> str:
    """argparse type: a ZooKeeper connection string, HOST:PORT[,HOST:PORT...]."""
    for host in text.split(","):
        if address_problem(host) is not None:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT[,HOST:PORT...], got {text!r}")
    return text


def _znode(text: str) -> str:
    """argparse type: an absolute znode path such as /ringq."""
    parts = text.split("/")
    if len(text) < 2 or parts[0] or any(p in ("", ".", "..") for p in parts[1:]) or not text.isprintable():
        raise argparse.ArgumentTypeError(f"expected an absolute znode path such as /ringq, got {text!r}")
    return text


def _positive(text: str) -> int:
    """argparse type: a whole number from 1 to 10^9."""
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 10**9:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to 1000000000, got {text!r}")
    return int(text)


def build_parser(prog: str = "ringq coordinator") -> argparse.ArgumentParser:
    """The coordinator's flags (also from a --config file and RINGQ_* variables: services/config.py)."""
    parser = OneLineParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config.add_config_argument(parser)
    parser.add_argument("--listen", type=address_argument, default="127.0.0.1:7000", help="HOST:PORT (port 0: any)")
    parser.add_argument("--store", choices=("sqlite", "zookeeper"), default="sqlite", help="where records are kept")
    parser.add_argument("--db", help=f"sqlite: the SQLite file (created if absent; default {DEFAULT_DB})")
    parser.add_argument("--zookeeper", type=_hosts, metavar="HOSTS", help="zookeeper: the ensemble, HOST:PORT[,...]")
    parser.add_argument(
        "--zookeeper-root",
        type=_znode,
        metavar="ZNODE",
        help=f"zookeeper: the root znode (default {DEFAULT_ZOOKEEPER_ROOT})",
    )
    parser.add_argument("--ready-file", help="write the bound HOST:PORT here once listening")
    parser.add_argument(
        "--health-listen",
        type=address_argument,
        help="also serve the gRPC health service (grpc.health.v1.Health), and nothing else, in plaintext at "
        "HOST:PORT, for probes that cannot do mutual TLS: SERVING while the coordinator serves and reaches its store",
    )
    tls.add_arguments(parser)
    parser.add_argument(
        "--default-user",
        default="guest",
        help="the administrator a new cluster starts with (default guest, which is accepted from loopback only); "
        "its password is $RINGQ_DEFAULT_PASSWORD (default: the user's name)",
    )
    parser.add_argument(
        "--max-queues-per-vhost",
        type=_positive,
        default=DEFAULT_MAX_QUEUES_PER_VHOST,
        help=f"declaring more queues in a vhost gets RESOURCE_EXHAUSTED (default {DEFAULT_MAX_QUEUES_PER_VHOST})",
    )
    return parser


def main(argv: list[str] | None = None, *, prog: str = "python -m services.coordinator") -> None:
    """Run the coordinator with `argv`; `prog` starts usage errors (the ringq command passes "ringq coordinator")."""
    parser = build_parser(prog)
    args = config.parse(parser, argv)
    if args.store == "zookeeper":
        if args.zookeeper is None:
            parser.error("--store zookeeper needs --zookeeper HOST:PORT[,HOST:PORT...]")
        if args.db is not None:
            parser.error("--db applies only to --store sqlite")
    elif args.zookeeper is not None or args.zookeeper_root is not None:
        parser.error("--zookeeper and --zookeeper-root apply only to --store zookeeper")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")
    cluster_tls = tls.from_arguments(parser, args, args.listen)
    try:
        asyncio.run(
            serve(
                args.listen,
                (args.db or DEFAULT_DB) if args.store == "sqlite" else None,
                args.ready_file,
                store_kind=args.store,
                zookeeper_hosts=args.zookeeper,
                zookeeper_root=args.zookeeper_root or DEFAULT_ZOOKEEPER_ROOT,
                tls=cluster_tls,
                default_user=(args.default_user, os.environ.get("RINGQ_DEFAULT_PASSWORD", args.default_user)),
                max_queues_per_vhost=args.max_queues_per_vhost,
                health_listen=args.health_listen,
            )
        )
    except (StoreUnavailable, OSError) as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
