"""The files in docker/, checked without a Docker engine, PyYAML or the network.

The development machines and CI have no Docker engine, so the images are never built here and the
cluster is never started. What can be checked is checked: the compose file and the collector
configuration are read with the small YAML reader below (the YAML they use and nothing more; anything
else is refused with its line number), the Dockerfile with a small reader of its instructions, and
the two Python helpers the image runs are exercised. docker/validate.sh adds, in a throwaway venv,
the Compose Specification JSON schema, hadolint, a trial of the image's install steps, and a
comparison of this YAML reader with PyYAML on both files.

What the checks hold the files to:
- every ringq service's command is accepted by the real `ringq` parser, nodes list the coordinator's
  address and the collector's OTLP port, and each node listens on its own service name, which is the
  address its peers are handed;
- ports are published on 127.0.0.1 only, volumes are declared, every image is pinned;
- the collector's pipelines use only the receivers and exporters it defines, and it uses all of them;
- the broker image needs no stage of the pipeline image, runs as a non-root user, has ringq as its
  entrypoint and a health check, and gets no dev dependency and no pipeline extra; every COPY source
  exists and is let through by docker/Dockerfile.dockerignore; the code it installs imports only what
  it installs.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import posixpath
import re
import shlex
import sys
import tomllib
import types
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from services import certs, cli

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
NODES = ("node1", "node2", "node3")
SERVICES = {"certs", "coordinator", *NODES, "otel-collector", "collector-output-init", "jaeger", "pipeline"}
RINGQ_IMAGE = "ringq:local"
# What only pipeline/ uses: ringq-server's extra `pipeline`, which the broker image leaves out.
PIPELINE_ONLY = {"pyspark", "pandas", "pyarrow", "matplotlib"}
SDK_PYPROJECT = REPO / "clients" / "python" / "pyproject.toml"
STAGES = {"wheel", "base", "broker-deps", "broker-venv", "broker", "pipeline-deps", "pipeline-venv", "pipeline"}


# ---------------------------------------------------------------------------------------------- YAML subset


class YamlSubsetError(ValueError):
    """The text uses YAML this reader does not handle (or is not YAML)."""


_PLAIN_REFUSED = re.compile(
    r"(?i:yes|no|on|off|y|n)"  # booleans in YAML 1.1 (PyYAML), strings in YAML 1.2 (Compose): quote them
    r"|0[0-9]+"  # octal in YAML 1.1
    r"|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+"  # sexagesimal in YAML 1.1: ports: 22:22 is 1342
    r"|[|>][-+0-9]*"  # block scalars
)


def _scalar(text: str, number: int) -> Any:
    if text.startswith('"'):
        if len(text) < 2 or not text.endswith('"'):
            raise YamlSubsetError(f"line {number}: unterminated double-quoted scalar")
        return json.loads(text)
    if text.startswith("'"):
        if len(text) < 2 or not text.endswith("'"):
            raise YamlSubsetError(f"line {number}: unterminated single-quoted scalar")
        return text[1:-1].replace("''", "'")
    if _PLAIN_REFUSED.fullmatch(text) or text[0] in "@`!%{}[]":
        raise YamlSubsetError(f"line {number}: {text!r} is ambiguous or unsupported here; quote it")
    if text in ("null", "Null", "NULL", "~"):
        return None
    if text in ("true", "True", "TRUE", "false", "False", "FALSE"):
        return text.lower() == "true"
    if re.fullmatch(r"[-+]?[0-9]+", text):
        return int(text)
    if re.fullmatch(r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)", text):
        return float(text)
    return text


def _split_flow(inner: str, number: int) -> list[str]:
    """The comma-separated items of a one-line flow collection's inside."""
    items, current, quote = [], "", ""
    for char in inner:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[]{}":
            raise YamlSubsetError(f"line {number}: nested flow collections are not supported")
        elif char == ",":
            items.append(current.strip())
            current = ""
            continue
        current += char
    if quote:
        raise YamlSubsetError(f"line {number}: unterminated quote")
    items.append(current.strip())
    return [] if items == [""] else items


def _strip_comment(text: str) -> str:
    quote = ""
    for position, char in enumerate(text):
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"" and (position == 0 or text[position - 1] in " [{,"):
            quote = char
        elif char == "#" and (position == 0 or text[position - 1] in " \t"):
            return text[:position].rstrip()
    return text.rstrip()


