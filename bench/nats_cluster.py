"""A 3-server NATS JetStream cluster on 127.0.0.1 for `make bench-streams`.

Responsible for: starting Debian's `nats-server` (2.9.x, package nats-server; `make setup-nats`) as plain
processes under one temporary directory, each server with its own config file, JetStream store directory
and log; routes between the three on private ports; waiting until JetStream answers; finding a stream's
leader; SIGKILLing a server; stopping every process it started and removing the directory.

Isolation: client and route listeners bind 127.0.0.1 only, on ports picked from a free block (never
NATS's defaults 4222/6222/8222); no monitoring port; no system configuration is read (each server gets
`-c FILE` with everything in it).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from bench.reference.rabbitmq_cluster import free_port_block

HOST = "127.0.0.1"
NATS_SERVER = shutil.which("nats-server") or "/usr/bin/nats-server"
SETUP_HINT = "install Debian's nats-server: `make setup-nats` (apt-get install -y nats-server)"
CLUSTER_NAME = "ringq-bench"
START_TIMEOUT = 30.0


class NatsClusterError(RuntimeError):
    """The cluster could not be started."""


def unavailable_reason() -> str | None:
    """Why a NATS cluster cannot be started here, or None."""
    if not os.access(NATS_SERVER, os.X_OK):
        return f"{NATS_SERVER} is missing"
    return None


def server_version() -> str:
    """`nats-server --version`'s version ("2.9.10"), or "unknown"."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [NATS_SERVER, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
        return out.rsplit("v", 1)[-1] if out else "unknown"
    return "unknown"


@dataclass
class _Server:
    index: int
    name: str
    client_port: int
    route_port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    output: IO[bytes] | None = None
    killed: bool = False

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.client_port}"

    @property
    def log(self) -> Path:
        return self.directory / "server.log"


def config_text(server_name: str, client_port: int, route_port: int, routes: list[int], store: Path) -> str:
    """The configuration file of one server: loopback listeners, JetStream on `store`, routes to the others."""
    route_urls = ", ".join(f'"nats-route://{HOST}:{p}"' for p in routes)
    return "\n".join(
        [
            f'server_name: "{server_name}"',
            f'listen: "{HOST}:{client_port}"',
            "jetstream {",
            f'  store_dir: "{store}"',
            "}",
            "cluster {",
            f'  name: "{CLUSTER_NAME}"',
            f'  listen: "{HOST}:{route_port}"',
            f"  routes: [{route_urls}]",
            "}",
            "",
        ]
    )


class NatsCluster:
    """`size` nats-server processes with JetStream, clustered on 127.0.0.1; a context manager that stops them
    all (SIGTERM, then SIGKILL) and removes its directory."""

    def __init__(self, size: int = 3, *, start_timeout: float = START_TIMEOUT) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one server")
        self.size = size
        self.start_timeout = start_timeout
        self.directory: Path | None = None
        self.version = server_version()
        self._servers: list[_Server] = []
        self._atexit_registered = False

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self._servers]

    def index_of(self, name: str) -> int:
        for s in self._servers:
            if s.name == name:
                return s.index
        raise KeyError(name)

    def urls_from(self, first: int) -> list[str]:
        """Every server's URL, server `first`'s first (the clients' order)."""
        urls = self.urls
        return urls[first:] + urls[:first]

    def alive(self, i: int) -> bool:
        p = self._servers[i].process
        return p is not None and p.poll() is None

    def kill_server(self, i: int) -> float:
        """SIGKILL server i; returns time.monotonic() just before the signal."""
        server = self._servers[i]
        if server.process is None or server.process.poll() is not None:
            raise NatsClusterError(f"{server.name} is not running")
        at = time.monotonic()
        server.process.send_signal(signal.SIGKILL)
        server.killed = True
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(10)
        return at

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by the live servers together."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for s in self._servers:
            if s.process is None or s.process.poll() is not None:
                continue
            try:
                fields = Path(f"/proc/{s.process.pid}/stat").read_text().rsplit(")", 1)[-1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / ticks
        return total

    def log_tails(self, lines: int = 20) -> str:
        out = []
        for s in self._servers:
            try:
                tail = s.log.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                tail = ["(no log)"]
            out.append(f"--- {s.name}: {s.log}\n" + "\n".join(tail))
        return "\n".join(out)

    def pids(self) -> list[int]:
        return [s.process.pid for s in self._servers if s.process is not None and s.process.poll() is None]

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> Self:
        problem = unavailable_reason()
        if problem is not None:
            raise NatsClusterError(f"cannot start NATS: {problem}; {SETUP_HINT}")
        self.directory = Path(tempfile.mkdtemp(prefix="ringq-nats-"))
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        base = free_port_block(2 * self.size)
        route_ports = [base + 2 * i + 1 for i in range(self.size)]
        for i in range(self.size):
            directory = self.directory / f"n{i + 1}"
            (directory / "store").mkdir(parents=True)
            server = _Server(i, f"n{i + 1}", base + 2 * i, route_ports[i], directory)
            config = directory / "nats.conf"
            others = [p for j, p in enumerate(route_ports) if j != i]
            config.write_text(
                config_text(server.name, server.client_port, server.route_port, others, directory / "store")
            )
            server.output = open(server.log, "ab")  # noqa: SIM115 (closed by stop)
            server.process = subprocess.Popen(
                [NATS_SERVER, "-c", str(config)],
                cwd=directory,
                stdin=subprocess.DEVNULL,
                stdout=server.output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._servers.append(server)
        self._await_listening()
        return self

    def _await_listening(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        for s in self._servers:
            while True:
                assert s.process is not None
                if s.process.poll() is not None:
                    raise NatsClusterError(f"{s.name} exited with {s.process.returncode}\n{self.log_tails()}")
                with socket.socket() as sock:
                    sock.settimeout(0.5)
                    if sock.connect_ex((HOST, s.client_port)) == 0:
                        break
                if time.monotonic() > deadline:
                    raise NatsClusterError(
                        f"{s.name} did not listen within {self.start_timeout:g} s\n{self.log_tails()}"
                    )
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop every server (SIGTERM, then SIGKILL after 10 s) and remove the directory; idempotent."""
        for s in self._servers:
            p = s.process
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        for s in self._servers:
            p = s.process
            if p is None:
                continue
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait()
            if s.output is not None:
                s.output.close()
                s.output = None
        self._servers = []
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
