"""Every snippet of README.md run or checked as the README gives it, against the cluster its own command starts.

- The cluster: `ringq cluster up --nodes 3 --dir var/c --base-port 7100` ("Start a cluster": coordinator
  127.0.0.1:7100, nodes 7101-7103), run by the test with the directory in a scratch directory and the base
  port moved to a free run of four ports (the README's own when they are free); every address
  127.0.0.1:7100..7103 of the snippets moves the same way. `cluster down` runs last, whatever happens.
- ```python blocks, in the README's order with the shell lines between them, each in a process of its own
  (cwd: the scratch directory, where `.venv` is this interpreter's environment; the repository on
  PYTHONPATH): each must exit 0 within SNIPPET_SECONDS.
- ```sh blocks, one command line at a time (`a && b` as two), as one shell session (an `export` holds for
  what follows): ringqctl lines run against the cluster (exit 0; the one EXPECTED_TO_FAIL fails with one
  line); `ringq cluster` lines on var/c are the test's own; `ringq node` / `ringq coordinator` lines are
  parsed by the processes' own parsers (running them would take the cluster's ports); the gRPC Python stub
  generation runs in the scratch directory; NOT_RUN lists the rest, with the reason. The sections of
  CHECKED_ONLY run a cluster of their own on other fixed ports: their lines are parsed (ringq and ringqctl
  by their parsers, node flags by the node's, `python -c` code compiled, `python -m` modules found), not
  run. A line none of these rules knows fails the test, so a new snippet gets a decision.
- The ```js block of clients/node/README.md runs with node (in clients/node, as the README says) when node
  and the client's node_modules (`npm ci`) are there; skipped, saying why, otherwise.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import ringq
from ringq import ctl
from services import cli
from services import node as node_process

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
NODE_README = REPO / "clients" / "node" / "README.md"
README_BASE_PORT = 7100
README_PORTS = range(README_BASE_PORT, README_BASE_PORT + 4)  # the coordinator, node1..node3
CLUSTER_UP = ["ringq", "cluster", "up", "--nodes", "3", "--dir", "var/c", "--base-port", str(README_BASE_PORT)]
SNIPPET_SECONDS = 240.0
# Command lines the test does not run, by how they start, and why.
NOT_RUN = {
    "make": "minutes each: `make test` runs every test, tests/test_demo.py runs the demo",
    ".venv/bin/python -m pipeline": "reads `make demo`'s output; tests/test_pipeline.py runs the job on recorded data",
    "pip": "installs from a package index; tests/test_wheel.py builds both wheels and installs the SDK's",
    "kubectl": "needs a Kubernetes cluster; tests/test_kubernetes_manifests.py validates the manifests",
    "deploy/kubernetes/make-secrets.sh": "makes Kubernetes Secrets; tests/test_kubernetes_manifests.py checks them",
    "protoc": "needs protoc and the Go plugins (the Python stubs are generated)",
    "curl": "asks a port of a section's own cluster; tests/test_prometheus.py scrapes one",
    "docker": "needs Docker; tests/test_docker_files.py checks docker/",
}
# Sections whose snippets run a one-node cluster of their own on fixed ports that overlap the README's
# cluster: parsed, not run (their own tests run the same things).
CHECKED_ONLY = {
    "Health": "tests/test_integration_health.py",
    "Prometheus": "tests/test_prometheus.py",
}
EXPECTED_TO_FAIL = {
    # On a live cluster with no node4: refused, in one line (the README shows the verb for a node gone for good).
    ("forget_node", "node4"): "NOT_FOUND",
}


@dataclass(frozen=True)
class Snippet:
    line: int  # of the opening fence, or of the shell line
    section: str  # the "## " heading it is under
    text: str


@dataclass(frozen=True)
class ShellLine(Snippet):
    commands: tuple[tuple[str, ...], ...]  # `a && b`: two; a program's `.venv/bin/` dropped


def _section_at(text: str, offset: int) -> str:
    headings = re.findall(r"^## (.+)$", text[:offset], re.M)
    return headings[-1].strip() if headings else ""


def _blocks(path: Path, language: str) -> list[Snippet]:
    text = path.read_text(encoding="utf-8")
    return [
        Snippet(text.count("\n", 0, m.start()) + 1, _section_at(text, m.start()), m.group(1))
        for m in re.finditer(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)
    ]


def _shell_lines() -> list[ShellLine]:
    lines = []
    for block in _blocks(README, "sh"):
        for offset, text in enumerate(block.text.splitlines(), 1):
            words = shlex.split(text, comments=True)
            if not words:
                continue
            commands: list[tuple[str, ...]] = [()]
            for word in words:
                if word == "&&":
                    commands.append(())
                else:
                    commands[-1] += (word.removeprefix(".venv/bin/") if not commands[-1] else word,)
            lines.append(ShellLine(block.line + offset, block.section, text, tuple(commands)))
    return lines


def _free_base_port() -> int:
    """A port P with P..P+3 all free on 127.0.0.1 (the README's when they are)."""
    candidates: list[int] = [README_BASE_PORT, *range(20000, 60000, 97)]
    for base in candidates:
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + len(README_PORTS)):
                    probe = stack.enter_context(socket.socket())
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is fine
                    probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise AssertionError("no run of four free ports")


