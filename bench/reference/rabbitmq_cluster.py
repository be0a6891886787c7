"""A 3-node RabbitMQ cluster on 127.0.0.1 for the reference side of `make bench`.

Responsible for: starting Debian's `rabbitmq-server` (3.x) as plain processes (no
systemd, no service user) under one temporary directory, clustering the nodes,
setting the classic-mirroring policy, finding a queue's master, SIGKILLing a
node, and stopping every process it started (nodes and its own epmd).

Isolation, so that the cluster never touches a system RabbitMQ or anything else:
- all sockets are on 127.0.0.1 only: AMQP via `listeners.tcp.1`, Erlang
  distribution via `-kernel inet_dist_use_interface {127,0,0,1}` (nodes and the
  CLI tools), and a private epmd started here on its own port
  (`epmd -address 127.0.0.1 -port P`; ERL_EPMD_PORT points every node and every
  rabbitmqctl at it, so the default 4369 is never used);
- ports come from one block of free ports outside 5672/25672/4369/15672/35672;
- HOME is a temporary directory holding a private `.erlang.cookie` shared by
  the three nodes and rabbitmqctl; mnesia, logs, pid files, the config file,
  the enabled-plugins file (no plugins: management is not needed) and the
  rabbitmq-env.conf file all live under the temporary directory too; the
  caller's RABBITMQ_* and ERL_* variables are not passed on.

Node names are rabbit1@localhost .. rabbit3@localhost (short names: `localhost`
resolves to 127.0.0.1 here, and short names need no dot in the host part).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Self

RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")  # the real scripts; /usr/sbin's wrappers `su rabbitmq`
RABBITMQ_SERVER = RABBITMQ_BIN / "rabbitmq-server"
RABBITMQCTL = RABBITMQ_BIN / "rabbitmqctl"
EPMD = shutil.which("epmd") or "/usr/bin/epmd"
SETUP_HINT = "install Debian's RabbitMQ: `apt-get install -y rabbitmq-server`"
HOST = "127.0.0.1"
NODE_HOST = "localhost"
START_TIMEOUT = 90.0
CTL_TIMEOUT = 60.0
STOP_GRACE = 20.0
# Ports no cluster of ours may use: the defaults of a system RabbitMQ (AMQP, distribution,
# management, CLI distribution) and of epmd.
RESERVED_PORTS = frozenset({4369, 5671, 5672, 15672, 25672, *range(35672, 35683)})
CTL_PORTS = 11  # rabbitmqctl's own distribution listener picks one port from this range
# The mirroring policy of the reference: every queue named bench.* is a classic queue
# mirrored on all nodes, new mirrors synchronised automatically.
HA_POLICY_NAME = "ha-all"
HA_POLICY_PATTERN = r"^bench\."
HA_POLICY = {"ha-mode": "all", "ha-sync-mode": "automatic"}


class RabbitClusterError(RuntimeError):
    """The cluster could not be started, or a rabbitmqctl command failed."""


def unavailable_reason() -> str | None:
    """Why a RabbitMQ cluster cannot be started here, or None."""
    for path in (RABBITMQ_SERVER, RABBITMQCTL, Path(EPMD)):
        if not os.access(path, os.X_OK):
            return f"{path} is missing"
    return None


def rabbitmq_available() -> bool:
    return unavailable_reason() is None


def erlang_version() -> str:
    """The installed Erlang/OTP version, e.g. "25.2.3" (from the OTP_VERSION file)."""
    for path in sorted(Path("/usr/lib/erlang/releases").glob("*/OTP_VERSION")):
        return path.read_text().strip()
    return "unknown"


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def free_port_block(count: int, low: int = 20000, high: int = 32000) -> int:
    """The first port of `count` consecutive ports free on 127.0.0.1, below Linux's ephemeral range."""
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(low, high - count)
        block = range(base, base + count)
        if not RESERVED_PORTS.intersection(block) and all(_bindable(p) for p in block):
            return base
    raise RabbitClusterError(f"found no {count} consecutive free ports on {HOST} in [{low}, {high})")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({path} is not readable)"
    return "\n".join(text.splitlines()[-lines:])


