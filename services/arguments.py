"""Command-line arguments shared by every ringq command (node, CLI, launcher).

Responsible for: the one rule for a node id and for a HOST:PORT address,
argparse types built on them, and a parser that reports a usage error as
one line (`PROG: error: ...`, exit 2), never a usage dump or a traceback.
"""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ADDRESS = re.compile(r"(?P<host>[^\s:][^\s]*):(?P<port>[0-9]{1,5})")
RESERVED_NODE_IDS = ("coordinator",)


def node_id_problem(node_id: str) -> str | None:
    """Why `node_id` cannot name a node (it also names files and log lines), or None."""
    if node_id in RESERVED_NODE_IDS:
        return f"node id must not be {node_id!r}"
    if not _NODE_ID.fullmatch(node_id):
        return (
            f"node id must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit (got {node_id!r})"
        )
    return None


def address_problem(address: str) -> str | None:
    """Why `address` is not HOST:PORT (host non-empty, port 0..65535), or None."""
    match = _ADDRESS.fullmatch(address)
    if match is None:
        return f"expected HOST:PORT, got {address!r}"
    if int(match["port"]) > 65535:
        return f"port must be between 0 and 65535, got {match['port']}"
    return None


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, `PROG: error: ...`, exit 2.

    `error_prefix` replaces PROG (a command's subcommands report as the command).
    """

    error_prefix: str | None = None

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.error_prefix or self.prog}: error: {' '.join(message.split())}\n")


def address_argument(text: str) -> str:
    """argparse type: a HOST:PORT address."""
    problem = address_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def addresses_argument(text: str) -> str:
    """argparse type: one or more HOST:PORT addresses, comma-separated (kept as given)."""
    addresses = [a.strip() for a in text.split(",")]
    for address in addresses:
        problem = address_problem(address)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
    return ",".join(addresses)


def node_id_argument(text: str) -> str:
    """argparse type: a node id."""
    problem = node_id_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text
