"""The two distributions: one version everywhere, and the `ringq` wheel on its own in a fresh virtualenv.

The wheels are built from `git archive HEAD` (a clean checkout: no generated code, no egg-info, nothing
uncommitted) the way `make wheels` builds them: `pip wheel` of clients/python and of the root, each in
pip's isolated build environment with the build requirements of its pyproject.toml, so the gRPC code in
them is what their own build generated. Only the ringq wheel is installed into a fresh virtualenv, which
then must give `ringq.__version__`, `ringqctl --version` and every module of ringq, and must not have
pyspark, pandas, services or pipeline (ringq-server's). Last, the README's ten-line producer and consumer
(its first ```python block, with the cluster's node addresses put in) runs in that virtualenv against a
live cluster of this repository's nodes. Its consumer loop never ends, so the test runs the snippet as
written and stops it once it has printed the 99 bodies it publishes, in order and none redelivered.

Packages come from a wheel cache (.venv/wheel-cache): filled from the package index the first time (with
the build requirements and the ringq wheel's dependencies), then used with --no-index, so later runs need
no network. If the cache lacks something and the index cannot be reached, the test is skipped and says so.
"""

from __future__ import annotations

import email.message
import email.parser
import io
import json
import os
import queue
import re
import subprocess
import sys
import tarfile
import threading
import time
import tomllib
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ringq
from ringq import ctl
from services import cli

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".venv" / "wheel-cache"
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
# What ringq must not bring: the Spark pipeline's dependencies and ringq-server's packages.
NOT_IN_RINGQ = ("pyspark", "pandas", "services", "pipeline", "ringq.internal")
SNIPPET_SECONDS = 90.0


# ---------------------------------------------------------------------------------------------- one version


def test_one_version_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    version = ringq.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    package = json.loads((REPO / "clients/node/package.json").read_text(encoding="utf-8"))
    lock = json.loads((REPO / "clients/node/package-lock.json").read_text(encoding="utf-8"))
    assert package["version"] == lock["version"] == lock["packages"][""]["version"] == version, (
        "clients/node/package.json (and package-lock.json) must carry clients/python/ringq/_version.py's version"
    )
    for project in (REPO / "pyproject.toml", REPO / "clients/python/pyproject.toml"):
        table = tomllib.loads(project.read_text(encoding="utf-8"))["project"]
        assert "version" not in table and "version" in table["dynamic"], f"{project}: the version is setup.py's"
    for main, name in ((cli.main, "ringq"), (ctl.main, "ringqctl")):
        with pytest.raises(SystemExit) as exited:
            main(["--version"])
        assert exited.value.code == 0
        assert capsys.readouterr().out == f"{name} {version}\n"


def test_the_sdk_does_not_import_ringq_internal() -> None:
    for path in sorted((REPO / "clients/python/ringq").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"^\s*(from|import) ringq\.internal\b", text, re.M), f"{path.name} imports ringq.internal"


# ---------------------------------------------------------------------------------------------- the wheel


@dataclass(frozen=True)
class Wheels:
    ringq: Path
    server: Path
    seconds: float


