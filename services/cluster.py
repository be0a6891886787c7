"""Start, inspect and stop a local ringq cluster: one coordinator and N broker nodes on 127.0.0.1.

Responsible for the processes' lifecycle only: launching them with the right flags, waiting until
each one is serving, recording them, signalling them and cleaning up. What the processes do once
running is theirs.

A cluster lives in one directory:

    DIR/cluster.json        the record of what runs (written atomically, only once every process is ready)
    DIR/cluster.lock        up/down/start_node/kill hold an exclusive flock on it, so they never interleave
    DIR/coordinator.db      the coordinator's SQLite store
    DIR/data/<node>/        each node's durable queues
    DIR/logs/<name>.log     stdout and stderr of each process, appended to (each start writes a header line)
    DIR/run/<name>.ready    the "host:port" each process writes once it is serving

Guarantees:

- Every process is a detached session leader (its own session, stdin from /dev/null), so it outlives
  the caller and a Ctrl-C in the caller's terminal does not reach it.
- `up` returns only once every process has written its ready file. Otherwise (a process exits, the
  timeout passes, the caller is interrupted) it stops everything it started, writes no record and
  raises `ClusterError` naming the process, with the tail of its log.
- At most one live cluster per directory: `up` refuses a directory whose record has a live process.
- `up` never resumes or discards a cluster's state (its coordinator's store, its nodes' data) unless
  told to: on a directory that has state it raises ClusterError unless `state` is RESUME (start on
  it) or FRESH (delete it first; the certificates in DIR/tls are kept).
- A recorded process counts as alive only while its pid exists, is not a zombie and (where /proc is
  available) has the start time that was recorded, so a pid reused by an unrelated process is never
  signalled.
- When `down` returns, none of the recorded processes is running (SIGTERM, then SIGKILL after the
  timeout) and the record is gone. It is idempotent: no record, or only dead pids, is not an error.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from services import certs
from services.arguments import address_problem, node_id_problem

HOST = "127.0.0.1"
COORDINATOR = "coordinator"
MAX_NODES = 16
# The command that runs one broker node; `up(node_command=...)` overrides it per cluster.
NODE_COMMAND: tuple[str, ...] = (sys.executable, "-m", "services.node")
COORDINATOR_COMMAND: tuple[str, ...] = (sys.executable, "-m", "services.coordinator")

_RECORD = "cluster.json"
TLS_DIR = "tls"
_LOCK = "cluster.lock"
_POLL_SECONDS = 0.02
_KILL_GRACE_SECONDS = 5.0
_TAIL_LINES = 20
_PROC = Path("/proc")
_HAVE_PROC = _PROC.joinpath("self", "stat").exists()
# What `up` does with a directory that holds a cluster's state.
NEW = "new"  # refuse it
RESUME = "resume"  # start on it
FRESH = "fresh"  # delete it first
STATES = (NEW, RESUME, FRESH)
DATA_DIR = "data"
# A source checkout (rather than an installed package) is put on the children's PYTHONPATH.
_SOURCE_ROOT = Path(__file__).resolve().parents[1]


class ClusterError(Exception):
    """A cluster operation failed. `message` is one line; `log_tail` is the failing process's log tail, if any."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.log_tail = log_tail

    def __str__(self) -> str:
        return f"{self.message}\n{self.log_tail}" if self.log_tail else self.message


@dataclass(frozen=True)
class ProcessInfo:
    """One recorded process: `name` is "coordinator" or the node id."""

    name: str
    pid: int
    address: str
    log: Path
    start_ticks: int | None = None  # start time from /proc/<pid>/stat, to tell a reused pid apart