@dataclass
class Session:
    """The README's cluster and shell session: where it runs and how its addresses moved."""

    scratch: Path
    base_port: int
    env: dict[str, str]

    def moved(self, text: str) -> str:
        """`text` with the README's cluster ports replaced by this session's."""
        return re.sub(
            r"\b127\.0\.0\.1:(710[0-3])\b",
            lambda m: f"127.0.0.1:{self.base_port + int(m.group(1)) - README_BASE_PORT}",
            text,
        )

    @property
    def cluster_dir(self) -> Path:
        return self.scratch / "var" / "c"


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    scratch = tmp_path_factory.mktemp("readme")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGQ_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "clients" / "python"), env.get("PYTHONPATH", "")])
    (scratch / ".venv").symlink_to(Path(sys.executable).parent.parent)  # `.venv/bin/...` as the README says
    here = Session(scratch, _free_base_port(), env)
    ups = [line for line in _shell_lines() if line.commands[0][:3] == ("ringq", "cluster", "up")]
    main = [line for line in ups if "var/c" in line.commands[0]]
    assert main and list(main[0].commands[0]) == CLUSTER_UP, (
        f"README.md: the snippets' addresses (127.0.0.1:7101-7103) need the cluster they talk to started on fixed "
        f"ports before them: `{' '.join(CLUSTER_UP)}`"
    )
    try:
        _run(here, main[0], main[0].commands[0])
        yield here
    finally:
        subprocess.run(
            [sys.executable, "-m", "services.cli", "cluster", "down", "--dir", str(here.cluster_dir)],
            env=env,
            capture_output=True,
            timeout=60,
            check=False,
        )


def _not_run(command: tuple[str, ...]) -> str | None:
    for start, why in NOT_RUN.items():
        program = start.split()
        program[0] = program[0].removeprefix(".venv/bin/")
        if list(command[: len(program)]) == program:
            return why
    return None


def _check(line: ShellLine, command: tuple[str, ...]) -> None:
    """Parse `command` as the program it names would (no process started); AssertionError if it refuses."""
    where = f"README.md line {line.line}: {line.text}"
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            if command[0] == "ringq":
                parsed = cli.parse_command([w for w in command[1:] if w != "..."])
                node_args = getattr(parsed, "node_args", None)
                if node_args:
                    node_process.parser().parse_args(["--id", "node1", "--coordinator", "127.0.0.1:1", *node_args])
            elif command[0] == "ringqctl":
                ctl.parser().parse_args(list(command[1:]))
            elif command[:2] == ("python", "-c"):
                compile(command[2], where, "exec")
            elif command[:2] == ("python", "-m"):
                assert importlib.util.find_spec(command[2]) is not None, f"{where}: no module {command[2]}"
            elif command[0] != "echo" and _not_run(command) is None:
                raise AssertionError(f"{where}: the README test cannot check {command[0]}; decide (NOT_RUN, ...)")
    except SystemExit as refused:
        raise AssertionError(f"{where}: refused: {said.getvalue().strip()}") from refused


