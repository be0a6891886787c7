"""The `ringq` command and services.cluster, against real processes on 127.0.0.1.

The coordinator is the real one; nodes are a stand-in script (written to tmp_path) that honours the
node's command-line contract: it binds --listen, checks the --coordinator is reachable, writes its
bound HOST:PORT to --ready-file atomically, then waits for SIGTERM. Every test directory is checked
afterwards for leftover processes (any live process whose command line mentions it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services import certs, cli, cluster
from services.coordinator.client import CoordinatorClient
from tests.clusters import coordinator_client

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration

STAND_IN = r'''
"""Stand-in broker node: honours the flags of `python -m services.node`."""
import argparse, os, signal, socket, sys

parser = argparse.ArgumentParser()
parser.add_argument("--id", required=True)
parser.add_argument("--listen", required=True)
parser.add_argument("--coordinator", required=True)
parser.add_argument("--ready-file", required=True)
parser.add_argument("--flush-interval-ms", type=int)
parser.add_argument("--heartbeat-interval-ms", type=int)
parser.add_argument("--failure-timeout-ms", type=int)
parser.add_argument("--fail", action="store_true", help="exit 3 at once")
parser.add_argument("--never-ready", action="store_true", help="never write the ready file")
parser.add_argument("--ignore-sigterm", action="store_true", help="only SIGKILL stops it")
args = parser.parse_args()
print(f"stand-in {args.id} pid {os.getpid()} argv {sys.argv[1:]}", flush=True)
if args.fail:
    print(f"stand-in {args.id}: failing on purpose", file=sys.stderr, flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_sigterm else lambda *_: sys.exit(0))
host, port = args.coordinator.rsplit(":", 1)
socket.create_connection((host, int(port)), timeout=5).close()
host, port = args.listen.rsplit(":", 1)
server = socket.create_server((host, int(port)))
if not args.never_ready:
    tmp = args.ready_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{host}:{server.getsockname()[1]}")
    os.replace(tmp, args.ready_file)
while True:
    signal.pause()
'''

# Runs the CLI with services.cluster.NODE_COMMAND replaced (the CLI itself does not expose it):
#   python driver.py NODE_COMMAND... -- RINGQ_ARGS...
DRIVER = """
import sys
from services import cli, cluster
split = sys.argv.index("--")
cluster.NODE_COMMAND = tuple(sys.argv[1:split])
sys.exit(cli.main(sys.argv[split + 1 :]))
"""

PROCESS_LINE = re.compile(r"(?P<name>\S+)\s+pid (?P<pid>\d+)\s+(?P<address>127\.0\.0\.1:\d+)")


def running(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and running(int(entry.name)):
            found.append(int(entry.name))
    return found


def wait_until(check: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def stand_in(tmp_path: Path) -> list[str]:
    """The node command that runs the stand-in (python SCRIPT); the CLI driver is written beside it."""
    script = tmp_path / "stand_in_node.py"
    script.write_text(STAND_IN)
    script.with_name("driver.py").write_text(DRIVER)
    return [sys.executable, str(script)]


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    """A cluster directory that is brought down, and checked for leftover processes, after the test."""
    directory = tmp_path / "cluster"
    try:
        yield directory
    finally:
        with contextlib.suppress(cluster.ClusterError):
            cluster.down(directory)
        leftovers = processes_mentioning(str(tmp_path))
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"processes left running: {leftovers}"


def ringq(*args: str, node_command: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `ringq ARGS` as a process; with `node_command`, clusters' nodes run that instead of services.node."""
    if node_command is None:
        command = [sys.executable, "-m", "services.cli", *args]
    else:
        driver = Path(node_command[1]).with_name("driver.py")  # written by the stand_in fixture
        assert driver.is_file()
        command = [sys.executable, str(driver), *node_command, "--", *args]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# ---------------------------------------------------------------------------------------------- the CLI