@dataclass(frozen=True)
class ClusterInfo:
    """What DIR/cluster.json records about a running cluster."""

    directory: Path
    coordinator: ProcessInfo
    nodes: tuple[ProcessInfo, ...]
    started_at: str
    node_command: tuple[str, ...] = NODE_COMMAND
    node_args: tuple[str, ...] = ()
    # Members prove who they are with certificates in DIR/tls (services/certs.py); clients use TLS.
    tls: bool = False

    @property
    def tls_dir(self) -> Path:
        return self.directory / TLS_DIR

    @property
    def node_addresses(self) -> list[str]:
        """Where clients reach the nodes, in start order."""
        return [node.address for node in self.nodes]

    @property
    def processes(self) -> tuple[ProcessInfo, ...]:
        """The coordinator, then the nodes in start order."""
        return (self.coordinator, *self.nodes)

    @property
    def logs(self) -> Path:
        return self.directory / "logs"

    def process(self, name: str) -> ProcessInfo:
        """The process called `name` (a node id or "coordinator"); ClusterError if there is none."""
        for process in self.processes:
            if process.name == name:
                return process
        known = ", ".join(p.name for p in self.processes)
        raise ClusterError(f"no process named {name!r} in {self.directory} (known: {known})")


# ---------------------------------------------------------------------------------------------- public API


def up(
    nodes: int,
    directory: Path | str,
    *,
    base_port: int = 0,
    node_args: Sequence[str] = (),
    timeout: float = 20.0,
    node_command: Sequence[str] | None = None,
    tls: bool = False,
    state: str = NEW,
) -> ClusterInfo:
    """Start a coordinator and nodes node1..node`nodes` in `directory`; return once all are serving.

    With `base_port` 0 every process binds a free port; with P the coordinator binds P and node k binds
    P+k. `node_args` are appended to every node's command line. `timeout` bounds the whole start-up.
    With `tls`, a CA and member certificates are made in DIR/tls (kept across restarts) and every
    process uses them; nodes serve cluster members on a port of their own. `state` says what to do
    if the directory holds an earlier cluster's state: NEW refuses (ClusterError), RESUME starts on
    it, FRESH deletes it first.
    """
    if state not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}, got {state!r}")
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes must be between 1 and {MAX_NODES}, got {nodes}")
    if base_port != 0 and not 1 <= base_port <= 65535 - nodes:
        raise ValueError(f"base_port must be 0 or between 1 and {65535 - nodes} for {nodes} nodes, got {base_port}")
    directory = _prepare(directory)
    command = tuple(NODE_COMMAND if node_command is None else node_command)
    with _locked(directory):
        existing = _read_record(directory)
        if existing is not None:
            live = [p.name for p in existing.processes if is_alive(p)]
            if live:
                raise ClusterError(
                    f"a cluster is already running in {directory} ({', '.join(live)} alive); "
                    "stop it first with `ringq cluster down`"
                )
        _settle_state(directory, state)
        deadline = time.monotonic() + timeout
        started: list[_Launch] = []
        try:
            if tls:
                certs.cluster_material(directory / TLS_DIR, [f"node{k}" for k in range(1, nodes + 1)])
            coordinator = _start_coordinator(directory, base_port, started, tls)
            (coordinator_info,) = _await_ready([coordinator], deadline, timeout)
            launches = []
            for k in range(1, nodes + 1):
                port = base_port + k if base_port else 0
                launches.append(
                    _start_node(directory, f"node{k}", coordinator_info.address, port, command, node_args, started, tls)
                )
            info = ClusterInfo(
                directory=directory,
                coordinator=coordinator_info,
                nodes=tuple(_await_ready(launches, deadline, timeout)),
                started_at=datetime.now(UTC).isoformat(timespec="seconds"),
                node_command=command,
                node_args=tuple(node_args),
                tls=tls,
            )
            _write_record(info)
        except BaseException:
            _stop_launches(started)
            raise
    return info