def node_of_pid(pid: str) -> str:
    """The node name in an Erlang pid as rabbitmqctl prints it: "<rabbit2@localhost.1664.3.0>"."""
    match = re.fullmatch(r"<(.+@[^.]+(?:\.[^.]+)*?)\.\d+\.\d+\.\d+>", pid.strip())
    if match is None:
        raise ValueError(f"not an Erlang pid with a node name: {pid!r}")
    return match.group(1)


@dataclass
class QueueInfo:
    """Where a mirrored queue's master and mirrors are."""

    name: str
    master: str  # node name
    mirrors: list[str] = field(default_factory=list)
    synchronised: list[str] = field(default_factory=list)
    messages: int = 0


@dataclass
class _Node:
    index: int  # 0-based
    name: str
    amqp_port: int
    dist_port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    output: IO[bytes] | None = None
    killed: bool = False

    @property
    def log(self) -> Path:
        return self.directory / "log" / f"{self.name}.log"

    @property
    def console(self) -> Path:
        return self.directory / "console.log"

    @property
    def pid_file(self) -> Path:
        return self.directory / f"{self.name}.pid"

    @property
    def config(self) -> Path:
        return self.directory / "rabbitmq.conf"

    def beam_pid(self) -> int | None:
        try:
            text = self.pid_file.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def log_tails(self) -> str:
        return (
            f"--- {self.name}: {self.console} ends:\n{_tail(self.console)}\n"
            f"--- {self.name}: {self.log} ends:\n{_tail(self.log)}"
        )


