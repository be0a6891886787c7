"""A real ZooKeeper server for tests: Debian's `zookeeper` package, on 127.0.0.1.

Responsible for: starting a standalone ZooKeeper (QuorumPeerMain) with its own
temporary data directory on a free 127.0.0.1 port, waiting until it accepts a
kazoo session, and stopping it (SIGTERM, then SIGKILL) and removing the
directory. The admin server is disabled; the JVM is also killed if the test
process dies first (Linux: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

JAVA = shutil.which("java") or "/usr/bin/java"
JARS = Path("/usr/share/java")
# zookeeper.jar's manifest Class-Path names its dependencies (zookeeper-jute, netty, slf4j-api, ...);
# slf4j-simple gives slf4j somewhere to log (our log file) instead of warning that it has nowhere.
ZOOKEEPER_JAR = JARS / "zookeeper.jar"
LOGGER_JAR = JARS / "slf4j-simple.jar"
MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
JVM_FLAGS = ("-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Djava.net.preferIPv4Stack=true")
SETUP_HINT = "run `make setup-zookeeper` (installs Debian's zookeeper package)"
RESTART_PAUSE = 1.0
START_TIMEOUT = 30.0
STOP_GRACE = 10.0


def unavailable_reason() -> str | None:
    """Why a ZooKeeper server cannot be started here, or None."""
    if not (os.path.isfile(JAVA) and os.access(JAVA, os.X_OK)):
        return f"no java found (looked for {JAVA})"
    if not ZOOKEEPER_JAR.is_file():
        return f"ZooKeeper is not installed ({ZOOKEEPER_JAR} is missing)"
    return None


def zookeeper_available() -> bool:
    """True when java and the ZooKeeper jar are present."""
    return unavailable_reason() is None


def classpath() -> str:
    jars = [ZOOKEEPER_JAR] + ([LOGGER_JAR] if LOGGER_JAR.is_file() else [])
    return ":".join(str(jar) for jar in jars)


def java_command(config: Path) -> list[str]:
    """The command line that runs a ZooKeeper server with `config`."""
    return [JAVA, *JVM_FLAGS, "-cp", classpath(), MAIN_CLASS, str(config)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """In the child before exec: be killed when the process that started us dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ZooKeeperServer:
    """One standalone ZooKeeper. `start` may be called again after `stop`: same port, same data."""

    def __init__(self) -> None:
        self.directory: Path | None = None
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def config(self) -> Path:
        assert self.directory is not None
        return self.directory / "zoo.cfg"

    def start(self, timeout: float = START_TIMEOUT) -> str:
        """Start the server and wait until it accepts a session; returns "127.0.0.1:PORT"."""
        problem = unavailable_reason()
        if problem is not None:
            raise RuntimeError(f"cannot start ZooKeeper: {problem}; {SETUP_HINT}")
        first_start = self.directory is None
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="ringq-zookeeper-"))
            (self.directory / "data").mkdir()
        deadline = time.monotonic() + timeout
        for attempt in range(3):
            if first_start:
                self.port = free_port()  # another process may take it before java binds: then retry
                self._write_config()
            self._launch()
            try:
                self._await_ready(deadline)
                return self.hosts
            except _ExitedEarly:
                if attempt == 2:
                    raise RuntimeError(f"ZooKeeper exited at start; its log ends:\n{self.log_tail()}") from None
                if not first_start:
                    # A restart keeps its port (clients are configured with it): the old server's socket
                    # may not be free yet on a loaded machine (seen under two CPU hogs): wait, try again.
                    time.sleep(RESTART_PAUSE)
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after STOP_GRACE seconds); keeps its data."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        """Stop the server and remove its directory."""
        try:
            self.stop()
        finally:
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
                self.directory = None

    def log_tail(self, lines: int = 30) -> str:
        if self.directory is None or not (self.directory / "zookeeper.log").exists():
            return "(no log)"
        text = (self.directory / "zookeeper.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _write_config(self) -> None:
        assert self.directory is not None
        self.config.write_text(
            "\n".join(
                [
                    "tickTime=500",
                    f"dataDir={self.directory / 'data'}",
                    "clientPortAddress=127.0.0.1",
                    f"clientPort={self.port}",
                    "admin.enableServer=false",
                    "maxClientCnxns=0",
                    "",
                ]
            )
        )

    def _launch(self) -> None:
        assert self.directory is not None
        self.stop()
        self._log = open(self.directory / "zookeeper.log", "ab")  # noqa: SIM115 (closed by stop)
        self.process = subprocess.Popen(
            java_command(self.config),
            cwd=self.directory,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )

    def _await_ready(self, deadline: float) -> None:
        from kazoo.client import KazooClient  # type: ignore[import-untyped]
        from kazoo.handlers.threading import KazooTimeoutError  # type: ignore[import-untyped]

        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise _ExitedEarly
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"ZooKeeper did not accept a session within the timeout; its log ends:\n{self.log_tail()}"
                )
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
            except OSError:
                time.sleep(0.05)
                continue
            # A server still starting accepts connections but does not answer: keep the wait short and retry.
            client = KazooClient(hosts=self.hosts, timeout=1.0, connection_retry={"max_tries": 0})
            try:
                client.start(timeout=1.5)
            except KazooTimeoutError:
                time.sleep(0.1)
                continue
            client.stop()
            client.close()
            return


class _ExitedEarly(Exception):
    """The server process exited before it accepted a session."""