def _split_key(content: str, number: int) -> tuple[str, str] | None:
    """(key, rest) when `content` is a mapping entry `key: rest` or `key:`, else None."""
    if content[0] in "'\"":
        end = content.find(content[0], 1)
        if end < 0 or content[end + 1 : end + 2] != ":" or content[end + 2 : end + 3] not in ("", " "):
            return None
        return str(_scalar(content[: end + 1], number)), content[end + 2 :].strip()
    match = re.match(r"([^\s#'\"][^#]*?):(?: |$)", content)
    if match is None:
        return None
    return match.group(1), content[match.end() :].strip()


class _YamlReader:
    """Block mappings and sequences, one-line flow collections of scalars, plain and quoted scalars,
    comments, anchors, aliases and merge keys (<<). Enough for docker/*.yaml; refuses the rest."""

    def __init__(self, text: str) -> None:
        self.lines: list[tuple[int, int, str]] = []
        for number, raw in enumerate(text.splitlines(), start=1):
            indentation = raw[: len(raw) - len(raw.lstrip())]
            if "\t" in indentation:
                raise YamlSubsetError(f"line {number}: tab in indentation")
            content = _strip_comment(raw.strip())
            if content == "---" and not self.lines:
                continue
            if content:
                self.lines.append((number, len(indentation), content))
        self.position = 0
        self.anchors: dict[str, Any] = {}

    def document(self) -> Any:
        if not self.lines:
            return None
        value = self._block(self.lines[0][1])
        if self.position < len(self.lines):
            raise YamlSubsetError(f"line {self.lines[self.position][0]}: unexpected indentation")
        return value

    def _block(self, indent: int) -> Any:
        content = self.lines[self.position][2]
        return self._sequence(indent) if content == "-" or content.startswith("- ") else self._mapping(indent)

    def _nested(self, indent: int, in_mapping: bool) -> Any:
        """The block below a line at `indent` whose value is empty (None when there is none)."""
        if self.position >= len(self.lines):
            return None
        _, below, content = self.lines[self.position]
        if below > indent:
            return self._block(below)
        if in_mapping and below == indent and (content == "-" or content.startswith("- ")):
            return self._sequence(indent)
        return None

    def _sequence(self, indent: int) -> list[Any]:
        items = []
        while self.position < len(self.lines):
            number, at, content = self.lines[self.position]
            if at != indent or not (content == "-" or content.startswith("- ")):
                break
            rest = content[1:].strip()
            self.position += 1
            if not rest:
                items.append(self._nested(indent, in_mapping=False))
            elif _split_key(rest, number) is not None:
                raise YamlSubsetError(f"line {number}: mappings inside sequences are not supported")
            else:
                items.append(self._value(rest, number))
        return items

    def _mapping(self, indent: int) -> dict[str, Any]:
        result: dict[str, Any] = {}
        merges: list[dict[str, Any]] = []
        while self.position < len(self.lines):
            number, at, content = self.lines[self.position]
            if at < indent:
                break
            if at > indent:
                raise YamlSubsetError(f"line {number}: unexpected indentation")
            entry = _split_key(content, number)
            if entry is None:
                raise YamlSubsetError(f"line {number}: expected `key: value`, got {content!r}")
            key, rest = entry
            self.position += 1
            anchor = None
            if rest.startswith("&"):
                anchor, _, rest = rest[1:].partition(" ")
                rest = rest.strip()
            value = self._value(rest, number) if rest else self._nested(indent, in_mapping=True)
            if anchor:
                self.anchors[anchor] = value
            if key == "<<":
                if not isinstance(value, dict):
                    raise YamlSubsetError(f"line {number}: << needs a mapping")
                merges.append(value)
            elif key in result:
                raise YamlSubsetError(f"line {number}: duplicate key {key!r}")
            else:
                result[key] = value
        for merged in merges:  # explicit keys win, then the earlier merge
            for key, value in merged.items():
                result.setdefault(key, value)
        return result

    def _value(self, text: str, number: int) -> Any:
        if text.startswith("*"):
            if text[1:] not in self.anchors:
                raise YamlSubsetError(f"line {number}: unknown alias {text}")
            return self.anchors[text[1:]]
        if text.startswith("[") or text.startswith("{"):
            closing = "]" if text[0] == "[" else "}"
            if not text.endswith(closing):
                raise YamlSubsetError(f"line {number}: flow collections must close on their line")
            items = _split_flow(text[1:-1], number)
            if closing == "]":
                return [_scalar(item, number) for item in items]
            pairs = [_split_key(item, number) for item in items]
            return {key: _scalar(value, number) for key, value in (p for p in pairs if p is not None)}
        return _scalar(text, number)