class RabbitCluster:
    """A RabbitMQ cluster of `size` nodes on 127.0.0.1 with the ha-all classic-mirroring policy.

    Use as a context manager: entering starts and clusters the nodes (raising
    RabbitClusterError with the logs' tails if that fails within `start_timeout`),
    leaving stops them all and removes the directory (unless `keep_directory`).
    """

    def __init__(
        self,
        size: int = 3,
        *,
        start_timeout: float = START_TIMEOUT,
        keep_directory: bool = False,
        policy: bool = True,
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one node")
        self.size = size
        self.start_timeout = start_timeout
        self.keep_directory = keep_directory
        self.with_policy = policy
        self.directory: Path | None = None
        self.epmd_port = 0
        self.ctl_port_min = 0
        self.version = "unknown"
        self.erlang_version = erlang_version()
        self.policy_output = ""  # what set_policy printed (3.x warns that classic mirroring is deprecated)
        self._nodes: list[_Node] = []
        self._epmd: subprocess.Popen[bytes] | None = None
        self._epmd_log: IO[bytes] | None = None
        self._env: dict[str, str] = {}
        self._atexit_registered = False

    # --- what callers use -------------------------------------------------

    @property
    def amqp_ports(self) -> list[int]:
        return [n.amqp_port for n in self._nodes]

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self._nodes]

    @property
    def amqp_urls(self) -> list[str]:
        return [f"amqp://guest:guest@{HOST}:{p}/%2F" for p in self.amqp_ports]

    def node_index(self, name: str) -> int:
        for n in self._nodes:
            if n.name == name:
                return n.index
        raise KeyError(name)

    def alive(self, i: int) -> bool:
        node = self._nodes[i]
        return node.process is not None and node.process.poll() is None and not node.killed

    def kill_node(self, i: int) -> float:
        """SIGKILL node i's Erlang VM (beam.smp); returns time.monotonic() of the kill."""
        node = self._nodes[i]
        pid = node.beam_pid()
        if pid is None:
            raise RabbitClusterError(f"{node.name} has no pid file at {node.pid_file}")
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        node.killed = True
        if node.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(10)  # the rabbitmq-server shell script exits once its VM is gone
        return killed_at

    def ctl(self, i: int, *args: str, timeout: float = CTL_TIMEOUT, check: bool = True) -> str:
        """Run `rabbitmqctl -n <node i> ARGS`; returns its stdout (RabbitClusterError if it fails and `check`)."""
        node = self._nodes[i]
        try:
            done = subprocess.run(
                [str(RABBITMQCTL), "-q", "-n", node.name, *args],
                env=self._env,
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise RabbitClusterError(
                f"rabbitmqctl -n {node.name} {' '.join(args)} took over {timeout:.0f} s\n{node.log_tails()}"
            ) from exc
        out = done.stdout.decode(errors="replace")
        if check and done.returncode != 0:
            err = done.stderr.decode(errors="replace")
            raise RabbitClusterError(
                f"rabbitmqctl -n {node.name} {' '.join(args)} exited {done.returncode}:\n{out}{err}\n{node.log_tails()}"
            )
        return out

    def queue_info(self, queue: str, via: Sequence[int] | None = None) -> QueueInfo:
        """Where `queue`'s master and mirrors are, asked of the first live node in `via` (default: all)."""
        candidates = [i for i in (via if via is not None else range(self.size)) if self.alive(i)]
        last: Exception | None = None
        for i in candidates:
            try:
                # the table format names each pid's node ("<rabbit2@localhost.1795244663.1576.0>"); JSON does not
                out = self.ctl(
                    i,
                    "list_queues",
                    "name",
                    "pid",
                    "slave_pids",
                    "synchronised_slave_pids",
                    "messages",
                    "--no-table-headers",
                    timeout=20,
                )
            except RabbitClusterError as exc:
                last = exc
                continue
            for line in out.splitlines():
                cells = line.split("\t")
                if len(cells) == 5 and cells[0] == queue:
                    return QueueInfo(
                        name=queue,
                        master=node_of_pid(cells[1]),
                        mirrors=[node_of_pid(p) for p in _pid_list(cells[2])],
                        synchronised=[node_of_pid(p) for p in _pid_list(cells[3])],
                        messages=int(cells[4]) if cells[4].strip().isdigit() else 0,
                    )
            raise KeyError(f"no queue {queue!r} on the cluster")
        raise RabbitClusterError(f"no live node answered list_queues: {last}")

    def queue_master(self, queue: str) -> int:
        """The index of the node holding `queue`'s master."""
        return self.node_index(self.queue_info(queue).master)

    def log_tails(self) -> str:
        return "\n".join(n.log_tails() for n in self._nodes)

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by the live nodes' Erlang VMs together."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for node in self._nodes:
            pid = node.beam_pid()
            if pid is None or node.killed:
                continue
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14 and 15 of stat)
        return total

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> Self:
        problem = unavailable_reason()
        if problem is not None:
            raise RabbitClusterError(f"cannot start RabbitMQ: {problem}; {SETUP_HINT}")
        deadline = time.monotonic() + self.start_timeout
        self.directory = Path(tempfile.mkdtemp(prefix="ringq-rabbitmq-"))
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True
        # one block: epmd, then per node AMQP and distribution, then the CLI tools' range
        base = free_port_block(1 + 2 * self.size + CTL_PORTS)
        self.epmd_port = base
        self.ctl_port_min = base + 1 + 2 * self.size
        self._env = self._environment()
        self._write_home()
        self._start_epmd()
        for i in range(self.size):
            node = _Node(
                index=i,
                name=f"rabbit{i + 1}@{NODE_HOST}",
                amqp_port=base + 1 + 2 * i,
                dist_port=base + 2 + 2 * i,
                directory=self.directory / f"rabbit{i + 1}",
            )
            self._nodes.append(node)
            self._launch(node)
        with ThreadPoolExecutor(self.size) as pool:
            list(pool.map(lambda n: self._await_running(n, deadline), self._nodes))
        self.version = self._version()
        for i in range(1, self.size):
            self.ctl(i, "stop_app")
            self.ctl(i, "join_cluster", self._nodes[0].name)
            self.ctl(i, "start_app")
        for i in range(self.size):
            self.ctl(i, "await_startup", "--timeout", str(max(5, int(deadline - time.monotonic()))))
        self._check_members()
        if self.with_policy:
            self.policy_output = self.ctl(
                0,
                "set_policy",
                HA_POLICY_NAME,
                HA_POLICY_PATTERN,
                json.dumps(HA_POLICY),
                "--apply-to",
                "queues",
            ).strip()
        return self

    def stop(self) -> None:
        """Stop every node (rabbitmqctl stop, then SIGKILL what is left) and epmd; idempotent."""
        live = [n for n in self._nodes if n.process is not None and n.process.poll() is None and not n.killed]
        if live:
            with ThreadPoolExecutor(len(live)) as pool:
                list(pool.map(self._stop_node, live))
        for node in self._nodes:
            self._kill_leftovers(node)
        if self._epmd is not None:
            if self._epmd.poll() is None:
                self._epmd.terminate()
                try:
                    self._epmd.wait(5)
                except subprocess.TimeoutExpired:
                    self._epmd.kill()
                    self._epmd.wait()
            self._epmd = None
        for stream in [self._epmd_log, *(n.output for n in self._nodes)]:
            if stream is not None:
                stream.close()
        self._epmd_log = None
        for node in self._nodes:
            node.output = None
        if self.directory is not None and not self.keep_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None if not self.keep_directory else self.directory

    def pids(self) -> list[int]:
        """Every OS process started here that is still running (epmd, node scripts, VMs)."""
        found: list[int] = []
        procs: list[subprocess.Popen[bytes] | None] = [self._epmd, *(n.process for n in self._nodes)]
        for p in procs:
            if p is not None and p.poll() is None:
                found.append(p.pid)
        for node in self._nodes:
            pid = node.beam_pid()
            if pid is not None and _running(pid):
                found.append(pid)
        return sorted(set(found))

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

    # --- internals -------------------------------------------------------------

    def _environment(self) -> dict[str, str]:
        assert self.directory is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_", "ERLANG_"))}
        loopback = "-kernel inet_dist_use_interface {127,0,0,1}"
        env.update(
            HOME=str(self.directory / "home"),
            LANG="C.UTF-8",
            LC_ALL="C.UTF-8",
            ERL_EPMD_ADDRESS=HOST,
            ERL_EPMD_PORT=str(self.epmd_port),
            RABBITMQ_CONF_ENV_FILE=str(self.directory / "rabbitmq-env.conf"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.directory / "enabled_plugins"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(self.directory / "advanced.config"),  # absent: none
            RABBITMQ_CTL_ERL_ARGS=loopback,
            RABBITMQ_CTL_DIST_PORT_MIN=str(self.ctl_port_min),
            RABBITMQ_CTL_DIST_PORT_MAX=str(self.ctl_port_min + CTL_PORTS - 1),
        )
        return env

    def _write_home(self) -> None:
        assert self.directory is not None
        home = self.directory / "home"
        home.mkdir()
        cookie = home / ".erlang.cookie"
        cookie.write_text("".join(random.SystemRandom().choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=20)))
        cookie.chmod(0o400)
        (self.directory / "rabbitmq-env.conf").write_text("# empty: the environment says it all\n")
        (self.directory / "enabled_plugins").write_text("[].\n")

    def _start_epmd(self) -> None:
        assert self.directory is not None
        self._epmd_log = open(self.directory / "epmd.log", "ab")  # noqa: SIM115 (closed by stop)
        self._epmd = subprocess.Popen(
            [EPMD, "-address", HOST, "-port", str(self.epmd_port)],
            env=self._env,
            stdin=subprocess.DEVNULL,
            stdout=self._epmd_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent(signal.SIGKILL) if sys.platform == "linux" else None,
        )
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex((HOST, self.epmd_port)) == 0:
                    return
            if self._epmd.poll() is not None or time.monotonic() > deadline:
                raise RabbitClusterError(
                    f"epmd did not start on {HOST}:{self.epmd_port}:\n{_tail(self.directory / 'epmd.log')}"
                )
            time.sleep(0.05)

    def _launch(self, node: _Node) -> None:
        node.directory.mkdir()
        node.config.write_text(
            "\n".join(
                [
                    f"listeners.tcp.1 = {HOST}:{node.amqp_port}",
                    "loopback_users.guest = true",  # guest may connect, and only from loopback
                    "disk_free_limit.absolute = 50MB",
                    "log.console = true",
                    "log.console.level = warning",
                    "log.file.level = info",
                    "",
                ]
            )
        )
        env = dict(self._env)
        env.update(
            RABBITMQ_NODENAME=node.name,
            RABBITMQ_NODE_IP_ADDRESS=HOST,
            RABBITMQ_NODE_PORT=str(node.amqp_port),
            RABBITMQ_DIST_PORT=str(node.dist_port),
            RABBITMQ_CONFIG_FILE=str(node.config),
            RABBITMQ_MNESIA_BASE=str(node.directory / "mnesia"),
            RABBITMQ_LOG_BASE=str(node.directory / "log"),
            RABBITMQ_PID_FILE=str(node.pid_file),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        )
        node.output = open(node.console, "ab")  # noqa: SIM115 (closed by stop)
        node.process = subprocess.Popen(
            [str(RABBITMQ_SERVER)],
            env=env,
            cwd=node.directory,
            stdin=subprocess.DEVNULL,
            stdout=node.output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() can sweep the script and its VM
            preexec_fn=_die_with_parent(signal.SIGTERM) if sys.platform == "linux" else None,
        )

    def _await_running(self, node: _Node, deadline: float) -> None:
        while True:
            assert node.process is not None
            if node.process.poll() is not None:
                raise RabbitClusterError(
                    f"{node.name} exited at start with code {node.process.returncode}\n{node.log_tails()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RabbitClusterError(
                    f"{node.name} did not start within {self.start_timeout:.0f} s\n{node.log_tails()}"
                )
            # await_startup fails at once while the node is not yet registered with epmd
            done = subprocess.run(
                [str(RABBITMQCTL), "-q", "-n", node.name, "await_startup", "--timeout", str(max(1, int(remaining)))],
                env=self._env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=remaining + 10,
                check=False,
            )
            if done.returncode == 0:
                return
            time.sleep(0.5)

    def _version(self) -> str:
        out = self.ctl(0, "version").strip()
        return out.splitlines()[-1].strip() if out else "unknown"

    def _check_members(self) -> None:
        out = self.ctl(0, "cluster_status", "--formatter", "json")
        status = json.loads(out)
        running = sorted(status.get("running_nodes", []))
        if running != sorted(self.node_names):
            raise RabbitClusterError(f"cluster formed with running nodes {running}, expected {self.node_names}")

    def _stop_node(self, node: _Node) -> None:
        with contextlib.suppress(RabbitClusterError, OSError):
            self.ctl(node.index, "stop", timeout=STOP_GRACE, check=False)
        if node.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(STOP_GRACE)

    def _kill_leftovers(self, node: _Node) -> None:
        pid = node.beam_pid()
        if pid is not None and _running(pid) and _is_our_beam(pid, node.pid_file):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if node.process is not None:
            if node.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.process.pid, signal.SIGKILL)  # the group we created for this node
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(10)


def _die_with_parent(sig: signal.Signals) -> Callable[[], None]:
    """A preexec_fn: the child gets `sig` when the thread that started it dies (Linux PR_SET_PDEATHSIG).

    The rabbitmq-server script traps SIGTERM and stops its VM, so a parent killed
    without running stop() (kill -9) still takes its nodes down with it.
    """

    def set_signal() -> None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG

    return set_signal


def _pid_list(cell: str) -> list[str]:
    """The pids in a list cell as rabbitmqctl prints it: "[<a@h.1.2.3>, <b@h.4.5.6>]" (or empty)."""
    return re.findall(r"<[^>]+>", cell)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _is_our_beam(pid: int, pid_file: Path) -> bool:
    """True when pid is the process started with RABBITMQ_PID_FILE=pid_file (guards against a recycled pid)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"RABBITMQ_PID_FILE={pid_file}".encode() in environ