def test_cluster_up_status_down(cluster_dir: Path, stand_in: list[str]) -> None:
    result = ringq("cluster", "up", "--nodes", "2", "--dir", str(cluster_dir), node_command=stand_in)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    processes = {m["name"]: (int(m["pid"]), m["address"]) for m in map(PROCESS_LINE.fullmatch, lines[:-1]) if m}
    assert list(processes) == ["coordinator", "node1", "node2"], result.stdout
    assert lines[-1] == f"logs: {cluster_dir.resolve() / 'logs'}"
    assert len({address for _, address in processes.values()}) == 3
    assert all(running(pid) for pid, _ in processes.values())  # detached: they outlive `ringq cluster up`

    record = json.loads((cluster_dir / "cluster.json").read_text())
    assert record["coordinator"]["pid"] == processes["coordinator"][0]
    assert record["coordinator"]["address"] == processes["coordinator"][1]
    assert [(n["id"], n["pid"], n["address"]) for n in record["nodes"]] == [
        (name, *processes[name]) for name in ("node1", "node2")
    ]
    assert record["started_at"]
    for name in processes:
        assert (cluster_dir / "logs" / f"{name}.log").is_file()
    assert f"stand-in node1 pid {processes['node1'][0]}" in (cluster_dir / "logs" / "node1.log").read_text()

    result = ringq("cluster", "status", "--dir", str(cluster_dir))
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0] == ["NAME", "PID", "ADDRESS", "ALIVE"]
    assert rows[1:] == [[name, str(pid), address, "yes"] for name, (pid, address) in processes.items()]

    result = ringq("cluster", "down", "--dir", str(cluster_dir))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "stopped node1, node2, coordinator"
    assert not any(running(pid) for pid, _ in processes.values())
    assert not (cluster_dir / "cluster.json").exists()

    result = ringq("cluster", "down", "--dir", str(cluster_dir))  # idempotent
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("nothing running in ")

    result = ringq("cluster", "status", "--dir", str(cluster_dir))
    assert result.returncode == 1
    assert one_line_error(result) == f"ringq: no cluster recorded in {cluster_dir.resolve()}"


def test_up_twice_into_a_live_directory_is_refused(cluster_dir: Path, stand_in: list[str]) -> None:
    first = ringq("cluster", "up", "--nodes", "1", "--dir", str(cluster_dir), node_command=stand_in)
    assert first.returncode == 0, first.stderr
    record = (cluster_dir / "cluster.json").read_text()

    second = ringq("cluster", "up", "--nodes", "1", "--dir", str(cluster_dir), node_command=stand_in)
    assert second.returncode == 1
    assert one_line_error(second).startswith(f"ringq: a cluster is already running in {cluster_dir.resolve()}")
    assert second.stdout == ""
    assert (cluster_dir / "cluster.json").read_text() == record
    assert all(alive for _, alive in cluster.status(cluster_dir))

    # Once its processes are dead, the directory can be reused (resuming its state) though the record is still there.
    for name in ("node1", "coordinator"):
        assert cluster.kill(cluster_dir, name)
    third = ringq("cluster", "up", "--nodes", "1", "--dir", str(cluster_dir), "--resume", node_command=stand_in)
    assert third.returncode == 0, third.stderr


def test_cluster_up_passes_node_flags_and_start_stop_kill_act_on_one_node(
    cluster_dir: Path, stand_in: list[str]
) -> None:
    """`cluster up` could not pass node settings, and a killed node could be started again only through
    internal functions: flags after -- go to every node (kept for `cluster start`), and
    `ringq cluster start|stop|kill NODE` act on one process."""
    d = str(cluster_dir)
    up = ringq("cluster", "up", "--nodes", "2", "--dir", d, "--", "--failure-timeout-ms", "900", node_command=stand_in)
    assert up.returncode == 0, up.stderr
    assert "'--failure-timeout-ms', '900'" in cluster.load(cluster_dir).process("node2").log.read_text()
    killed = ringq("cluster", "kill", "node1", "--dir", d)
    assert killed.returncode == 0 and "node1 killed" in killed.stdout, killed.stderr
    assert dict((p.name, alive) for p, alive in cluster.status(cluster_dir)) == {
        "coordinator": True,
        "node1": False,
        "node2": True,
    }
    again = ringq("cluster", "kill", "node1", "--dir", d)
    assert again.returncode == 0 and "node1 was not running" in again.stdout
    started = ringq("cluster", "start", "node1", "--dir", d, node_command=stand_in)
    assert started.returncode == 0, started.stderr
    node1 = cluster.load(cluster_dir).process("node1")
    assert cluster.is_alive(node1)
    log = node1.log.read_text()
    assert log.count("'--failure-timeout-ms', '900'") == 2, "the restarted node got the cluster's node flags"
    stopped = ringq("cluster", "stop", "node2", "--dir", d)
    assert stopped.returncode == 0 and "node2 stopped" in stopped.stdout
    # A node flag the node does not take is refused before anything starts.
    bad = ringq("cluster", "up", "--nodes", "1", "--dir", str(cluster_dir / "other"), "--", "--bogus")
    assert bad.returncode == 2 and one_line_error(bad) == "ringq: error: unrecognized arguments: --bogus"
    assert not (cluster_dir / "other" / "cluster.json").exists()