def load_yaml(text: str) -> Any:
    """`text` read as the YAML subset of docker/*.yaml (see _YamlReader); YamlSubsetError otherwise."""
    return _YamlReader(text).document()


def _mapping(value: Any, where: str) -> dict[str, Any]:
    assert isinstance(value, dict), f"{where}: expected a mapping, got {value!r}"
    return value


def _strings(value: Any, where: str) -> list[str]:
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{where}: expected strings"
    return value


def test_yaml_reader_handles_what_the_files_use() -> None:
    text = """
base: &base
  image: "x:1"   # a comment
  list: [a, 'b c', "d#e"]
  empty: {}
  flow: {retries: 3, interval: 2s}
child:
  <<: *base
  image: 'y:2'
  items:
  - 1
  - true
  - 0.0.0.0:4317
  nothing:
"""
    document = load_yaml(text)
    assert document["child"] == {
        "image": "y:2",
        "list": ["a", "b c", "d#e"],
        "empty": {},
        "flow": {"retries": 3, "interval": "2s"},
        "items": [1, True, "0.0.0.0:4317"],
        "nothing": None,
    }
    for refused in ("a: yes", "a: 22:22", "a: |\n  x", "a:\n  - b: c", "a: 1\n a: 2", "a: 1\na: 2", "a: *nope"):
        with pytest.raises(YamlSubsetError):
            load_yaml(refused)


# ---------------------------------------------------------------------------------------------- Dockerfile


@dataclass
class Instruction:
    line: int
    keyword: str
    arguments: str


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def read_dockerfile(path: Path) -> list[Stage]:
    """The stages of a Dockerfile, with their instructions (continuations joined, comments dropped)."""
    stages: list[Stage] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        pending = ""
        keyword, arguments = keyword.upper(), " ".join(arguments.split())
        if keyword == "FROM":
            words = arguments.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, words[0]))
        elif stages:
            stages[-1].instructions.append(Instruction(start, keyword, arguments))
    return stages


@dataclass
class Copy:
    line: int
    source_stage: str | None
    sources: list[str]
    destination: str


def _copies(stage: Stage) -> list[Copy]:
    copies = []
    for instruction in stage.all("COPY"):
        words = shlex.split(instruction.arguments)
        options = [w for w in words if w.startswith("--")]
        paths = [w for w in words if not w.startswith("--")]
        source_stage = next((o.split("=", 1)[1] for o in options if o.startswith("--from=")), None)
        copies.append(Copy(instruction.line, source_stage, paths[:-1], paths[-1]))
    return copies


def _closure(stages: dict[str, Stage], target: str) -> list[str]:
    """The stages that building `target` needs (its bases and COPY --from stages), target last."""
    needed: list[str] = []

    def visit(name: str) -> None:
        if name in needed or name not in stages:
            return
        stage = stages[name]
        for dependency in [stage.base, *(c.source_stage for c in _copies(stage) if c.source_stage)]:
            visit(dependency)
        needed.append(name)

    visit(target)
    return needed


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return {stage.name: stage for stage in read_dockerfile(DOCKER / "Dockerfile")}


def test_dockerfile_stages_and_default_target(stages: dict[str, Stage]) -> None:
    assert set(stages) == STAGES
    assert list(stages)[-1] == "broker", "broker must be the last stage: it is the default target"
    assert set(_closure(stages, "broker")) == {"wheel", "base", "broker-deps", "broker-venv", "broker"}
    assert set(_closure(stages, "pipeline")) == STAGES - {"broker", "broker-venv"}
    base_images = {stage.base for stage in stages.values()} - set(stages)
    assert base_images == {"${PYTHON_IMAGE}"}
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim-\w+$", (DOCKER / "Dockerfile").read_text(), re.M)


@pytest.mark.parametrize("target", ["broker", "pipeline"])
def test_final_stages_run_as_a_non_root_user(stages: dict[str, Stage], target: str) -> None:
    users = stages[target].all("USER")
    assert users, f"{target} sets no USER"
    user = users[-1].arguments.split(":")[0]
    assert user not in ("root", "0"), f"{target} runs as {users[-1].arguments}"
    base_run = " ".join(i.arguments for i in stages["base"].all("RUN"))
    assert f"--uid {user} " in base_run, f"USER {user} is not the uid the base stage creates"


