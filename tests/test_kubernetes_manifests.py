"""The Kubernetes manifests in deploy/kubernetes, checked without a cluster.

There is no Kubernetes cluster here, so nothing is applied. What is checked instead:
- every object validates, strictly (an unknown field is an error), against the API schemas that
  kubernetes-validate ships, for the oldest Kubernetes the manifests are for and the newest it knows; so
  do the Secrets make-secrets.sh writes and, where kubectl is installed, the kustomization as rendered
  (`make lint-k8s` runs the same validator over the files);
- the kustomization lists every manifest, and the ringq image is the one docker/compose.yaml builds;
- every coordinator and node command line, once Kubernetes has expanded its $(VAR) references (each
  defined before use), is accepted by the process's own parser, and every flag it uses exists;
- a node's id is its pod's name, it advertises the pod's stable name under the headless Service, and its
  certificate carries both that name and ID.node.ringq; nodes list every coordinator, and coordinators
  every ZooKeeper server of the ensemble;
- probes of coordinators and nodes target the health port (the --health-listen port), and readiness asks
  the gRPC health service; every other container has probes on ports it declares;
- durable queues live on the node's volume claim; disruption budgets, anti-affinity, non-root pods with a
  read-only root filesystem, no privilege, and requests and limits;
- every Secret a pod mounts or reads, and every file or key it reads there, is one make-secrets.sh writes;
- coordinators and nodes export OTLP to the collector's Service, whose pipelines use only what it defines.
"""

from __future__ import annotations

import base64
import functools
import importlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from cryptography import x509

from services import node as node_process

# PyYAML comes with kubernetes-validate (both in the dev extra); without them nothing here can be read.
yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "kubernetes"
MAKE_SECRETS = K8S / "make-secrets.sh"
# The oldest Kubernetes the manifests are for (gRPC probes are GA from 1.27); the newest is whatever
# kubernetes-validate ships. The Makefile's lint-k8s names the same oldest version.
OLDEST_KUBERNETES = "1.29.0"
RINGQ_MODULES = ("services.node", "services.coordinator")
HEALTH_PORT_NAME = "health"
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


# ---------------------------------------------------------------------------------------------- reading


def _mapping(value: Any, where: str) -> dict[str, Any]:
    assert isinstance(value, dict), f"{where}: expected a mapping, got {value!r}"
    return value


def _list(value: Any, where: str) -> list[Any]:
    assert isinstance(value, list), f"{where}: expected a list, got {value!r}"
    return value


def manifest_files() -> list[Path]:
    return sorted(path for path in K8S.glob("*.yaml") if path.name != "kustomization.yaml")


@functools.cache
def _documents(path: Path) -> tuple[dict[str, Any], ...]:
    return tuple(_mapping(d, str(path)) for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d)


def objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in manifest_files():
        for document in _documents(path):
            yield path, document


def find(kind: str, name: str) -> dict[str, Any]:
    found = [o for _, o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name} in deploy/kubernetes, found {len(found)}"
    return found[0]


