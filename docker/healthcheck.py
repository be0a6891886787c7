"""The image's HEALTHCHECK: is the ringq coordinator or node in this container healthy?

    python /opt/ringq/healthcheck.py [HOST:PORT]

When the ringq process running in this container (read from /proc) has `--health-listen`, the answer is
its gRPC health service's there (services/health_probe.py): healthy while SERVING, that is a coordinator
that reaches its store, a node registered, joined and not draining (docs/observability.md, Health).
docker/compose.yaml gives every member a health port and asks `python -m services.health_probe` itself.

Otherwise (no --health-listen, or an address given as the argument or $RINGQ_HEALTHCHECK_ADDRESS), a
connection check of that address, else of the process's `--listen`: healthy once an HTTP/2 connection is
up within TIMEOUT_SECONDS. A wildcard host (0.0.0.0, ::) is replaced by loopback. With TLS (the process
runs with --tls-ca, --tls-cert and --tls-key), that check completes a TLS handshake with the process's
own certificate, so it works on a coordinator's port too, which takes only cluster members; it proves
the gRPC server is listening and speaks HTTP/2, not that a node has registered or joined.

Exit 0 when healthy; otherwise exit 1 with one line on stderr, which Docker keeps in the health log
(`docker inspect --format '{{json .State.Health}}' NAME`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc

TIMEOUT_SECONDS = 3.0
ADDRESS_VARIABLE = "RINGQ_HEALTHCHECK_ADDRESS"
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


def listen_address(command_lines: Iterable[Sequence[str]], flag: str = "--listen") -> str | None:
    """The first `--listen HOST:PORT` (or `--listen=HOST:PORT`; or `flag`'s) in `command_lines`, a wildcard
    host made loopback."""
    for argv in command_lines:
        for position, argument in enumerate(argv):
            if argument == flag and position + 1 < len(argv):
                address = argv[position + 1]
            elif argument.startswith(f"{flag}="):
                address = argument.removeprefix(f"{flag}=")
            else:
                continue
            host, _, port = address.rpartition(":")
            return f"127.0.0.1:{port}" if host in _WILDCARD_HOSTS else address
    return None


def flag_value(command_lines: Iterable[Sequence[str]], flag: str) -> str | None:
    """The value of `flag` (`--flag V` or `--flag=V`) in the first command line that has it."""
    for argv in command_lines:
        for position, argument in enumerate(argv):
            if argument == flag and position + 1 < len(argv):
                return argv[position + 1]
            if argument.startswith(f"{flag}="):
                return argument.removeprefix(f"{flag}=")
    return None


def tls_files(command_lines: Sequence[Sequence[str]]) -> tuple[str, str, str] | None:
    """(CA, certificate, key) of the ringq process's --tls-* flags, or None if it runs plaintext."""
    files = [flag_value(command_lines, flag) for flag in ("--tls-ca", "--tls-cert", "--tls-key")]
    if any(f is None for f in files):
        return None
    ca, certificate, key = files
    assert ca is not None and certificate is not None and key is not None
    return ca, certificate, key


def process_command_lines(proc: Path = Path("/proc")) -> list[list[str]]:
    """The command lines of the other processes visible in `proc`, oldest (lowest pid) first."""
    pids = sorted(
        int(entry.name) for entry in proc.iterdir() if entry.name.isdigit() and int(entry.name) != os.getpid()
    )
    lines = []
    for pid in pids:
        try:
            raw = (proc / str(pid) / "cmdline").read_bytes()
        except OSError:  # gone since the listing, or not ours to read
            continue
        lines.append([part.decode(errors="replace") for part in raw.split(b"\0") if part])
    return lines


def probe(address: str, timeout: float = TIMEOUT_SECONDS, tls: tuple[str, str, str] | None = None) -> str | None:
    """None when a gRPC channel to `address` (TLS with `tls`' CA, certificate and key) becomes ready
    within `timeout` seconds, else why not."""
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        ca, certificate, key = (Path(path).read_bytes() for path in tls)
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, certificate))
    with channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            return f"no gRPC server answered at {address} within {timeout:g} s"
    return None


def main(argv: Sequence[str]) -> int:
    lines = process_command_lines()
    given = argv[0] if argv else os.environ.get(ADDRESS_VARIABLE)
    health = None if given else listen_address(lines, "--health-listen")
    address = given or listen_address(lines)
    if health is not None:
        from services.health_probe import problem as health_problem  # ringq-server, in the image's venv

        problem = health_problem(health, timeout=TIMEOUT_SECONDS)
    elif address is None:
        print(f"healthcheck: no process with --listen here; give HOST:PORT or set ${ADDRESS_VARIABLE}", file=sys.stderr)
        return 1
    else:
        # The TLS files of the process serving that address only (another process's would fail the handshake).
        serving = [line for line in lines if listen_address([line]) == address] if given else lines
        try:
            problem = probe(address, tls=tls_files(serving))
        except OSError as error:
            problem = f"cannot read the TLS files: {error}"
    if problem is not None:
        print(f"healthcheck: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