def down(directory: Path | str, timeout: float = 10.0) -> list[str]:
    """Stop the cluster in `directory`: nodes first, then the coordinator; return the names that were running.

    Each group gets SIGTERM and up to `timeout` seconds to exit before SIGKILL.
    """
    directory = Path(directory).resolve()
    if not directory.is_dir():
        return []
    with _locked(directory):
        info = _read_record(directory)
        if info is None:
            return []
        stopped: list[str] = []
        for group in (info.nodes, (info.coordinator,)):
            live = [p for p in group if is_alive(p)]
            _terminate(live, timeout)
            stopped += [p.name for p in live]
        for process in info.processes:
            _ready_file(directory, process.name).unlink(missing_ok=True)
        (directory / _RECORD).unlink(missing_ok=True)
    return stopped


def load(directory: Path | str) -> ClusterInfo:
    """The record of the cluster in `directory`; ClusterError if there is none."""
    directory = Path(directory).resolve()
    info = _read_record(directory)
    if info is None:
        raise ClusterError(f"no cluster recorded in {directory}")
    return info


def status(directory: Path | str) -> list[tuple[ProcessInfo, bool]]:
    """Every recorded process with whether it is alive; ClusterError if no cluster is recorded."""
    return [(p, is_alive(p)) for p in load(directory).processes]


def kill(directory: Path | str, name: str, sig: int = signal.SIGKILL, *, timeout: float = 10.0) -> bool:
    """Send `sig` to the process `name` (a node id or "coordinator"); False if it was not running.

    For SIGKILL, SIGTERM and SIGINT, wait up to `timeout` seconds for it to exit (ClusterError if it
    does not); other signals (SIGSTOP, SIGCONT, ...) return once sent. The record keeps the process,
    so `status` shows it dead and `start_node` can start it again.
    """
    return bool(kill_together(directory, [name], sig, timeout=timeout))


def kill_together(
    directory: Path | str, names: Sequence[str], sig: int = signal.SIGKILL, *, timeout: float = 10.0
) -> list[str]:
    """`kill` for several processes at once: every one is signalled before any is waited for, as a power
    cut or a machine crash stops them, so none outlives another long enough to act on its death (a mirror
    promoted in the milliseconds between two kills, say). Returns the names that were running."""
    directory = Path(directory).resolve()
    with _locked(directory):
        record = load(directory)
        running = [process for process in (record.process(name) for name in names) if is_alive(process)]
        for process in running:
            _signal(process, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT) and not _wait_gone(running, timeout):
            late = ", ".join(f"{p.name} (pid {p.pid})" for p in running if is_alive(p))
            raise ClusterError(f"{late} did not exit within {timeout:g} s of {signal.Signals(sig).name}")
    return [process.name for process in running]


def start_node(
    directory: Path | str, node_id: str, *, port: int = 0, cluster_port: int = 0, timeout: float = 20.0
) -> ProcessInfo:
    """Start node `node_id` into the running cluster in `directory`, with the cluster's node command and args.

    A new id is appended to the record; a recorded id whose process is dead is restarted in place; a
    live one is refused. Returns once the node is serving (ClusterError, with nothing left running, if not).
    `port` is its client port (0: any); on a TLS cluster `cluster_port` is the port it serves cluster members
    on (0: any), so a node restarted on its ports of before is where its peers last reached it.
    """
    problem = node_id_problem(node_id)
    if problem is not None:
        raise ValueError(problem)
    for name, value in (("port", port), ("cluster_port", cluster_port)):
        if not 0 <= value <= 65535:
            raise ValueError(f"{name} must be between 0 and 65535, got {value}")
    directory = Path(directory).resolve()
    with _locked(directory):
        info = load(directory)
        if not is_alive(info.coordinator):
            raise ClusterError(f"the coordinator of the cluster in {directory} is not running")
        previous = next((p for p in info.nodes if p.name == node_id), None)
        if previous is not None and is_alive(previous):
            raise ClusterError(f"{node_id} is already running (pid {previous.pid})")
        started: list[_Launch] = []
        try:
            if info.tls:
                certs.issue_node(info.tls_dir, node_id)
            node_args = info.node_args
            if info.tls and cluster_port:
                node_args = (*node_args, "--cluster-listen", f"{HOST}:{cluster_port}")
            launch = _start_node(
                directory, node_id, info.coordinator.address, port, info.node_command, node_args, started, info.tls
            )
            (process,) = _await_ready([launch], time.monotonic() + timeout, timeout)
            nodes = [process if p.name == node_id else p for p in info.nodes]
            _write_record(replace(info, nodes=tuple(nodes if previous else [*nodes, process])))
        except BaseException:
            _stop_launches(started)
            raise
    return process