def _run(session: Session, line: ShellLine, command: tuple[str, ...]) -> str:
    """Run one README command; what it printed."""
    words = [session.moved(w) for w in command]
    where = f"README.md line {line.line}: {line.text}"
    if words[0] == "export":
        name, _, value = words[1].partition("=")
        session.env[name] = value
        return ""
    if words[:2] == ["ringq", "cluster"]:
        words = [str(session.cluster_dir) if w == "var/c" else w for w in words]
        if "--base-port" in words:
            words[words.index("--base-port") + 1] = str(session.base_port)
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", *words[1:]],
            cwd=session.scratch,
            env=session.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{where}\n{done.stderr}"
        return done.stdout
    if words[0] == "ringq" and words[1] in ("node", "coordinator"):
        _check(line, command)  # running it would take the cluster's ports
        return ""
    if words[0] == "ringqctl":
        done = subprocess.run(
            [sys.executable, "-m", "ringq.ctl", *words[1:]],
            cwd=session.scratch,
            env=session.env,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        expected = next((code for verb, code in EXPECTED_TO_FAIL.items() if tuple(words[1:3]) == verb), None)
        if expected is not None:
            assert done.returncode == 1, f"{where}: expected to fail\n{done.stdout}"
            assert done.stderr.startswith(f"ringqctl: {expected}: ") and done.stderr.count("\n") == 1, done.stderr
            return done.stderr
        assert done.returncode == 0, f"{where}\n{done.stderr}"
        return done.stdout
    if words[:3] == ["python", "-m", "grpc_tools.protoc"]:
        stubs = session.scratch / "stubs"
        stubs.mkdir(exist_ok=True)
        with contextlib.suppress(FileExistsError):
            (stubs / "protos").symlink_to(REPO / "protos")
        (stubs / "gen").mkdir(exist_ok=True)
        argv = [a for w in words[1:] for a in (sorted(glob.glob(w, root_dir=stubs)) if "*" in w else [w])]
        done = subprocess.run([sys.executable, *argv], cwd=stubs, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{where}\n{done.stderr}"
        assert (stubs / "gen" / "ringq" / "v1" / "queue_pb2_grpc.py").is_file()
        return ""
    raise AssertionError(f"{where}: the README test neither runs nor skips this command; decide (NOT_RUN, ...)")


def _run_python(session: Session, snippet: Snippet) -> str:
    done = subprocess.run(
        [sys.executable, "-c", session.moved(snippet.text)],
        cwd=session.scratch,
        env=session.env,
        capture_output=True,
        text=True,
        timeout=SNIPPET_SECONDS,
    )
    assert done.returncode == 0, (
        f"README.md line {snippet.line}: the snippet failed\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    return done.stdout


def test_the_readme_runs_as_written(session: Session) -> None:
    """Python blocks and shell lines in the README's order, against its cluster."""
    steps: list[Snippet] = [*_blocks(README, "python"), *_shell_lines()]
    steps.sort(key=lambda step: step.line)
    printed: dict[int, str] = {}
    not_run: list[str] = []
    for step in steps:
        if step.section in CHECKED_ONLY:
            if isinstance(step, ShellLine):
                for command in step.commands:
                    _check(step, command)
            else:
                compile(step.text, f"README.md line {step.line}", "exec")
            not_run.append(f"line {step.line}: checked only (section {step.section}: {CHECKED_ONLY[step.section]})")
            continue
        if not isinstance(step, ShellLine):
            printed[step.line] = _run_python(session, step)
            continue
        for command in step.commands:
            why = _not_run(command)
            if why is not None:
                not_run.append(f"line {step.line}: {why}")
            elif command[:3] == ("ringq", "cluster", "up"):
                assert list(command) == CLUSTER_UP, f"README.md line {step.line}: not the cluster the snippets use"
            elif command[:3] == ("ringq", "cluster", "down"):
                not_run.append(f"line {step.line}: `cluster down` runs last (the fixture)")
            else:
                printed[step.line] = _run(session, step, command)
    outputs = "\n".join(printed.values())
    assert "b'order 99' False" in outputs, "the producer and consumer snippet consumed its 99 messages"
    assert "StatusCode.NOT_FOUND" in outputs and "no ringq node accepted a connection" in outputs, "errors snippet"
    assert "b'order 2' False" in outputs, "the asyncio snippet consumed its two"
    assert "[b'hello', b'world']" in outputs, "the group member delivered its broadcast"
    with ringq.Connection(session.moved("127.0.0.1:7101")) as connection:
        assert connection.queue_status("ha.out").depth == 2, "the streaming query moved ha.orders' two messages"
    print("\n".join(not_run))


def test_the_node_client_readme_runs(session: Session) -> None:
    node = shutil.which("node")
    client = REPO / "clients" / "node"
    if node is None:
        pytest.skip("node is not on PATH")
    if not (client / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.skip("clients/node/node_modules is missing (`make setup-node`, or `npm ci` in clients/node)")
    package = (client / "package.json").read_text(encoding="utf-8")
    (snippet, *more) = _blocks(NODE_README, "js")
    assert not more, "clients/node/README.md has one js block"
    kind = "module" if re.search(r'"type"\s*:\s*"module"', package) else "commonjs"
    done = subprocess.run(
        [node, f"--input-type={kind}", "-e", session.moved(snippet.text)],
        cwd=client,  # require('./ringq') as the README writes it, from clients/node
        capture_output=True,
        text=True,
        timeout=SNIPPET_SECONDS,
    )
    assert done.returncode == 0, (
        f"clients/node/README.md line {snippet.line}: the snippet failed\n{done.stderr[-3000:]}"
    )
    assert "PUBLISH_OUTCOME_CONFIRMED" in done.stdout and "hello false" in done.stdout, done.stdout