def test_broker_entrypoint_and_health_check(stages: dict[str, Stage]) -> None:
    broker = stages["broker"]
    assert json.loads(broker.all("ENTRYPOINT")[-1].arguments) == ["ringq"]
    [health] = broker.all("HEALTHCHECK")
    command = json.loads(health.arguments.split(" CMD ", 1)[1])
    assert command[:2] == ["python", "/opt/ringq/healthcheck.py"]
    assert any(c.destination == command[1] and c.sources == ["docker/healthcheck.py"] for c in _copies(broker))
    assert json.loads(stages["pipeline"].all("ENTRYPOINT")[-1].arguments) == ["python", "-m", "pipeline"]


def test_no_dev_dependency_java_or_spark_in_the_broker_image(stages: dict[str, Stage]) -> None:
    for name, stage in stages.items():
        runs = " ".join(i.arguments for i in stage.all("RUN"))
        assert "--extra dev" not in runs, f"{name}: no stage installs the dev tools"
        assert ("--extra pipeline" in runs) == (name == "pipeline-deps"), f"{name}: only pipeline-deps has Spark"
        assert ("openjdk" in runs) == (name == "pipeline"), f"{name}: only the pipeline image has Java"
    # Both wheels, built with their own build requirements (grpcio-tools) in pip's build environment.
    assert stages["wheel"].all("RUN")[-1].arguments == "pip wheel --no-deps --wheel-dir /wheels ./clients/python ."
    # The final images take the venv only, never the wheel stage.
    assert [c.source_stage for c in _copies(stages["broker"]) if c.source_stage] == ["broker-venv"]
    assert [c.source_stage for c in _copies(stages["pipeline"]) if c.source_stage] == ["pipeline-venv"]
    [broker_deps] = stages["broker-deps"].all("RUN")
    read = re.findall(r"requirements\.py --pyproject (\S+)( --\S+)? >", broker_deps.arguments)
    assert read == [("/tmp/build/clients/python/pyproject.toml", ""), ("/tmp/build/pyproject.toml", "")]
    for venv in ("broker-venv", "pipeline-venv"):
        assert "pip install --no-deps /tmp/wheels/" in stages[venv].all("RUN")[-1].arguments