def restart_coordinator(directory: Path | str, *, timeout: float = 20.0) -> ProcessInfo:
    """Start the cluster's coordinator again, on the address the nodes know, after it died.

    The same SQLite file is reopened, so everything acknowledged before the crash is there.
    Refused if the coordinator is still running.
    """
    directory = Path(directory).resolve()
    with _locked(directory):
        info = load(directory)
        if is_alive(info.coordinator):
            raise ClusterError(f"the coordinator of {directory} is already running (pid {info.coordinator.pid})")
        port = int(info.coordinator.address.rsplit(":", 1)[1])
        started: list[_Launch] = []
        try:
            launch = _start_coordinator(directory, port, started, info.tls)
            (process,) = _await_ready([launch], time.monotonic() + timeout, timeout)
            _write_record(replace(info, coordinator=process))
        except BaseException:
            _stop_launches(started)
            raise
    return process


def is_alive(process: ProcessInfo) -> bool:
    """Whether `process` is still running: its pid exists, is not a zombie, and is the process recorded."""
    _reap(process.pid)
    if not _HAVE_PROC:  # all we can tell is whether the pid exists
        try:
            os.kill(process.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    stat = _proc_stat(process.pid)
    if stat is None:
        return False
    state, start_ticks = stat
    if state in ("Z", "X"):
        return False
    return process.start_ticks is None or process.start_ticks == start_ticks


# ---------------------------------------------------------------------------------------------- launching


@dataclass
class _Launch:
    name: str
    proc: subprocess.Popen[bytes]
    ready: Path
    log: Path
    log_offset: int  # where this start's output begins in the (appended-to) log
    start_ticks: int | None


# Processes this interpreter started, so that they are reaped (not left as zombies) once they exit.
_children: dict[int, subprocess.Popen[bytes]] = {}


def _prepare(directory: Path | str) -> Path:
    directory = Path(directory).resolve()
    for sub in (directory, directory / "logs", directory / "run"):
        sub.mkdir(parents=True, exist_ok=True)
    return directory


def state_of(directory: Path) -> list[Path]:
    """The earlier cluster's state in `directory`: its coordinator's store and its nodes' data."""
    found = sorted(directory.glob("coordinator.db*"))
    data = directory / DATA_DIR
    # Files only: directories made ready for the nodes (a mounted disk, its lost+found) are no state.
    if data.is_dir() and any(path.is_file() and "lost+found" not in path.parts for path in data.rglob("*")):
        found.append(data)
    return found


def _settle_state(directory: Path, state: str) -> None:
    found = state_of(directory)
    if not found or state == RESUME:
        return
    if state == NEW:
        names = ", ".join(str(path.relative_to(directory)) for path in found)
        raise ClusterError(
            f"{directory} holds an earlier cluster's state ({names}): start on it with --resume, "
            "or delete it with --fresh"
        )
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def _ready_file(directory: Path, name: str) -> Path:
    return directory / "run" / f"{name}.ready"


def _start_coordinator(directory: Path, port: int, started: list[_Launch], tls: bool) -> _Launch:
    ready = _ready_file(directory, COORDINATOR)
    command = [
        *COORDINATOR_COMMAND,
        *("--listen", f"{HOST}:{port}"),
        *("--db", str(directory / "coordinator.db")),
        *("--ready-file", str(ready)),
        *(_tls_flags(certs.coordinator_paths(directory / TLS_DIR), directory) if tls else ()),
    ]
    return _launch(directory, COORDINATOR, command, started)


def _tls_flags(issued: certs.Issued, directory: Path) -> list[str]:
    return [
        *("--tls-ca", str(certs.ca_paths(directory / TLS_DIR).certificate)),
        *("--tls-cert", str(issued.certificate)),
        *("--tls-key", str(issued.key)),
    ]


def _start_node(
    directory: Path,
    node_id: str,
    coordinator: str,
    port: int,
    node_command: Sequence[str],
    node_args: Sequence[str],
    started: list[_Launch],
    tls: bool,
) -> _Launch:
    command = [
        *node_command,
        *("--id", node_id),
        *("--listen", f"{HOST}:{port}"),
        *("--coordinator", coordinator),
        *("--ready-file", str(_ready_file(directory, node_id))),
        *(_tls_flags(certs.node_paths(directory / TLS_DIR, node_id), directory) if tls else ()),
        *node_args,
    ]
    return _launch(directory, node_id, command, started)


def _launch(directory: Path, name: str, command: Sequence[str], started: list[_Launch]) -> _Launch:
    """Start `command` detached, output appended to DIR/logs/<name>.log; record it in `started`."""
    ready = _ready_file(directory, name)
    ready.unlink(missing_ok=True)
    log = directory / "logs" / f"{name}.log"
    with open(log, "ab") as out:
        offset = out.tell()
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        out.write(f"=== {stamp} ringq cluster: starting {name}: {' '.join(command)}\n".encode())
        out.flush()
        try:
            proc = _popen(command, out, directory)
        except OSError as exc:
            raise ClusterError(f"cannot start {name}: {exc}") from exc
    _children[proc.pid] = proc
    stat = _proc_stat(proc.pid)
    launch = _Launch(name, proc, ready, log, offset, None if stat is None else stat[1])
    started.append(launch)
    return launch


def _popen(command: Sequence[str], out: BinaryIO, cwd: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if (_SOURCE_ROOT / "pyproject.toml").is_file():
        paths = [str(_SOURCE_ROOT), str(_SOURCE_ROOT / "clients" / "python"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return subprocess.Popen(
        list(command),
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=env,
        start_new_session=True,
        close_fds=True,
    )


def _await_ready(launches: Sequence[_Launch], deadline: float, timeout: float) -> list[ProcessInfo]:
    """Wait until every launch has written its ready file; ClusterError at the first one that fails."""
    addresses: dict[str, str] = {}
    while len(addresses) < len(launches):
        for launch in launches:
            if launch.name in addresses:
                continue
            if launch.ready.exists():
                address = launch.ready.read_text(encoding="utf-8").strip()
                if address_problem(address) is not None:
                    raise _failure(launch, f"wrote {address!r} to its ready file, not HOST:PORT")
                addresses[launch.name] = address
            elif (code := launch.proc.poll()) is not None:
                raise _failure(launch, f"exited ({_describe_exit(code)}) before it was ready")
        if len(addresses) < len(launches):
            if time.monotonic() > deadline:
                waiting = next(launch for launch in launches if launch.name not in addresses)
                raise _failure(waiting, f"was not ready within {timeout:g} s")
            time.sleep(_POLL_SECONDS)
    return [
        ProcessInfo(launch.name, launch.proc.pid, addresses[launch.name], launch.log, launch.start_ticks)
        for launch in launches
    ]


def _failure(launch: _Launch, what: str) -> ClusterError:
    tail = _log_tail(launch.log, launch.log_offset)
    last = tail.splitlines()[-1].strip() if tail else ""
    message = f"{launch.name} {what}"
    if last:
        message += f": {last}"
    return ClusterError(f"{message} (log: {launch.log})", tail)


def _log_tail(log: Path, offset: int) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    lines = [line for line in lines[1:] if line.strip()]  # the first line is our own header
    return "\n".join(lines[-_TAIL_LINES:])


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop_launches(launches: Sequence[_Launch]) -> None:
    """Best-effort stop of processes `up`/`start_node` started before failing; never raises ClusterError."""
    processes = [ProcessInfo(x.name, x.proc.pid, "", x.log, x.start_ticks) for x in launches]
    with contextlib.suppress(ClusterError):
        _terminate([p for p in reversed(processes) if is_alive(p)], timeout=_KILL_GRACE_SECONDS)


# ---------------------------------------------------------------------------------------------- signals


def _terminate(processes: Sequence[ProcessInfo], timeout: float) -> None:
    """SIGTERM `processes`, SIGKILL the ones still running after `timeout`; ClusterError if any survives."""
    if not processes:
        return
    for process in processes:
        _signal(process, signal.SIGTERM)
    if _wait_gone(processes, timeout):
        return
    leftovers = [p for p in processes if is_alive(p)]
    for process in leftovers:
        _signal(process, signal.SIGKILL)
    if not _wait_gone(leftovers, _KILL_GRACE_SECONDS):
        names = ", ".join(f"{p.name} (pid {p.pid})" for p in leftovers if is_alive(p))
        raise ClusterError(f"could not stop {names}, even with SIGKILL")


def _signal(process: ProcessInfo, sig: int) -> None:
    try:
        os.kill(process.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        raise ClusterError(f"not allowed to signal {process.name} (pid {process.pid}): {exc}") from exc


def _wait_gone(processes: Sequence[ProcessInfo], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(is_alive(p) for p in processes):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_SECONDS)
    return True


def _reap(pid: int) -> None:
    child = _children.get(pid)
    if child is not None and child.poll() is not None:
        del _children[pid]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start ticks) of `pid` from /proc; None if there is no such process or no /proc."""
    if not _HAVE_PROC:
        return None
    try:
        text = _PROC.joinpath(str(pid), "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name, in parentheses, may hold spaces
    return fields[0], int(fields[19])  # fields 3 (state) and 22 (starttime) of proc(5)


# ---------------------------------------------------------------------------------------------- the record


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    if not directory.is_dir():
        raise ClusterError(f"no cluster recorded in {directory} (no such directory)")
    with open(directory / _LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _process_json(process: ProcessInfo) -> dict[str, Any]:
    return {
        "pid": process.pid,
        "address": process.address,
        "log": str(process.log),
        "start_ticks": process.start_ticks,
    }


def _process_from_json(entry: dict[str, Any], name: str) -> ProcessInfo:
    ticks = entry.get("start_ticks")
    return ProcessInfo(
        name=str(name),
        pid=int(entry["pid"]),
        address=str(entry["address"]),
        log=Path(entry["log"]),
        start_ticks=None if ticks is None else int(ticks),
    )


def _write_record(info: ClusterInfo) -> None:
    record = {
        "coordinator": _process_json(info.coordinator),
        "nodes": [{"id": node.name, **_process_json(node)} for node in info.nodes],
        "started_at": info.started_at,
        "node_command": list(info.node_command),
        "node_args": list(info.node_args),
        "tls": info.tls,
    }
    path = info.directory / _RECORD
    tmp = path.with_name(f"{_RECORD}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _read_record(directory: Path) -> ClusterInfo | None:
    path = directory / _RECORD
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ClusterError(f"cannot read {path}: {exc}") from exc
    try:
        return ClusterInfo(
            directory=directory,
            coordinator=_process_from_json(record["coordinator"], COORDINATOR),
            nodes=tuple(_process_from_json(entry, entry["id"]) for entry in record["nodes"]),
            started_at=str(record["started_at"]),
            node_command=tuple(str(arg) for arg in record.get("node_command", NODE_COMMAND)),
            node_args=tuple(str(arg) for arg in record.get("node_args", ())),
            tls=bool(record.get("tls", False)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ClusterError(f"{path} is not a cluster record ({type(exc).__name__}: {exc})") from exc
