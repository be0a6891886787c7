# ringq: every step a fresh clone needs lives here.
#   make test     set up the virtualenv, generate code, lint, type-check, run the tests
#   make wheels   build the ringq (SDK, ringqctl) and ringq-server (broker, pipeline) wheels into dist/
#   make demo     a 3-node cluster, a mirrored queue through a SIGKILL of its master, the Spark lifecycle report
#   make demo-ring  the GM ring alone through a member kill: what each member delivered
#   make sim      run the deterministic ring simulation over SEEDS seeds (default 20000)
#   make sim-queues  run the deterministic simulation of a mirrored durable queue over SEEDS seeds (default 20000)
#   make bench-gm measure confirmed-broadcast throughput through a 3-member ring of processes
#   make bench    ringq mirrored queues vs RabbitMQ classic mirrored queues and NATS JetStream R3 (W1-W3), updates docs/benchmarks.md
#   make bench-tracing  W1 with tracing off against a commit without the tracing hooks
#   make bench-security W1 and W2 with TLS and authentication beside plaintext
#   make bench-streams  ordered streams: ringq vs a RabbitMQ quorum queue vs NATS JetStream (R3, file), updates docs/benchmarks.md
#   make soak     W2 at 10,000 msgs/s for 30 minutes, every node's RSS each minute, updates docs/benchmarks.md
#   make bench-scale  W1 by replicas, many queues (and their idle CPU), body sizes, memory per queued message, updates docs/benchmarks.md
#   make bench-floor  Python gRPC alone: a stream write's CPU and three path shapes of bare relays (ringq's five hops, delivery beside the ring, no ring), each paced exactly and as make bench paces, updates docs/benchmarks.md
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
GEN := clients/python/ringq/v1
GEN_INTERNAL := clients/python/ringq/internal/v1
PROTOS := $(wildcard protos/ringq/v1/*.proto) $(wildcard protos/ringq/internal/v1/*.proto)
SEEDS ?= 20000
# `make test` runs the test files on this many pytest-xdist workers (a file stays on one worker, so its
# module-wide cluster starts once); most tests wait on processes, timers and disks more than on CPU.
TEST_WORKERS ?= 2
# buf (lint and breaking-change checks of protos/), from the npm registry, pinned; protos/releases holds
# the image of each released API (protos/releases/README.md says what each changed); `buf breaking`
# compares with the newest.
BUF_VERSION := 1.75.0
BUF := $(VENV)/buf/node_modules/.bin/buf
PROTO_RELEASE := protos/releases/v0.2.binpb

.PHONY: all setup wheels setup-node setup-zookeeper setup-rabbitmq protos lint lint-k8s test sim sim-queues demo demo-ring bench bench-gm bench-tracing bench-security bench-streams bench-reference setup-nats soak bench-scale bench-floor clean

all: test

# Both distributions of the repository, editable, with every extra: ringq (clients/python: the SDK and
# ringqctl) and ringq-server (here: services/, pipeline/, the `ringq` command; dev tools as its extra).
$(VENV)/.stamp-install: pyproject.toml setup.py clients/python/pyproject.toml clients/python/setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e './clients/python[server,pipeline]' -e '.[pipeline,dev]'
	@# ringq.egg-info here is the one distribution before the split: it would shadow ringq's metadata.
	rm -rf ringq.egg-info
	touch $@

setup: $(VENV)/.stamp-install protos

$(GEN)/.stamp-protos: $(PROTOS) $(VENV)/.stamp-install
	rm -rf $(GEN) $(GEN_INTERNAL) && mkdir -p $(GEN) $(GEN_INTERNAL)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m grpc_tools.protoc -Iprotos --python_out=clients/python --grpc_python_out=clients/python \
	  --mypy_out=clients/python --mypy_grpc_out=clients/python $(PROTOS)
	touch $(GEN)/__init__.py $(GEN)/py.typed clients/python/ringq/internal/__init__.py $(GEN_INTERNAL)/__init__.py
	touch $@

protos: $(GEN)/.stamp-protos

# The wheels of ringq and ringq-server in dist/, built from the source tree as it is; each build generates
# its gRPC code from protos/ itself (grpcio-tools is a build requirement), whatever `make protos` left.
wheels: $(VENV)/.stamp-install
	rm -rf build clients/python/build dist/ringq-*.whl dist/ringq_server-*.whl
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir dist ./clients/python .
	@ls -1 dist/ringq-*.whl dist/ringq_server-*.whl

# The Node.js client (clients/node) for the interop test: its pinned packages from the npm registry.
setup-node:
	@if command -v npm >/dev/null 2>&1; then \
	  test -d clients/node/node_modules || (cd clients/node && npm ci --no-audit --no-fund --silent); \
	else echo "npm not found: the Node.js interop test will be skipped"; fi

# The store contract tests run against a real ZooKeeper (Debian's package,
# started by the tests on 127.0.0.1 and stopped by them).
setup-zookeeper:
	@if ! dpkg -s zookeeper >/dev/null 2>&1; then \
	  echo "installing Debian's zookeeper package"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq zookeeper >/dev/null; \
	fi

# The reference side of the benchmarks: Debian's RabbitMQ 3.x, started by bench/reference on
# 127.0.0.1 (private ports and epmd) and stopped by it.
setup-rabbitmq:
	@if ! dpkg -s rabbitmq-server >/dev/null 2>&1; then \
	  echo "installing Debian's rabbitmq-server package"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null; \
	fi

# The NATS side of `make bench-streams`: Debian's nats-server (JetStream), a 3-server cluster started by
# bench/nats_cluster.py on 127.0.0.1 and stopped by it.
setup-nats:
	@if ! dpkg -s nats-server >/dev/null 2>&1; then \
	  echo "installing Debian's nats-server package"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server >/dev/null; \
	fi

bench-reference: setup setup-rabbitmq
	mkdir -p var && $(PY) -m bench.reference --json var/bench-reference.json

$(BUF): | $(VENV)/.stamp-install
	npm install --prefix $(VENV)/buf --no-save --no-audit --no-fund --silent @bufbuild/buf@$(BUF_VERSION)

# The Kubernetes manifests (deploy/kubernetes) against the API schemas kubernetes-validate ships (a dev
# dependency), strictly (an unknown field is an error), for the oldest Kubernetes they are for and the
# newest the validator knows; with kubectl on the PATH, the kustomization as rendered too. In quiet mode
# the validator prints only problems, and a kind it has no schema for is only a warning: any output fails.
K8S_DIR := deploy/kubernetes
K8S_MANIFESTS := $(filter-out %/kustomization.yaml,$(wildcard $(K8S_DIR)/*.yaml))
K8S_VERSIONS := 1.29.0 1.37.0
K8S_VALIDATE := $(VENV)/bin/kubernetes-validate --strict --quiet $(addprefix -k ,$(K8S_VERSIONS))

lint-k8s: $(VENV)/.stamp-install
	@out=$$($(K8S_VALIDATE) $(K8S_MANIFESTS) 2>&1) && [ -z "$$out" ] || { echo "$$out"; exit 1; }
	@if command -v kubectl >/dev/null 2>&1; then \
	  kubectl kustomize $(K8S_DIR) > $(VENV)/kubernetes-rendered.yaml && \
	  out=$$($(K8S_VALIDATE) $(VENV)/kubernetes-rendered.yaml 2>&1) && [ -z "$$out" ] || { echo "$$out"; exit 1; }; \
	  echo "lint-k8s: $(words $(K8S_MANIFESTS)) manifests and the rendered kustomization valid for Kubernetes $(K8S_VERSIONS)"; \
	else \
	  echo "lint-k8s: $(words $(K8S_MANIFESTS)) manifests valid for Kubernetes $(K8S_VERSIONS) (no kubectl: kustomization not rendered)"; \
	fi

lint: setup $(BUF) lint-k8s
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(BUF) lint
	$(BUF) breaking --against $(PROTO_RELEASE)

test: setup setup-node setup-zookeeper lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile

sim: setup
	$(PY) -m tests.sim.run --seeds $(SEEDS)

sim-queues: setup
	$(PY) -m tests.sim.run_queues --seeds $(SEEDS)

demo: setup
	$(PY) -m services.demo

demo-ring: setup
	$(PY) -m services.demo_ring

bench: setup setup-rabbitmq setup-nats
	$(PY) -m bench.bench_queues --write docs/benchmarks.md

bench-tracing: setup
	$(PY) -m bench.tracing_cost --runs 5 --write docs/benchmarks.md

bench-security: setup
	$(PY) -m bench.security_cost --runs 3 --write docs/benchmarks.md

bench-streams: setup setup-rabbitmq setup-nats
	$(PY) -m bench.bench_streams --write docs/benchmarks.md

bench-gm: setup
	$(PY) -m bench.bench_gm --write docs/benchmarks.md

# Issue 13's memory goal: W2 at a fixed 10,000 msgs/s for 30 minutes (about 33 minutes in all) against 3 nodes
# with default settings; RSS flat within 10 % after warm-up. Shorter: $(PY) -m bench.soak --minutes N.
soak: setup
	$(PY) -m bench.soak --write docs/benchmarks.md

# Scale figures (about 10 minutes): W1 with 1/2/3/5 replicas, 1/100/1,000 queues (throughput, idle CPU),
# 256 B/64 KiB/1 MiB bodies, memory per queued message (1,000,000 in one queue). See --help for shorter runs.
bench-scale: setup
	$(PY) -m bench.bench_scale --write docs/benchmarks.md

# The floor under every hop (about 30 s): what one gRPC stream write costs, and ringq's path shape of bare relays.
bench-floor: setup
	$(PY) -m bench.grpc_floor --pacing exact,tick --write docs/benchmarks.md

clean:
	rm -rf $(VENV) $(GEN) clients/python/ringq/internal .pytest_cache .mypy_cache .ruff_cache *.egg-info \
	  clients/python/*.egg-info build clients/python/build dist