def test_a_node_that_fails_to_start_is_one_line_and_leaves_nothing_running(
    cluster_dir: Path, stand_in: list[str]
) -> None:
    result = ringq("cluster", "up", "--nodes", "2", "--dir", str(cluster_dir), node_command=[*stand_in, "--fail"])
    assert result.returncode == 1
    line = one_line_error(result)
    assert re.fullmatch(r"ringq: node[12] exited \(exit code 3\) before it was ready: .*failing on purpose .*", line)
    assert str(cluster_dir.resolve() / "logs") in line
    assert not (cluster_dir / "cluster.json").exists()
    assert processes_mentioning(str(cluster_dir)) == []  # the coordinator was stopped too


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
        (["cluster"], "the following arguments are required: ACTION"),
        (["cluster", "up", "--nodes", "0", "--dir", "D"], "argument --nodes: must be between 1 and 16, got 0"),
        (["cluster", "up", "--nodes", "17", "--dir", "D"], "argument --nodes: must be between 1 and 16, got 17"),
        (["cluster", "up", "--nodes", "two", "--dir", "D"], "argument --nodes: expected a number of nodes"),
        (["cluster", "up", "--nodes", "2"], "the following arguments are required: --dir"),
        (["cluster", "up", "--nodes", "2", "--dir", "D", "--bogus"], "unrecognized arguments: --bogus"),
        (["cluster", "up", "--nodes", "2", "--dir", "D", "--base-port", "70000"], "argument --base-port: expected"),
        (["cluster", "up", "--nodes", "2", "--dir", "D", "--base-port", "65534"], "leaves no room for 2 nodes"),
        (["cluster", "up", "--nodes", "2", "--dir", "D", "--timeout", "0"], "argument --timeout: expected a positive"),
        (["cluster", "up", "--nodes", "2", "--dir", "D", "--resume", "--fresh"], "not allowed with argument"),
        (["cluster", "down", "--dir", "D", "--force"], "unrecognized arguments: --force"),
        (["cluster", "status"], "the following arguments are required: --dir"),
        (["coordinator", "--listen", "nowhere"], "argument --listen: expected HOST:PORT, got 'nowhere'"),
        (["coordinator", "--listen", ":7000"], "argument --listen: expected HOST:PORT, got ':7000'"),
        (["coordinator", "--listen", "127.0.0.1:65536"], "port must be between 0 and 65535, got 65536"),
        (["coordinator", "--listen", "127.0.0.1:-1"], "expected HOST:PORT"),
        (["coordinator", "--listen", "127.0.0.1:"], "expected HOST:PORT"),
        (["coordinator", "--verbose"], "unrecognized arguments: --verbose"),
        (["node", "--id", "n1"], "the following arguments are required: --coordinator"),
        (["node", "--id", "n1", "--coordinator", "127.0.0.1:x"], "argument --coordinator: expected HOST:PORT"),
        (["node", "--id", "n 1", "--coordinator", "127.0.0.1:7000"], "argument --id: node id must be"),
        (["node", "--id", "n1", "--coordinator", "h:1", "--flush-interval-ms", "0"], "expected 0 < milliseconds"),
    ],
)
def test_bad_usage_exits_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    args = [str(tmp_path / "D") if arg == "D" else arg for arg in args]
    result = ringq(*args)
    assert result.returncode == 2
    line = one_line_error(result)
    command = args[0] if args and args[0] in ("node", "coordinator") else ""
    assert line.startswith(f"ringq {command}: error: " if command else "ringq: error: "), line
    assert message in line
    assert result.stdout == ""
    assert not (tmp_path / "D").exists()