def _run(command: Sequence[object], timeout: float = 300.0, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    options = {"text": True, **kwargs}
    return subprocess.run([str(c) for c in command], capture_output=True, timeout=timeout, check=False, **options)


def _clean_env() -> dict[str, str]:
    """This process's environment less what would let the fresh virtualenv see the development one."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _fill_cache(requirements: Sequence[str]) -> None:
    """Download `requirements` (and theirs) into CACHE; skip the test if the package index is unreachable."""
    CACHE.mkdir(parents=True, exist_ok=True)
    command = [*PIP, "download", "--quiet", "--only-binary=:all:", "--dest", CACHE, *requirements]
    downloaded = _run(command, timeout=600.0)
    if downloaded.returncode == 0:
        return
    probe = _run([*PIP, "download", "--quiet", "--no-deps", "--dest", CACHE, "tenacity==9.2.1"], timeout=120.0)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"the package index is unreachable and {CACHE} lacks what the test installs: {last}")
    pytest.fail(f"pip download {' '.join(requirements)} failed:\n{downloaded.stderr}", pytrace=False)


def _offline(command: Sequence[object], requirements: Sequence[str], **kwargs: Any) -> None:
    """Run a pip `command` with --no-index --find-links CACHE; on failure fill the cache with
    `requirements` from the index and run it once more."""
    offline = [*command, "--no-index", "--find-links", CACHE]
    result = _run(offline, **kwargs)
    if result.returncode != 0:
        _fill_cache(requirements)
        result = _run(offline, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, command))} failed:\n{result.stdout}\n{result.stderr}"


def _build_requirements() -> list[str]:
    requires: list[str] = []
    for project in (REPO / "pyproject.toml", REPO / "clients/python/pyproject.toml"):
        requires += tomllib.loads(project.read_text(encoding="utf-8"))["build-system"]["requires"]
    return sorted(set(requires))


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        [name] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(archive.read(name).decode())


def _requires_dist(wheel: Path) -> list[str]:
    """The wheel's unconditional Requires-Dist (no extras)."""
    return [r for r in _metadata(wheel).get_all("Requires-Dist") or [] if ";" not in r]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Wheels:
    """Both wheels, built from `git archive HEAD`."""
    started = time.monotonic()
    archive = _run(["git", "-C", REPO, "archive", "--format=tar", "HEAD"], text=False)
    if archive.returncode != 0:
        pytest.skip(f"not a git checkout: {archive.stderr!r}")
    source = tmp_path_factory.mktemp("checkout")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(source, filter="data")
    assert not (source / "clients/python/ringq/v1").exists(), "generated code is committed"
    out = tmp_path_factory.mktemp("dist")
    build = [*PIP, "wheel", "--quiet", "--no-deps", "--wheel-dir", out, "./clients/python", "."]
    _offline(build, _build_requirements(), cwd=source)
    [sdk] = out.glob(f"ringq-{ringq.__version__}-py3-none-any.whl")
    [server] = out.glob(f"ringq_server-{ringq.__version__}-py3-none-any.whl")
    return Wheels(sdk, server, time.monotonic() - started)


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


@pytest.mark.integration
def test_the_wheels_carry_their_generated_code_and_nothing_of_each_other(wheels: Wheels) -> None:
    sdk, server = _names(wheels.ringq), _names(wheels.server)
    assert {"ringq/__init__.py", "ringq/py.typed", "ringq/v1/__init__.py", "ringq/v1/queue_pb2.py"} <= sdk
    assert {"ringq/v1/queue_pb2_grpc.py", "ringq/v1/queue_pb2.pyi", "ringq/v1/admin_pb2_grpc.py"} <= sdk
    assert {n.split("/")[0] for n in sdk} == {"ringq", f"ringq-{ringq.__version__}.dist-info"}
    assert not [n for n in sdk if n.startswith("ringq/internal/")]
    assert {"ringq/internal/__init__.py", "ringq/internal/v1/__init__.py", "ringq/internal/v1/peer_pb2.py"} <= server
    assert {"services/cli.py", "pipeline/__main__.py"} <= server
    assert {n.split("/")[0] for n in server} == {
        "ringq",
        "services",
        "pipeline",
        f"ringq_server-{ringq.__version__}.dist-info",
    }
    assert not [n for n in server if n.startswith("ringq/") and not n.startswith("ringq/internal/")]
    version = ringq.__version__
    sdk_requires = _metadata(wheels.ringq).get_all("Requires-Dist") or []
    assert f'ringq-server=={version}; extra == "server"' in sdk_requires
    assert f'ringq-server[pipeline]=={version}; extra == "pipeline"' in sdk_requires
    assert sorted(r.split("==")[0] for r in _requires_dist(wheels.ringq)) == [
        "grpcio",
        "opentelemetry-api",
        "protobuf",
        "tenacity",
    ]
    assert f"ringq=={version}" in _requires_dist(wheels.server)
    assert not {r.split("==")[0] for r in _requires_dist(wheels.server)} & {"pyspark", "pandas", "pyarrow"}


@dataclass(frozen=True)
class Venv:
    python: Path
    bin: Path
    seconds: float


@pytest.fixture(scope="module")
def sdk_venv(wheels: Wheels, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh virtualenv with the ringq wheel alone (and its dependencies)."""
    started = time.monotonic()
    root = tmp_path_factory.mktemp("venv")
    created = _run([sys.executable, "-m", "venv", "--without-pip", root / "venv"])
    assert created.returncode == 0, created.stderr
    python = root / "venv" / "bin" / "python"
    install = [*PIP, "--python", python, "install", "--quiet"]
    _offline([*install, wheels.ringq], _requires_dist(wheels.ringq), env=_clean_env())
    return Venv(python, python.parent, time.monotonic() - started)


def _in_venv(venv: Venv, *command: object) -> subprocess.CompletedProcess[str]:
    return _run(command, cwd=venv.bin.parent.parent, env=_clean_env(), timeout=120.0)


IMPORT_EVERY_MODULE = """
import importlib, importlib.util, json, pkgutil, sys, ringq
names = [m.name for m in pkgutil.walk_packages(ringq.__path__, "ringq.")]
for name in names:
    importlib.import_module(name)
present = [n for n in json.loads(sys.argv[1]) if importlib.util.find_spec(n) is not None]
print(json.dumps({"version": ringq.__version__, "modules": names, "present": present}))
"""


@pytest.mark.integration
def test_ringq_alone_installs_the_sdk_and_ringqctl(sdk_venv: Venv) -> None:
    imported = _in_venv(sdk_venv, sdk_venv.python, "-c", IMPORT_EVERY_MODULE, json.dumps(NOT_IN_RINGQ))
    assert imported.returncode == 0, imported.stderr
    found = json.loads(imported.stdout)
    assert found["version"] == ringq.__version__
    assert {"ringq.ctl", "ringq.aio", "ringq.v1.queue_pb2_grpc", "ringq.v1.admin_pb2"} <= set(found["modules"])
    assert found["present"] == [], "importable in a virtualenv with only ringq"
    shown = _in_venv(sdk_venv, sdk_venv.bin / "ringqctl", "--version")
    assert (shown.returncode, shown.stdout) == (0, f"ringqctl {ringq.__version__}\n"), shown.stderr
    assert not (sdk_venv.bin / "ringq").exists(), "the ringq command is ringq-server's"
    frozen = _run([*PIP, "--python", sdk_venv.python, "list", "--format=freeze"], env=_clean_env()).stdout
    installed = {line.split("==")[0].lower() for line in frozen.split()}
    assert "ringq" in installed
    assert not installed & {"ringq-server", "pyspark", "pandas", "pyarrow", "matplotlib", "kazoo", "grpcio-tools"}
    assert "opentelemetry-sdk" not in installed, "ringq uses the OpenTelemetry API only: the SDK is the application's"


def _readme_snippet(addresses: Sequence[str]) -> str:
    """The README's first ```python block, its HOST:PORT strings replaced by `addresses` in order."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    found = re.search(r"^```python\n(.*?)^```$", readme, re.M | re.S)
    assert found is not None, "README.md has no ```python block"
    snippet = found.group(1)
    quoted = re.findall(r'"[\w.-]+:\d+"', snippet)
    assert len(quoted) == len(addresses), f"the snippet names {quoted}; the cluster has {addresses}"
    for old, new in zip(quoted, addresses, strict=True):
        snippet = snippet.replace(old, json.dumps(new), 1)
    return snippet


@pytest.mark.integration
def test_the_readme_producer_and_consumer_against_a_live_cluster(sdk_venv: Venv, tmp_path: Path) -> None:
    from tests.clusters import live_cluster

    expected = [f"b'order {i}' False" for i in range(1, 100)]
    # Plaintext: the snippet, as the README gives it, is for the development cluster its quick start runs
    # (`ringq cluster up` without --tls), which takes clients without TLS or credentials.
    with live_cluster(tmp_path / "cluster", tls=False) as info:
        snippet = _readme_snippet(info.node_addresses)
        env = {**_clean_env(), "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(
            [sdk_venv.python, "-c", snippet],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        printed: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                printed.put(line.rstrip("\n"))
            printed.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        seen: list[str] = []
        try:
            deadline = time.monotonic() + SNIPPET_SECONDS
            while len(seen) < len(expected):
                try:
                    line = printed.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if line is None:
                    break
                seen.append(line)
        finally:
            process.terminate()
            try:
                _, errors = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                _, errors = process.communicate()
            reader.join(timeout=10)
        assert seen == expected, f"the README snippet printed {seen[:5]}... ({len(seen)} lines); stderr:\n{errors}"