def kustomization() -> dict[str, Any]:
    return _mapping(yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8")), "kustomization")


def namespace() -> str:
    return str(kustomization()["namespace"])


def config() -> dict[str, str]:
    return {str(k): str(v) for k, v in find("ConfigMap", "ringq-config")["data"].items()}


def workloads() -> list[dict[str, Any]]:
    return [o for _, o in objects() if o["kind"] in ("StatefulSet", "Deployment")]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return _mapping(workload["spec"]["template"]["spec"], workload["metadata"]["name"])


def containers() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container, init containers too."""
    for workload in workloads():
        spec = pod_spec(workload)
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            yield workload, _mapping(container, workload["metadata"]["name"])


def module_of(container: dict[str, Any]) -> str | None:
    """The ringq module a container runs (`python -m services.node`), or None for other images."""
    command = container.get("command", [])
    if command[:2] == ["python", "-m"] and len(command) == 3:
        return str(command[2])
    return None


def ringq_container(workload_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    for workload, container in containers():
        if workload["metadata"]["name"] == workload_name and module_of(container) in RINGQ_MODULES:
            return workload, container
    raise AssertionError(f"no ringq container in {workload_name}")


def ports(container: dict[str, Any]) -> dict[str, int]:
    return {str(p["name"]): int(p["containerPort"]) for p in container.get("ports", [])}


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def flag_values(args: list[str]) -> dict[str, str]:
    """`--flag value` pairs of a command line (every flag here takes one value)."""
    values: dict[str, str] = {}
    position = 0
    while position < len(args):
        flag = args[position]
        assert flag.startswith("--"), f"expected a flag at {position}, got {flag!r} in {args}"
        if "=" in flag:
            name, value = flag.split("=", 1)
            values[name] = value
            position += 1
        else:
            assert position + 1 < len(args), f"{flag} has no value"
            values[flag] = args[position + 1]
            position += 2
    return values


# ---------------------------------------------------------------------------------------------- Kubernetes semantics


def expand(text: str, env: dict[str, str], where: str) -> str:
    """`text` as Kubernetes expands it in a container's command, args and env values: $(NAME) becomes
    NAME's value and $$ a $. A reference to a variable not defined (before it, for env) would be left
    as it is, which is always a mistake here."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        assert name in env, f"{where}: $({name}) is not defined before it is used"
        return env[name]

    return _REFERENCE.sub(one, text)


def environment(
    container: dict[str, Any], pod_name: str, secrets: dict[str, dict[str, bytes]] | None = None
) -> dict[str, str]:
    """The container's environment in pod `pod_name`, as Kubernetes builds it (in order)."""
    env: dict[str, str] = {}
    for variable in container.get("env", []):
        name = str(variable["name"])
        where = f"{container['name']} env {name}"
        if "value" in variable:
            env[name] = expand(str(variable["value"]), env, where)
            continue
        source = _mapping(variable["valueFrom"], where)
        if "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            env[name] = {"metadata.name": pod_name, "metadata.namespace": namespace()}[field]
        elif "configMapKeyRef" in source:
            reference = source["configMapKeyRef"]
            env[name] = str(find("ConfigMap", reference["name"])["data"][reference["key"]])
        elif "secretKeyRef" in source:
            reference = source["secretKeyRef"]
            env[name] = (secrets or {}).get(reference["name"], {}).get(reference["key"], b"secret").decode()
        else:
            raise AssertionError(f"{where}: unexpected source {source}")
    return env


def expanded_args(container: dict[str, Any], pod_name: str) -> list[str]:
    env = environment(container, pod_name)
    return [expand(str(a), env, f"{container['name']} args") for a in container.get("args", [])]


def pod_names(workload: dict[str, Any]) -> list[str]:
    name = workload["metadata"]["name"]
    if workload["kind"] == "StatefulSet":
        return [f"{name}-{ordinal}" for ordinal in range(int(workload["spec"]["replicas"]))]
    return [f"{name}-0"]


def selects(selector: dict[str, Any], labels: dict[str, Any]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------------------------------- the processes' flags


def known_flags(module: str) -> set[str]:
    """The flags the module's parser has (the node's from its parser; the coordinator's from --help)."""
    if module == "services.node":
        return {s for action in node_process.parser()._actions for s in action.option_strings}
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", coordinator_help()))


@functools.cache
def coordinator_help() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "services.coordinator", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# ---------------------------------------------------------------------------------------------- make-secrets.sh


def ringq_command() -> str:
    beside = Path(sys.executable).parent / "ringq"
    found = str(beside) if beside.exists() else shutil.which("ringq")
    if found is None:
        pytest.skip("no ringq command (make setup)")
    return found


def run_make_secrets(directory: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGQ_ADMIN_")}
    env["RINGQ"] = ringq_command()
    return subprocess.run(
        ["bash", str(MAKE_SECRETS), "--dir", str(directory), *arguments],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def secret_objects(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The Secrets make-secrets.sh writes for this deployment (its nodes, namespace and domain)."""
    nodes = find("StatefulSet", "ringq-node")["spec"]["replicas"]
    done = run_make_secrets(
        tmp_path_factory.mktemp("tls"),
        "--nodes",
        str(nodes),
        "--namespace",
        namespace(),
        "--cluster-domain",
        config()["cluster-domain"],
    )
    assert done.returncode == 0, done.stderr
    return [_mapping(d, "make-secrets.sh output") for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def secrets(secret_objects: list[dict[str, Any]]) -> dict[str, dict[str, bytes]]:
    """Each Secret's name and its data, decoded."""
    return {
        str(s["metadata"]["name"]): {str(k): base64.b64decode(v) for k, v in s["data"].items()} for s in secret_objects
    }


# ---------------------------------------------------------------------------------------------- schemas


def _validate(documents: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Problems of `documents` against kubernetes-validate's strict schemas (skips without it)."""
    pytest.importorskip("kubernetes_validate")
    utils = importlib.import_module("kubernetes_validate.utils")
    problems = []
    for version in (OLDEST_KUBERNETES, utils.latest_version()):
        for where, document in documents:
            name = f"{where} {document.get('kind')}/{document.get('metadata', {}).get('name')} ({version})"
            try:
                utils.validate(document, version, strict=True)
            except utils.ValidationError as error:
                path = ".".join(str(p) for p in error.path)
                problems.append(f"{name}: {path}: {error.message}")
            except utils.SchemaNotFoundError as error:  # an unknown kind or apiVersion: a typo, or gone
                problems.append(f"{name}: {error.message}")
    return problems


def test_every_manifest_validates_against_the_kubernetes_schemas() -> None:
    documents = [(path.name, o) for path, o in objects()]
    assert {o["kind"] for _, o in documents} >= {"StatefulSet", "Service", "PodDisruptionBudget", "ConfigMap"}
    assert _validate(documents) == []


def test_the_secrets_validate_against_the_kubernetes_schemas(secret_objects: list[dict[str, Any]]) -> None:
    assert _validate([("make-secrets.sh", s) for s in secret_objects]) == []
    assert {s["metadata"]["namespace"] for s in secret_objects} == {namespace()}


def test_the_kustomization_renders_and_validates() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the kustomization is not rendered")
    done = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    rendered = [_mapping(d, "kubectl kustomize") for d in yaml.safe_load_all(done.stdout) if d]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in rendered) == sorted(
        (o["kind"], o["metadata"]["name"]) for _, o in objects()
    )
    for o in rendered:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == namespace(), o["metadata"]
    assert _validate([("kubectl kustomize", o) for o in rendered]) == []


# ---------------------------------------------------------------------------------------------- kustomization, images


def test_the_readme_describes_every_file() -> None:
    readme = (K8S / "README.md").read_text(encoding="utf-8")
    for path in sorted(K8S.iterdir()):
        if path.name != "README.md":
            assert f"| `{path.name}` |" in readme, path.name


def test_the_kustomization_lists_every_manifest_and_names_the_namespace() -> None:
    assert sorted(kustomization()["resources"]) == [path.name for path in manifest_files()]
    assert find("Namespace", namespace())
    for key in ("patches", "patchesStrategicMerge", "patchesJson6902", "configMapGenerator", "secretGenerator"):
        assert key not in kustomization(), f"{key}: the files are meant to be complete as they are"


def test_one_ringq_image_the_one_docker_builds_and_other_images_pinned() -> None:
    compose = _mapping(yaml.safe_load((REPO / "docker" / "compose.yaml").read_text(encoding="utf-8")), "compose")
    built = compose["x-ringq-image"]["image"]
    ringq_images = {c["image"] for _, c in containers() if module_of(c) is not None}
    assert ringq_images == {built}
    repository, tag = built.rsplit(":", 1)
    assert kustomization()["images"] == [{"name": repository, "newName": repository, "newTag": tag}]
    for workload, container in containers():
        if module_of(container) is None:
            image = str(container["image"])
            assert ":" in image and not image.endswith(":latest"), f"{workload['metadata']['name']}: pin {image}"
    # The collector and Jaeger are those of docker/compose.yaml.
    services = compose["services"]
    assert image_of("otel-collector") == services["otel-collector"]["image"]
    assert image_of("jaeger") == services["jaeger"]["image"]


def image_of(workload_name: str) -> str:
    (image,) = [c["image"] for w, c in containers() if w["metadata"]["name"] == workload_name]
    return str(image)


# ---------------------------------------------------------------------------------------------- command lines


@pytest.mark.parametrize("workload_name", ["ringq-node", "ringq-coordinator"])
def test_every_flag_exists_and_every_variable_is_defined(workload_name: str) -> None:
    workload, container = ringq_container(workload_name)
    module = module_of(container)
    assert module is not None
    known = known_flags(module)
    for pod in pod_names(workload):
        args = expanded_args(container, pod)
        used = set(flag_values(args))
        assert used - known == set(), f"{workload_name}: flags {module} does not have"
        assert not any("$(" in a for a in args), args


def test_node_command_lines_parse_as_the_node_parses_them() -> None:
    workload, container = ringq_container("ringq-node")
    for pod in pod_names(workload):
        args = expanded_args(container, pod)
        parsed = node_process.parser().parse_args(args)
        assert parsed.id == pod
        assert parsed.data_dir == f"/var/lib/ringq/data/{pod}"


def test_coordinator_command_lines_parse_as_the_coordinator_parses_them() -> None:
    workload, container = ringq_container("ringq-coordinator")
    for pod in pod_names(workload):
        args = expanded_args(container, pod)
        # argparse converts each value as it reads it and stops at --help: exit 0 means every value before
        # it was accepted (flags it does not know are the test above).
        done = subprocess.run(
            [sys.executable, "-m", "services.coordinator", *args, "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        values = flag_values(args)
        assert values["--store"] == "zookeeper" and "--db" not in values
        assert values["--listen"] == f"{pod}.ringq-coordinator.{namespace()}.svc.{config()['cluster-domain']}:7000"


def test_node_identity_and_addresses_are_the_pods_stable_names() -> None:
    workload, container = ringq_container("ringq-node")
    named = ports(container)
    service = workload["spec"]["serviceName"]
    args = flag_values([str(a) for a in container["args"]])
    stable = f"$(POD_NAME).{service}.$(POD_NAMESPACE).svc.$(CLUSTER_DOMAIN)"
    assert args["--id"] == "$(POD_NAME)"
    assert args["--advertise"] == f"{stable}:{named['client']}"
    assert args["--cluster-advertise"] == f"{stable}:{named['cluster']}"
    assert args["--listen"] == f"0.0.0.0:{named['client']}"
    assert args["--cluster-listen"] == f"0.0.0.0:{named['cluster']}"
    sources = {v["name"]: v.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for v in container["env"]}
    assert sources["POD_NAME"] == "metadata.name" and sources["POD_NAMESPACE"] == "metadata.namespace"
    # The headless Service gives every pod its name, ready or not (a joining node is not ready).
    headless = find("Service", service)
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert selects(headless["spec"]["selector"], pod_labels)
    assert {p["targetPort"] for p in headless["spec"]["ports"]} == {"client", "cluster"}
    assert selects(workload["spec"]["selector"]["matchLabels"], pod_labels)
    # Clients dial the client Service, which sends them to serving nodes only.
    client = find("Service", "ringq")
    assert selects(client["spec"]["selector"], pod_labels) and "clusterIP" not in client["spec"]
    assert [p["targetPort"] for p in client["spec"]["ports"]] == ["client"]
    assert client["spec"].get("publishNotReadyAddresses") is not True


def test_nodes_list_every_coordinator_and_coordinators_every_zookeeper_server() -> None:
    coordinators = find("StatefulSet", "ringq-coordinator")
    _, coordinator = ringq_container("ringq-coordinator")
    service = coordinators["spec"]["serviceName"]
    port = ports(coordinator)["grpc"]
    assert config()["coordinators"] == ",".join(
        f"ringq-coordinator-{k}.{service}:{port}" for k in range(coordinators["spec"]["replicas"])
    )
    workload, node = ringq_container("ringq-node")
    assert flag_values(expanded_args(node, pod_names(workload)[0]))["--coordinator"] == config()["coordinators"]
    headless = find("Service", service)
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True

    ensemble = find("StatefulSet", "ringq-zookeeper")
    zk_service = ensemble["spec"]["serviceName"]
    replicas = ensemble["spec"]["replicas"]
    assert config()["zookeeper"] == ",".join(f"ringq-zookeeper-{k}.{zk_service}:2181" for k in range(replicas))
    assert flag_values(expanded_args(coordinator, "ringq-coordinator-0"))["--zookeeper"] == config()["zookeeper"]
    # zoo.cfg names the same servers, server.K+1 being pod K (ZOO_MY_ID is the ordinal plus one).
    zoo_cfg = find("ConfigMap", "ringq-zookeeper")["data"]["zoo.cfg"]
    servers = re.findall(r"^server\.(\d+)=([^:]+):2888:3888;2181$", zoo_cfg, re.MULTILINE)
    assert servers == [(str(k + 1), f"ringq-zookeeper-{k}.{zk_service}") for k in range(replicas)]
    (zookeeper,) = pod_spec(ensemble)["containers"]
    assert "ZOO_MY_ID=$$((${HOSTNAME##*-} + 1))" in zookeeper["command"][-1]
    assert expand(zookeeper["command"][-1], {}, "zookeeper").count("$((${HOSTNAME##*-} + 1))") == 1
    assert find("Service", zk_service)["spec"]["publishNotReadyAddresses"] is True


# ---------------------------------------------------------------------------------------------- probes


@pytest.mark.parametrize("workload_name", ["ringq-node", "ringq-coordinator"])
def test_ringq_probes_use_the_health_port(workload_name: str) -> None:
    workload, container = ringq_container(workload_name)
    health = ports(container)[HEALTH_PORT_NAME]
    args = flag_values([str(a) for a in container["args"]])
    assert args["--health-listen"] == f"0.0.0.0:{health}"  # kubelet dials the pod's address
    probes = {
        kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in container
    }
    assert {"readinessProbe", "livenessProbe"} <= set(probes)
    for kind, probe in probes.items():
        if "grpc" in probe:
            assert probe["grpc"]["port"] == health, f"{workload_name} {kind}"  # a number: gRPC probes take no name
            assert probe["grpc"].get("service", "") == "", f"{workload_name} {kind}: the overall status"
        else:
            (action,) = [probe[a] for a in ("tcpSocket", "httpGet", "exec") if a in probe]
            assert action.get("port") in (HEALTH_PORT_NAME, health), f"{workload_name} {kind}"
    # Readiness is the health service's answer: not serving until registered and joined, or while draining.
    assert "grpc" in probes["readinessProbe"]
    if workload_name == "ringq-coordinator":
        assert "grpc" in probes["livenessProbe"]
    else:
        # A drained node stays drained across restarts and reports NOT_SERVING: liveness must not ask.
        assert "grpc" not in probes["livenessProbe"]
    # The health port is for kubelet: no Service exposes it.
    for _, o in objects():
        if o["kind"] == "Service" and selects(
            o["spec"]["selector"], workload["spec"]["template"]["metadata"]["labels"]
        ):
            assert HEALTH_PORT_NAME not in {p["targetPort"] for p in o["spec"]["ports"]}


def test_every_container_has_probes_on_ports_it_declares() -> None:
    for workload, container in containers():
        where = f"{workload['metadata']['name']}/{container['name']}"
        assert "readinessProbe" in container and "livenessProbe" in container, where
        declared = ports(container)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if probe is None or "exec" in probe:
                continue
            (action,) = [probe[a] for a in ("grpc", "tcpSocket", "httpGet") if a in probe]
            assert action["port"] in {*declared, *declared.values()}, f"{where} {kind}"


# ------------------------------------------------------------------------------------ storage, placement, security


def test_node_queues_live_on_the_volume_claim() -> None:
    workload, container = ringq_container("ringq-node")
    claims = {t["metadata"]["name"]: t for t in workload["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (claim,) = [name for name in claims if name in mounts]
    assert claims[claim]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claims[claim]["spec"]["resources"]["requests"]["storage"]
    for pod in pod_names(workload):
        data_dir = PurePosixPath(flag_values(expanded_args(container, pod))["--data-dir"])
        assert data_dir.is_absolute() and data_dir.is_relative_to(mounts[claim]), data_dir
    # ZooKeeper's data too.
    ensemble = find("StatefulSet", "ringq-zookeeper")
    (zookeeper,) = pod_spec(ensemble)["containers"]
    (template,) = ensemble["spec"]["volumeClaimTemplates"]
    assert {m["name"]: m["mountPath"] for m in zookeeper["volumeMounts"]}[template["metadata"]["name"]] == "/data"
    assert "dataDir=/data\n" in find("ConfigMap", "ringq-zookeeper")["data"]["zoo.cfg"]


def test_disruption_budgets_and_spreading() -> None:
    budgets = [o for _, o in objects() if o["kind"] == "PodDisruptionBudget"]
    for workload in workloads():
        if workload["kind"] != "StatefulSet":
            continue
        name = workload["metadata"]["name"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        (budget,) = [b for b in budgets if selects(b["spec"]["selector"]["matchLabels"], labels)]
        assert budget["spec"]["maxUnavailable"] == 1, name
        assert workload["spec"]["replicas"] == 3, name
        anti = pod_spec(workload)["affinity"]["podAntiAffinity"]
        terms = [
            *anti.get("requiredDuringSchedulingIgnoredDuringExecution", []),
            *(t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])),
        ]
        assert any(
            t["topologyKey"] == "kubernetes.io/hostname" and selects(t["labelSelector"]["matchLabels"], labels)
            for t in terms
        ), name
    # Brokers and ZooKeeper servers must be on different hosts: their copies are what HA rests on.
    for name in ("ringq-node", "ringq-zookeeper"):
        anti = pod_spec(find("StatefulSet", name))["affinity"]["podAntiAffinity"]
        assert anti["requiredDuringSchedulingIgnoredDuringExecution"], name


def test_pods_run_as_non_root_read_only_unprivileged_with_requests_and_limits() -> None:
    for workload in workloads():
        name = workload["metadata"]["name"]
        spec = pod_spec(workload)
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] > 0, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for volume in spec.get("volumes", []):
            assert set(volume) - {"name"} <= {"configMap", "secret", "emptyDir"}, f"{name}: {volume}"
    for workload, container in containers():
        where = f"{workload['metadata']['name']}/{container['name']}"
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, where
        assert context["readOnlyRootFilesystem"] is True, where
        assert context["capabilities"] == {"drop": ["ALL"]}, where
        resources = container["resources"]
        assert set(resources["requests"]) == {"cpu", "memory"}, where
        assert set(resources["limits"]) == {"cpu", "memory"}, where
    # The node's memory alarm is below its container's memory limit (its default follows the host's memory).
    _, node = ringq_container("ringq-node")
    watermark = int(flag_values([str(a) for a in node["args"]])["--memory-high-watermark-mb"])
    limit = node["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and watermark < int(limit.removesuffix("Gi")) * 1024 * 0.5


# ---------------------------------------------------------------------------------------------- secrets


def test_every_secret_the_pods_use_is_made_by_make_secrets(secrets: dict[str, dict[str, bytes]]) -> None:
    assert set(secrets) == {"ringq-ca", "ringq-coordinator-tls", "ringq-node-tls", "ringq-admin"}
    used = set()
    for workload, container in containers():
        spec = pod_spec(workload)
        mounted = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
        for pod in pod_names(workload):
            env = environment(container, pod, secrets)
            for variable in container.get("env", []):
                reference = variable.get("valueFrom", {}).get("secretKeyRef")
                if reference is not None:
                    used.add(reference["name"])
                    assert reference["key"] in secrets[reference["name"]], reference
            args = [expand(str(a), env, container["name"]) for a in container.get("args", [])]
            for mount in container.get("volumeMounts", []):
                secret = mounted.get(mount["name"])
                if secret is None:
                    continue
                used.add(secret["secretName"])
                assert secret["secretName"] in secrets, secret
                assert "items" not in secret
                prefix = mount["mountPath"].rstrip("/") + "/"
                for argument in args:
                    if argument.startswith(prefix):
                        key = argument.removeprefix(prefix)
                        assert key in secrets[secret["secretName"]], f"{pod}: {argument}"
    assert used == set(secrets)


def _names(pem: bytes) -> set[str]:
    certificate = x509.load_pem_x509_certificate(pem)
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n) for n in names.get_values_for_type(x509.DNSName)}


def test_node_certificates_name_the_node_and_its_addresses(secrets: dict[str, dict[str, bytes]]) -> None:
    workload, container = ringq_container("ringq-node")
    files = secrets["ringq-node-tls"]
    pods = pod_names(workload)
    assert set(files) == {f"node-{pod}.{suffix}" for pod in pods for suffix in ("pem", "key")}
    for pod in pods:
        names = _names(files[f"node-{pod}.pem"])
        args = flag_values(expanded_args(container, pod))
        advertised = {args["--advertise"].rsplit(":", 1)[0], args["--cluster-advertise"].rsplit(":", 1)[0]}
        assert f"{pod}.node.ringq" in names
        assert advertised <= names
        assert f"ringq.{namespace()}.svc" in names  # the client Service
        # One member identity per certificate (docs/security.md): no other node's, no coordinator's.
        assert {n for n in names if n.endswith(".node.ringq") or n == "coordinator.ringq"} == {f"{pod}.node.ringq"}
    assert "coordinator.ringq" in _names(secrets["ringq-coordinator-tls"]["coordinator.pem"])
    assert secrets["ringq-admin"]["username"] == b"admin" and len(secrets["ringq-admin"]["password"]) >= 16


def test_make_secrets_adds_nodes_and_refuses_certificates_made_for_other_names(tmp_path: Path) -> None:
    first = run_make_secrets(tmp_path, "--nodes", "1")
    assert first.returncode == 0, first.stderr
    more = run_make_secrets(tmp_path, "--nodes", "2")
    assert more.returncode == 0, more.stderr
    before = {s["metadata"]["name"]: s["data"] for s in yaml.safe_load_all(first.stdout) if s}
    after = {s["metadata"]["name"]: s["data"] for s in yaml.safe_load_all(more.stdout) if s}
    assert after["ringq-ca"] == before["ringq-ca"] and after["ringq-admin"] == before["ringq-admin"]
    assert after["ringq-node-tls"]["node-ringq-node-0.pem"] == before["ringq-node-tls"]["node-ringq-node-0.pem"]
    assert "node-ringq-node-1.pem" in after["ringq-node-tls"]
    elsewhere = run_make_secrets(tmp_path, "--nodes", "1", "--namespace", "elsewhere")
    assert elsewhere.returncode == 1 and "was not made for these names" in elsewhere.stderr
    assert elsewhere.stdout == ""


# ---------------------------------------------------------------------------------------------- tracing


def test_members_export_to_the_collector_whose_pipelines_use_what_it_defines() -> None:
    service = find("Service", "otel-collector")
    otlp = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    for name in ("ringq-node", "ringq-coordinator"):
        workload, container = ringq_container(name)
        env = environment(container, pod_names(workload)[0])
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{otlp['otlp-grpc']}", name
        assert env["OTEL_SERVICE_NAME"] == name, name
        assert f"service.instance.id={pod_names(workload)[0]}" in env["OTEL_RESOURCE_ATTRIBUTES"]
    deployment = find("Deployment", "otel-collector")
    (collector,) = pod_spec(deployment)["containers"]
    assert selects(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports(collector))
    (config_flag,) = collector["args"]
    config_path = PurePosixPath(config_flag.removeprefix("--config="))
    (mount,) = collector["volumeMounts"]
    assert PurePosixPath(mount["mountPath"]) == config_path.parent
    (volume,) = pod_spec(deployment)["volumes"]
    assert volume["name"] == mount["name"]
    settings = yaml.safe_load(find("ConfigMap", volume["configMap"]["name"])["data"][config_path.name])
    receivers, exporters = settings["receivers"], settings["exporters"]
    assert port_of(receivers["otlp"]["protocols"]["grpc"]["endpoint"]) == ports(collector)["otlp-grpc"]
    assert port_of(settings["extensions"]["health_check"]["endpoint"]) == ports(collector)["health"]
    assert settings["service"]["extensions"] == ["health_check"]
    used_receivers, used_exporters = set(), set()
    for pipeline in settings["service"]["pipelines"].values():
        used_receivers |= set(pipeline["receivers"])
        used_exporters |= set(pipeline["exporters"])
    assert used_receivers == set(receivers) and used_exporters == set(exporters)
    # Traces go to Jaeger's OTLP port, as in docker/otel-collector.yaml.
    jaeger = find("Service", "jaeger")
    jaeger_otlp = {p["name"]: p["port"] for p in jaeger["spec"]["ports"]}["otlp-grpc"]
    assert exporters["otlp_grpc/jaeger"]["endpoint"] == f"jaeger:{jaeger_otlp}"