# ---------------------------------------------------------------------------------------------- build context


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """(exclude?, regex) per line of docker/Dockerfile.dockerignore, as BuildKit reads them."""
    patterns = []
    for raw in (DOCKER / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = posixpath.normpath(line.lstrip("!").strip().strip("/"))
        regex = ""
        index = 0
        while index < len(pattern):
            if pattern.startswith("**/", index):
                regex, index = regex + "(?:.*/)?", index + 3
            elif pattern.startswith("**", index):
                regex, index = regex + ".*", index + 2
            else:
                char = pattern[index]
                regex += "[^/]*" if char == "*" else "[^/]" if char == "?" else re.escape(char)
                index += 1
        patterns.append((not include, re.compile(regex)))
    return patterns


def _in_context(path: str) -> bool:
    """Whether `path` (relative to the repository root) is sent to the builder."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for exclude, regex in _dockerignore_patterns():
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = exclude
    return not excluded


def test_dockerignore_lets_through_only_the_sources() -> None:
    for path in (
        "pyproject.toml",
        "setup.py",
        "services/node.py",
        "pipeline/lifecycle.py",
        "clients/python/pyproject.toml",
        "clients/python/setup.py",
        "clients/python/_ringq_build.py",
        "clients/python/ringq/queue.py",
        "protos/ringq/v1/x.proto",
    ):
        assert _in_context(path), path
    for path in (
        "clients/python/ringq/v1/queue_pb2.py",
        "clients/python/ringq/internal/v1/peer_pb2.py",
        "clients/python/build/lib/ringq/aio.py",
        "clients/python/ringq.egg-info/PKG-INFO",
        "ringq_server.egg-info/PKG-INFO",
        "dist/ringq-0.2.0-py3-none-any.whl",
        "services/__pycache__/cli.cpython-311.pyc",
        "clients/node/package.json",
        "tests/test_cli.py",
        ".venv/bin/python",
        "var/demo/x",
        "docker/compose.yaml",
    ):
        assert not _in_context(path), path


@pytest.mark.parametrize("target", ["broker", "pipeline"])
def test_copy_sources_exist_and_are_in_the_context(stages: dict[str, Stage], target: str) -> None:
    for name in _closure(stages, target):
        for copy in _copies(stages[name]):
            if copy.source_stage is not None:
                continue
            for source in copy.sources:
                assert (REPO / source).exists(), f"Dockerfile:{copy.line}: COPY {source}: no such path"
                assert _in_context(source), f"Dockerfile:{copy.line}: {source} is kept out by the dockerignore"
                if (REPO / source).is_dir():
                    files = [p for p in (REPO / source).rglob("*") if p.is_file()]
                    assert any(_in_context(str(p.relative_to(REPO))) for p in files), f"{source}: nothing sent"


# ---------------------------------------------------------------------------------------------- the image's helpers


def _load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"docker_{name}", DOCKER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pyproject(path: Path = REPO / "pyproject.toml") -> dict[str, Any]:
    return _mapping(tomllib.loads(path.read_text(encoding="utf-8")), path.name)


def _broker_requirements() -> list[str]:
    """What the broker image installs before the wheels: ringq's dependencies, then ringq-server's."""
    requirements = _load("requirements")
    return [*requirements.select(SDK_PYPROJECT), *requirements.select(REPO / "pyproject.toml")]


def test_requirements_keep_the_pins_of_pyproject() -> None:
    requirements = _load("requirements")
    pyproject = REPO / "pyproject.toml"
    server, sdk = _pyproject(), _pyproject(SDK_PYPROJECT)
    # ringq-server's dependencies are dynamic (setup.py adds ringq==VERSION); the list is in [tool.ringq-server].
    assert "dependencies" in server["project"]["dynamic"]
    assert requirements.select(pyproject) == _strings(server["tool"]["ringq-server"]["dependencies"], "dependencies")
    assert requirements.select(SDK_PYPROJECT) == _strings(sdk["project"]["dependencies"], "dependencies")
    pipeline = requirements.select(pyproject, extra="pipeline")
    assert {requirements.requirement_name(r) for r in pipeline} == PIPELINE_ONLY
    assert not {requirements.requirement_name(r) for r in _broker_requirements()} & PIPELINE_ONLY
    # The grpcio-tools that generates the code in the wheels is the one `make protos` uses.
    [tools] = requirements.select(pyproject, extra="dev", only=["grpcio_tools"])
    assert tools.startswith("grpcio-tools==")
    assert tools in server["build-system"]["requires"] and tools in sdk["build-system"]["requires"]
    with pytest.raises(ValueError, match="not a requirement"):
        requirements.select(pyproject, without=["numpy"])


def _distribution_closure(names: set[str]) -> set[str]:
    """`names` and everything they require, among the distributions installed here (extras left out)."""
    requirements = _load("requirements")
    seen: set[str] = set()
    todo = [requirements.normalized(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [requirements.requirement_name(r) for r in requires if "extra ==" not in r]
    return seen


def _import_time_imports(path: Path) -> Iterator[tuple[str, int]]:
    """(top-level module, line) of the imports that importing `path` runs and that are not optional.

    Imports in function bodies run only when called (services/demo.py imports pipeline/ that way, for
    `make demo`), those under `if TYPE_CHECKING` never, and those guarded by `except ImportError` may fail.
    """

    def visit(node: ast.AST) -> Iterator[tuple[str, int]]:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            children: list[ast.AST] = list(node.orelse)
        elif isinstance(node, ast.Try) and any("ImportError" in ast.unparse(h) for h in node.handlers):
            children = [*node.handlers, *node.orelse, *node.finalbody]
        else:
            children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            yield from ((alias.name.split(".")[0], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0], node.lineno
        for child in children:
            yield from visit(child)

    return visit(ast.parse(path.read_text(encoding="utf-8")))


def test_the_broker_code_imports_only_what_the_broker_image_installs() -> None:
    requirements = _load("requirements")
    broker = _distribution_closure({requirements.requirement_name(r) for r in _broker_requirements()})
    provided_by = importlib.metadata.packages_distributions()
    first_party = {"services", "ringq"}
    code = [*(REPO / "services").rglob("*.py"), *(REPO / "clients/python/ringq").glob("*.py")]
    assert len(code) > 10
    for path in code:
        for module, line in _import_time_imports(path):
            if module in sys.stdlib_module_names or module in first_party or module == "__future__":
                continue
            distributions = {requirements.normalized(d) for d in provided_by.get(module, [])}
            assert distributions & broker, (
                f"{path.relative_to(REPO)}:{line} imports {module}, which the broker image does not install "
                f"(it has {', '.join(sorted(broker))}); see docker/Dockerfile, broker-deps"
            )


def test_healthcheck_finds_the_listen_address() -> None:
    healthcheck = _load("healthcheck")
    lines = [
        ["/sbin/docker-init", "--"],
        ["python", "/opt/ringq/venv/bin/ringq", "node", "--id", "node1", "--listen", "node1:7101"],
    ]
    assert healthcheck.listen_address(lines) == "node1:7101"
    assert healthcheck.listen_address([["ringq", "coordinator", "--listen=0.0.0.0:7000"]]) == "127.0.0.1:7000"
    assert healthcheck.listen_address([["ringq", "node", "--listen", "[::]:7101"]]) == "127.0.0.1:7101"
    assert healthcheck.listen_address([["ringqctl", "cluster_status"], ["ringq", "--listen"]]) is None
    assert all(isinstance(line, list) for line in healthcheck.process_command_lines())
    # A process with a health port is asked there (its health service) rather than at --listen.
    with_health = [[*lines[1], "--health-listen", "0.0.0.0:7199"]]
    assert healthcheck.listen_address(with_health, "--health-listen") == "127.0.0.1:7199"
    assert healthcheck.listen_address(lines, "--health-listen") is None


def test_healthcheck_probes_a_grpc_server(monkeypatch: pytest.MonkeyPatch) -> None:
    healthcheck = _load("healthcheck")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    # Another ringq process with TLS on the machine (a test cluster): its TLS files are not for this
    # address (the check once used them and failed its handshake with this plaintext server).
    other = ["ringq", "node", "--listen", "127.0.0.1:1", "--tls-ca", "x", "--tls-cert", "y", "--tls-key", "z"]
    monkeypatch.setattr(healthcheck, "process_command_lines", lambda: [other])
    try:
        assert healthcheck.probe(f"127.0.0.1:{port}", timeout=5.0) is None
        assert healthcheck.main([f"127.0.0.1:{port}"]) == 0
    finally:
        server.stop(grace=None).wait()
    assert "no gRPC server answered" in healthcheck.probe(f"127.0.0.1:{port}", timeout=0.3)


# ---------------------------------------------------------------------------------------------- compose.yaml


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _mapping(load_yaml((DOCKER / "compose.yaml").read_text(encoding="utf-8")), "compose.yaml")


@pytest.fixture(scope="module")
def collector() -> dict[str, Any]:
    return _mapping(load_yaml((DOCKER / "otel-collector.yaml").read_text(encoding="utf-8")), "otel-collector.yaml")


def _services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: _mapping(s, name) for name, s in _mapping(compose["services"], "services").items()}


def _ringq_commands(compose: dict[str, Any]) -> dict[str, Any]:
    """The parsed `ringq` command line of each service that runs the broker image's entrypoint."""
    parsed = {}
    for name, service in _services(compose).items():
        if service.get("image") == RINGQ_IMAGE and "entrypoint" not in service:
            command = _strings(service["command"], f"{name}.command")
            try:
                parsed[name] = cli.parse_command(command)
            except SystemExit:
                pytest.fail(f"{name}: `ringq {shlex.join(command)}` is refused by the ringq parser")
    return parsed


def _otlp_grpc_port(collector: dict[str, Any]) -> int:
    endpoint = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    host, _, port = endpoint.rpartition(":")
    assert host == "0.0.0.0", f"the collector's OTLP gRPC receiver listens on {endpoint}, not on every address"
    return int(port)


def _volume_mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of a service's short-syntax volumes."""
    mounts = {}
    for volume in _strings(service.get("volumes", []), "volumes"):
        source, target = volume.split(":")[:2]
        mounts[target] = source
    return mounts


def test_compose_services(compose: dict[str, Any]) -> None:
    assert set(_services(compose)) == SERVICES
    assert set(_ringq_commands(compose)) == {"coordinator", *NODES}


def test_nodes_point_at_the_coordinator_and_the_collector(compose: dict[str, Any], collector: dict[str, Any]) -> None:
    services = _services(compose)
    commands = _ringq_commands(compose)
    coordinator = commands["coordinator"]
    assert coordinator.command == "coordinator" and coordinator.store == "sqlite"
    assert coordinator.listen == f"{services['coordinator']['hostname']}:7000"
    # Health checks ask each member's health service, on its plaintext --health-listen port (loopback in
    # the member's own container).
    health = _strings(services["coordinator"]["healthcheck"]["test"], "coordinator.healthcheck.test")
    assert health == ["CMD", "python", "-m", "services.health_probe", coordinator.health_listen]
    assert coordinator.health_listen.startswith("127.0.0.1:")
    db_directory = posixpath.dirname(coordinator.db)
    assert _volume_mounts(services["coordinator"]).get(db_directory) == "coordinator-data"
    endpoint = f"http://otel-collector:{_otlp_grpc_port(collector)}"
    assert services["coordinator"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
    for name in NODES:
        service, node = services[name], commands[name]
        assert node.command == "node" and node.id == name
        # Peers dial the address a node registers, which is its --listen: the service's own name.
        assert node.listen.rpartition(":")[0] == service["hostname"] == name
        assert node.coordinator == coordinator.listen
        assert service["depends_on"]["coordinator"] == {"condition": "service_healthy"}
        health = _strings(service["healthcheck"]["test"], f"{name}.healthcheck.test")
        assert health == ["CMD", "python", "-m", "services.health_probe", node.health_listen]
        assert node.health_listen.startswith("127.0.0.1:")
        assert "otel-collector" in service["depends_on"]
        environment = _mapping(service["environment"], f"{name}.environment")
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
        assert environment["OTEL_SERVICE_NAME"] == "ringq-node"
        assert environment["OTEL_RESOURCE_ATTRIBUTES"] == f"service.instance.id={name}"
        mounts = _volume_mounts(service)
        assert mounts[environment["RINGQ_TRACE_DIR"]] == "traces"
        assert mounts["/var/lib/ringq/data"] == f"{name}-data", "durable queues live in data/NODE_ID"
    assert len({commands[n].listen.rpartition(":")[2] for n in NODES}) == len(NODES), "one port per node"


def test_every_member_runs_with_tls_from_the_certs_volume(compose: dict[str, Any]) -> None:
    services = _services(compose)
    commands = _ringq_commands(compose)
    certs_service = services["certs"]
    script = _strings(certs_service["entrypoint"], "certs.entrypoint")[-1]
    tls_dir = next(target for target, source in _volume_mounts(certs_service).items() if source == "tls")
    assert "ringq certs coordinator" in script and "ringq certs node" in script and "chown -R 1000:1000" in script
    made = {f"{tls_dir}/ca.pem", f"{tls_dir}/coordinator.pem", f"{tls_dir}/coordinator.key"}
    made |= {f"{tls_dir}/node-{name}.{ext}" for name in NODES for ext in ("pem", "key")}
    assert "for n in 1 2 3" in script and "--id node$$n" in script, "one certificate per node"
    for name, parsed in commands.items():
        service = services[name]
        assert {parsed.tls_ca, parsed.tls_cert, parsed.tls_key} <= made, f"{name} uses files certs does not make"
        assert _volume_mounts(service)[tls_dir] == "tls"
        assert f"tls:{tls_dir}:ro" in service["volumes"], f"{name} reads its certificates read-only"
        assert service["depends_on"]["certs"] == {"condition": "service_completed_successfully"}
        expected = f"{tls_dir}/coordinator" if name == "coordinator" else f"{tls_dir}/node-{name}"
        assert (parsed.tls_cert, parsed.tls_key) == (f"{expected}.pem", f"{expected}.key")
    coordinator = services["coordinator"]
    assert commands["coordinator"].default_user == "${RINGQ_ADMIN_USER:-admin}"
    assert coordinator["environment"]["RINGQ_DEFAULT_PASSWORD"].startswith("${RINGQ_ADMIN_PASSWORD:?")


def test_healthcheck_probes_a_tls_server_with_the_process_certificate(tmp_path: Path) -> None:
    healthcheck = _load("healthcheck")
    certs.issue_coordinator(tmp_path)
    issued, ca = certs.coordinator_paths(tmp_path), certs.ca_paths(tmp_path).certificate
    lines = [["ringq", "coordinator", "--listen", "127.0.0.1:0", "--tls-ca", str(ca), "--tls-cert",
              str(issued.certificate), f"--tls-key={issued.key}"]]  # fmt: skip
    files = healthcheck.tls_files(lines)
    assert files == (str(ca), str(issued.certificate), str(issued.key))
    assert healthcheck.tls_files([["ringq", "node", "--tls-ca", "x"]]) is None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_secure_port("127.0.0.1:0", certs.load_coordinator(tmp_path).cluster_server_credentials())
    server.start()
    try:
        assert healthcheck.probe(f"127.0.0.1:{port}", timeout=5.0, tls=files) is None
        assert healthcheck.probe(f"127.0.0.1:{port}", timeout=0.5) is not None, "plaintext cannot pass"
    finally:
        server.stop(grace=None).wait()


def test_ports_are_published_on_loopback_only(compose: dict[str, Any]) -> None:
    commands = _ringq_commands(compose)
    for name, service in _services(compose).items():
        for port in _strings(service.get("ports", []), f"{name}.ports"):
            host_ip, host_port, container_port = port.split(":")
            assert host_ip == "127.0.0.1", f"{name} publishes {port} beyond this machine"
            assert host_port == container_port, f"{name}: {port}: the address a node registers must work as is"
        if name in commands:
            listen_port = commands[name].listen.rpartition(":")[2]
            assert service["ports"] == [f"127.0.0.1:{listen_port}:{listen_port}"]
    assert _services(compose)["jaeger"]["ports"] == ["127.0.0.1:16686:16686"]


def test_volumes_images_and_builds(compose: dict[str, Any], stages: dict[str, Stage]) -> None:
    declared = set(_mapping(compose["volumes"], "volumes"))
    used = set()
    for name, service in _services(compose).items():
        for target, source in _volume_mounts(service).items():
            if source.startswith("."):
                assert (DOCKER / source).is_file(), f"{name}: {source} does not exist next to compose.yaml"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"
                used.add(source)
            assert target.startswith("/")
        image = service["image"]
        if "build" in service:
            build = _mapping(service["build"], f"{name}.build")
            assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"
            assert build["target"] in stages
            assert image.endswith(":local"), f"{name}: a locally built image is tagged :local"
        else:
            repository, _, tag = image.rpartition(":")
            assert repository and re.fullmatch(r"\d+\.\d+\.\d+", tag), f"{name}: pin {image} to a release"
    assert used == declared
    assert len({_volume_mounts(_services(compose)[n])["/var/lib/ringq/data"] for n in NODES}) == len(NODES)
    pipeline = _services(compose)["pipeline"]
    assert pipeline["profiles"] == ["pipeline"], "`up` must not start the Spark job"
    trace_dir = _services(compose)["node1"]["environment"]["RINGQ_TRACE_DIR"]
    assert f"traces:{trace_dir}:ro" in pipeline["volumes"], "the job reads the nodes' span files"
    assert _volume_mounts(pipeline)["/var/lib/ringq/var/pipeline"] == "pipeline-output", "its default --out"


# ---------------------------------------------------------------------------------------------- otel-collector.yaml


def test_collector_pipelines_use_defined_components(collector: dict[str, Any]) -> None:
    pipelines = _mapping(collector["service"]["pipelines"], "service.pipelines")
    assert {"traces", "metrics"} <= set(pipelines)
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, pipeline in pipelines.items():
        assert pipeline.get("receivers") and pipeline.get("exporters"), f"pipeline {name} is incomplete"
        for kind, names in pipeline.items():
            defined = set(_mapping(collector.get(kind) or {}, kind))
            for component in _strings(names, f"{name}.{kind}"):
                assert component in defined, f"pipeline {name} uses {kind} {component}, which is not defined"
                used[kind].add(component)
    for kind, names in used.items():
        assert set(collector.get(kind) or {}) == names, f"{kind} defined but used by no pipeline"
    # otlp_grpc is the exporter's name since collector v0.144; `otlp` is a deprecated alias.
    assert not [e for e in collector["exporters"] if e.split("/")[0] in ("otlp", "otlphttp", "logging")]


def test_collector_reaches_jaeger_and_writes_files_it_can_keep(
    compose: dict[str, Any], collector: dict[str, Any]
) -> None:
    services = _services(compose)
    exporters = _mapping(collector["exporters"], "exporters")
    assert "traces" in str(collector["service"]["pipelines"]["traces"]["exporters"])
    jaeger = exporters["otlp_grpc/jaeger"]
    assert jaeger["endpoint"] == "jaeger:4317" and jaeger["tls"] == {"insecure": True}
    assert "jaeger" in services["otel-collector"]["depends_on"]
    collector_service = services["otel-collector"]
    mounts = _volume_mounts(collector_service)
    [config_path] = [t for t, s in mounts.items() if s == "./otel-collector.yaml"]
    assert collector_service["command"] == [f"--config={config_path}"]
    [output] = [t for t, s in mounts.items() if s == "collector-output"]
    files = {name: _mapping(e, name) for name, e in exporters.items() if name.split("/")[0] == "file"}
    assert {"file/traces", "file/metrics"} <= set(files)
    for name, exporter in files.items():
        assert posixpath.dirname(exporter["path"]) == output, f"{name} writes outside the collector-output volume"
        # The file exporter refuses `append` together with `rotation` or `compression`.
        assert not (exporter.get("append") and ({"rotation", "compression"} & set(exporter))), name
    init = services["collector-output-init"]
    assert init["entrypoint"] == ["chown", "10001:10001", output] and _volume_mounts(init)[output] == "collector-output"
    assert collector_service["depends_on"]["collector-output-init"] == {"condition": "service_completed_successfully"}