def test_console_script() -> None:
    script = Path(sys.executable).with_name("ringq")
    if not script.exists():
        pytest.skip("the ringq console script is not installed")
    result = subprocess.run([str(script), "cluster", "up", "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    assert "--nodes N" in result.stdout


def test_coordinator_runs_in_the_foreground(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    command = [sys.executable, "-m", "services.cli", "coordinator", "--listen", "127.0.0.1:0"]
    command += ["--db", str(tmp_path / "c.db"), "--ready-file", str(ready)]
    with open(tmp_path / "coordinator.log", "wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=log)
        try:
            wait_until(lambda: ready.exists() or proc.poll() is not None, 20)
            address = ready.read_text()
            assert re.fullmatch(r"127\.0\.0\.1:\d+", address) and not address.endswith(":0")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_node_and_coordinator_commands_hand_their_arguments_to_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ringq node` once kept its own copy of the node's flags and refused those it lacked
    (--memory-high-watermark-mb): it now hands every argument to the node's own parser."""
    seen: list[tuple[list[str], str]] = []

    def fake_main(argv: list[str], prog: str = "") -> int:
        seen.append((argv, prog))
        return 7

    monkeypatch.setitem(sys.modules, "services.node", types.SimpleNamespace(main=fake_main))
    args = ["--id", "n1", "--coordinator", "127.0.0.1:7000", "--memory-high-watermark-mb", "800", "--config", "n.toml"]
    assert cli.main(["node", *args]) == 7
    assert seen == [(args, "ringq node")]


# ---------------------------------------------------------------------------------------------- the library


def test_up_on_an_earlier_clusters_state_asks_to_resume_or_start_fresh(
    cluster_dir: Path, stand_in: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`ringq cluster up` on an old directory silently resumed its state: it now says so and asks."""
    # Directories made ready for the nodes (a disk mounted for one, its lost+found) are no state.
    (cluster_dir / cluster.DATA_DIR / "node1" / "lost+found").mkdir(parents=True)
    (cluster_dir / cluster.DATA_DIR / "node1" / "lost+found" / "#12").write_bytes(b"fsck")
    assert cluster.state_of(cluster_dir.resolve()) == []
    cluster.up(1, cluster_dir, node_command=stand_in)
    cluster.down(cluster_dir)
    (cluster_dir / cluster.DATA_DIR / "node1" / "queue.log").write_bytes(b"kept")
    with pytest.raises(cluster.ClusterError, match=r"--resume.*--fresh") as refused:
        cluster.up(1, cluster_dir, node_command=stand_in)
    assert "coordinator.db" in str(refused.value) and "data" in str(refused.value)
    assert cli.main(["cluster", "up", "--nodes", "1", "--dir", str(cluster_dir)]) == 1
    assert "--resume" in capsys.readouterr().err
    # --resume starts on it, untouched; --fresh deletes it (the certificates would stay).
    cluster.up(1, cluster_dir, node_command=stand_in, state=cluster.RESUME)
    cluster.down(cluster_dir)
    assert (cluster_dir / cluster.DATA_DIR / "node1" / "queue.log").read_bytes() == b"kept"
    cluster.up(1, cluster_dir, node_command=stand_in, state=cluster.FRESH)
    cluster.down(cluster_dir)
    assert not (cluster_dir / cluster.DATA_DIR).exists()
    with pytest.raises(SystemExit):
        cli.main(["cluster", "up", "--nodes", "1", "--dir", str(cluster_dir), "--resume", "--fresh"])


def test_up_kill_and_start_node(cluster_dir: Path, stand_in: list[str]) -> None:
    info = cluster.up(2, cluster_dir, node_command=stand_in, node_args=["--flush-interval-ms", "5"])
    assert info == cluster.load(cluster_dir)
    assert [p.name for p in info.processes] == ["coordinator", "node1", "node2"]
    assert all(running(p.pid) and p.address.startswith("127.0.0.1:") for p in info.processes)
    assert "argv ['--id', 'node2'" in info.process("node2").log.read_text()
    assert "'--flush-interval-ms', '5'" in info.process("node2").log.read_text()

    async def read_group() -> int:  # the coordinator is the real gRPC service
        async with CoordinatorClient(info.coordinator.address, timeout=5, retry_seconds=5) as client:
            return (await client.read_group("g")).version

    assert asyncio.run(read_group()) == 0

    node1 = info.process("node1")
    assert cluster.kill(cluster_dir, "node1") is True
    assert not running(node1.pid)
    assert [(p.name, alive) for p, alive in cluster.status(cluster_dir)] == [
        ("coordinator", True),
        ("node1", False),
        ("node2", True),
    ]
    assert cluster.kill(cluster_dir, "node1") is False  # already dead
    with pytest.raises(cluster.ClusterError, match="no process named 'node9'"):
        cluster.kill(cluster_dir, "node9")

    with pytest.raises(cluster.ClusterError, match="node2 is already running"):
        cluster.start_node(cluster_dir, "node2")
    restarted = cluster.start_node(cluster_dir, "node1")  # a dead node is restarted in place
    node3 = cluster.start_node(cluster_dir, "node3")  # a new one is appended
    after = cluster.load(cluster_dir)
    assert [p.name for p in after.nodes] == ["node1", "node2", "node3"]
    assert after.process("node1") == restarted and restarted.pid != node1.pid
    assert after.process("node3") == node3
    assert "'--flush-interval-ms', '5'" in node3.log.read_text()  # the cluster's node args are kept
    assert all(alive for _, alive in cluster.status(cluster_dir))

    with pytest.raises(cluster.ClusterError, match="already running"):
        cluster.up(1, cluster_dir, node_command=stand_in)

    pids = [p.pid for p in after.processes]
    assert cluster.down(cluster_dir) == ["node1", "node2", "node3", "coordinator"]
    assert not any(running(pid) for pid in pids)
    assert cluster.down(cluster_dir) == []
    with pytest.raises(cluster.ClusterError, match="no cluster recorded"):
        cluster.load(cluster_dir)


def test_kill_together_signals_every_process_before_waiting_for_any(cluster_dir: Path, stand_in: list[str]) -> None:
    """A whole-cluster crash: no node may outlive another long enough to act on its death (a mirror promoted
    between two kills). Every process is signalled first, then all are waited for within one timeout."""
    info = cluster.up(3, cluster_dir, node_command=stand_in)
    assert cluster.kill_together(cluster_dir, ["node1", "node2"]) == ["node1", "node2"]
    assert [(p.name, alive) for p, alive in cluster.status(cluster_dir)] == [
        ("coordinator", True),
        ("node1", False),
        ("node2", False),
        ("node3", True),
    ]
    assert cluster.kill_together(cluster_dir, ["node1", "node2"]) == []  # already dead
    assert running(info.process("node3").pid)

    cluster.down(cluster_dir)
    cluster.up(2, cluster_dir, node_command=[*stand_in, "--ignore-sigterm"], state=cluster.FRESH)
    started = time.monotonic()
    with pytest.raises(cluster.ClusterError, match=r"node1 \(pid \d+\), node2 \(pid \d+\) did not exit within 1 s"):
        cluster.kill_together(cluster_dir, ["node1", "node2"], signal.SIGTERM, timeout=1)
    assert 1 <= time.monotonic() - started < 1.9, "one timeout for all, not one after another"
    assert cluster.kill_together(cluster_dir, ["node1", "node2"]) == ["node1", "node2"]  # SIGKILL stops them


def test_up_stops_what_it_started_when_a_node_is_never_ready(cluster_dir: Path, stand_in: list[str]) -> None:
    with pytest.raises(cluster.ClusterError) as failure:
        cluster.up(2, cluster_dir, node_command=[*stand_in, "--never-ready"], timeout=4)
    assert re.match(r"node1 was not ready within 4 s: stand-in node1 pid \d+ ", failure.value.message)
    assert "stand-in node1 pid" in failure.value.log_tail
    assert "stand-in node1 pid" in str(failure.value)
    assert not (cluster_dir / "cluster.json").exists()
    assert processes_mentioning(str(cluster_dir)) == []


def test_up_with_a_base_port(cluster_dir: Path, stand_in: list[str]) -> None:
    base = free_port_run(3)
    info = cluster.up(2, cluster_dir, base_port=base, node_command=stand_in)
    assert [p.address for p in info.processes] == [f"127.0.0.1:{base + k}" for k in range(3)]
    assert cluster.down(cluster_dir) == ["node1", "node2", "coordinator"]


def test_up_reports_a_port_that_is_taken(cluster_dir: Path, stand_in: list[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        if port + 1 > 65535:
            pytest.skip("no room above the taken port")
        with pytest.raises(cluster.ClusterError, match=r"coordinator exited \(exit code 1\) before it was ready"):
            cluster.up(1, cluster_dir, base_port=port, node_command=stand_in)
    assert processes_mentioning(str(cluster_dir)) == []


def free_port_run(count: int) -> int:
    """A port P such that P..P+count-1 were free on 127.0.0.1 just now."""
    for _ in range(50):
        with socket.create_server(("127.0.0.1", 0)) as probe:
            base: int = probe.getsockname()[1]
        if base + count > 65535:
            continue
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sockets.append(socket.create_server(("127.0.0.1", port)))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise AssertionError("no run of free ports found")


def test_down_kills_a_node_that_ignores_sigterm(cluster_dir: Path, stand_in: list[str]) -> None:
    info = cluster.up(1, cluster_dir, node_command=[*stand_in, "--ignore-sigterm"])
    started = time.monotonic()
    assert cluster.down(cluster_dir, timeout=1) == ["node1", "coordinator"]
    assert 1 <= time.monotonic() - started < 10
    assert not any(running(p.pid) for p in info.processes)


def test_a_reused_pid_is_not_taken_for_the_recorded_process(tmp_path: Path) -> None:
    me = cluster.ProcessInfo("node1", os.getpid(), "127.0.0.1:1", tmp_path / "log")
    assert cluster.is_alive(me)  # no start time recorded: the pid is all there is to go on
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    assert cluster.is_alive(dataclasses.replace(me, start_ticks=ticks))
    assert not cluster.is_alive(dataclasses.replace(me, start_ticks=ticks + 1))  # same pid, another process


def test_a_corrupt_record_is_one_line(cluster_dir: Path) -> None:
    cluster_dir.mkdir()
    (cluster_dir / "cluster.json").write_text('{"coordinator": {}}')
    for action in ("status", "down"):
        result = ringq("cluster", action, "--dir", str(cluster_dir))
        assert result.returncode == 1
        assert one_line_error(result).startswith(
            f"ringq: {cluster_dir.resolve() / 'cluster.json'} is not a cluster record"
        )
    (cluster_dir / "cluster.json").unlink()


def test_a_second_process_on_a_port_already_taken_exits_with_the_reason(tmp_path: Path) -> None:
    """gRPC binds with SO_REUSEPORT unless told not to: a second coordinator on a taken port once started,
    said it listened and answered a share of the first one's calls from another database."""
    ready = tmp_path / "first.ready"
    first = subprocess.Popen(
        [sys.executable, "-m", "services.coordinator", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "a.db"),
         "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first coordinator did not start"
            time.sleep(0.05)
        address = ready.read_text().strip()
        second = subprocess.run(
            [sys.executable, "-m", "services.coordinator", "--listen", address, "--db", str(tmp_path / "b.db")],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert second.returncode == 1, second.stderr
        last = second.stderr.strip().splitlines()[-1]  # after the log lines, one line says why
        assert last.startswith(f"python -m services.coordinator: cannot listen on {address}"), second.stderr
        node = subprocess.run(
            [sys.executable, "-m", "services.node", "--id", "n1", "--listen", address, "--coordinator", address,
             "--data-dir", str(tmp_path / "n1")],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert node.returncode == 1 and f"cannot listen on {address}" in node.stderr, node.stderr
    finally:
        first.terminate()
        first.wait(10)


def test_a_second_node_with_a_running_nodes_id_exits_and_the_running_one_keeps_its_identity(tmp_path: Path) -> None:
    """A second node started as node1 once registered over node1 and got node1's queue member recorded
    dead: it now finds node1 answering at its registered address and exits 1 saying so."""
    info = cluster.up(1, tmp_path / "cluster", tls=True)
    try:
        node1 = info.nodes[0]
        registered = asyncio.run(_list_nodes(info))
        [(name, address)] = registered  # where members reach node1: with TLS, its cluster port
        assert name == "node1" and address != node1.address, registered
        before = node1.log.stat().st_size
        ca, issued = certs.ca_paths(info.tls_dir), certs.node_paths(info.tls_dir, "node1")  # node1's certificate
        twin = subprocess.run(
            [sys.executable, "-m", "services.node", "--id", "node1", "--listen", "127.0.0.1:0",
             "--coordinator", info.coordinator.address, "--data-dir", str(tmp_path / "twin"),
             "--tls-ca", str(ca.certificate), "--tls-cert", str(issued.certificate), "--tls-key", str(issued.key)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert twin.returncode == 1, twin.stderr[-2000:]
        last = twin.stderr.strip().splitlines()[-1]
        assert last == f"ringq node: node id 'node1' is already running at {address}: stop it first, or pick another id"
        assert cluster.is_alive(node1)
        with open(node1.log, "rb") as log:
            log.seek(before)
            assert b"dead" not in log.read(), "the running node1 lost a member to its twin"
        assert asyncio.run(_list_nodes(info)) == registered, "the registration is still the running node's"
    finally:
        cluster.down(info.directory)


async def _list_nodes(info: cluster.ClusterInfo) -> list[tuple[str, str]]:
    async with coordinator_client(info, retry_seconds=5) as client:
        return await client.list_nodes()


@pytest.mark.parametrize("module", ["services.node", "services.coordinator"])
def test_every_process_prints_its_help(module: str) -> None:
    """`python -m services.node --help` crashed: a help text held a bare % (argparse formats them)."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
