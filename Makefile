# slotctl: `make demo` runs the main job, `make test` runs every gate and the tests.
# Both create .venv and install on their own (idempotent: a stamp file per install
# records the installed pyproject.toml). `make demo` installs only what it runs (the
# package and its runtime dependencies); `make test` adds the test and dev tools (and
# builds llama-cpp-python from source the first time).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: one process). Most tests wait on subprocesses,
# servers and probes, so more workers than cores pays; tests that share a module or
# session fixture (a controller, the private dockerd, kube-apiserver) stay on one worker
# (tests/conftest.py groups them for --dist loadgroup).
PYTEST_WORKERS ?= 3
# Where `make demo` serves the API, router and dashboard (`make demo DEMO_LISTEN=127.0.0.1:8900`).
DEMO_LISTEN ?= 127.0.0.1:8800

.PHONY: help install install-run demo test check fmt lint typecheck imports pytest soak bench clean crds k8s-apiserver

help:
	@echo "make demo    run the controller on the quickstart stack (the main job;"
	@echo "             DEMO_LISTEN=$(DEMO_LISTEN) sets its address)"
	@echo "make test    all gates (format, lint, mypy --strict, import contracts) + tests"
	@echo "make soak    long-running property, crash and hung-server tests"
	@echo "make bench   benchmarks (print figures; never fail on timing)"
	@echo "make k8s-apiserver  build the real Kubernetes tiers' binary (apiserver, etcd,"
	@echo "             scheduler, controller-manager, kubectl, kwok in one)"
	@echo "             (cached; SLOTCTL_K8S_APISERVER=1 make test builds it first)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The dev install (tests, linters, type checker) for `make test` and the gates.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $@

# The runtime install only, for `make demo`.
$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	@touch $@

install: $(STAMP)

install-run: $(RUN_STAMP)

DEMO_DIR ?= .demo
DEMO_ENV := SLOTCTL_CONFIG_DIR=$(DEMO_DIR)/config SLOTCTL_STATE_DIR=$(DEMO_DIR)/state

demo: install-run
	@$(BIN)/slotctl stack validate examples/quickstart
	@echo
	@echo "Starting the controller on examples/quickstart (Ctrl-C stops it and its servers)."
	@echo "Dashboard: http://$(DEMO_LISTEN)/  (token: $(DEMO_DIR)/state/token)"
	@echo "In another terminal:"
	@echo "  export $(DEMO_ENV)"
	@echo "  $(BIN)/slotctl slot list                      # states, models, memory"
	@echo "  curl -s $(DEMO_LISTEN)/v1/chat/completions -H \"Authorization: Bearer \$$(cat $(DEMO_DIR)/state/token)\" -d '{\"model\":\"demo-chat\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'"
	@echo "  $(BIN)/slotctl events                         # recent history, then follow"
	@echo "  edit examples/quickstart/quickstart.toml      # only the changed slot restarts"
	@echo "  $(BIN)/slotctl stack diff examples/quickstart --exit-code"
	@echo
	$(DEMO_ENV) $(BIN)/slotctl up examples/quickstart --listen $(DEMO_LISTEN)

# The CRDs are generated from the stack schema; tests/k8s/test_crd.py checks they are current.
crds: install
	$(BIN)/slotctl crd generate --output-dir crds --output-dir charts/slotctl/crds

fmt: install
	$(BIN)/ruff format controller tests bench

lint: install
	$(BIN)/ruff format --check controller tests bench
	$(BIN)/ruff check controller tests bench

typecheck: install
	$(BIN)/mypy --strict controller

imports: install
	$(BIN)/lint-imports

check: lint typecheck imports

# The real Kubernetes tiers (tests/k8s/test_real_apiserver.py: kube-apiserver + etcd;
# tests/k8s/test_real_control_plane.py: + kube-scheduler, kube-controller-manager, kubectl
# and kwok: all one binary, tools/k8s/build.sh) run when it is in ~/.cache/slotctl/k8s;
# SLOTCTL_K8S_APISERVER=1 builds it first (Go and the module proxy; the first time on 2
# cores, then cached: see docs/kubernetes.md for the measured times; a build already
# running, as .ci/run starts one, is waited for) and makes a missing build a test failure
# instead of a skip. .ci/run sets it.
# With SLOTCTL_K8S_APISERVER=1 and no PYTEST_ARGS (`make test` as .ci/run runs it), the
# real tiers' test files run in a second pytest run after the rest, once tools/k8s/build.sh
# has the binary: a build already running (.ci/run starts one in the background at the
# lowest priority, so it takes what the rest of the suite leaves idle) is waited for, and
# a failed one is tried again, and fails the run. The second run runs whatever the first
# one's result, which the target then returns. Otherwise the build comes first and one
# pytest run has every test.
K8S_TESTS := $(sort $(wildcard tests/k8s/test_real_*.py tests/k8s/test_units_real_*.py))
K8S_SPLIT := $(if $(filter 1,$(SLOTCTL_K8S_APISERVER)),$(if $(strip $(PYTEST_ARGS)),,1),)
K8S_BUILD := $(if $(filter 1,$(SLOTCTL_K8S_APISERVER)),$(if $(K8S_SPLIT),,k8s-apiserver),)
PYTEST := $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup

k8s-apiserver:
	tools/k8s/build.sh

# pytest exits 5 when no test ran (with workers too): make treats that as a failure.
pytest: install $(K8S_BUILD)
ifeq ($(K8S_SPLIT),1)
	status=0; $(PYTEST) $(addprefix --ignore=,$(K8S_TESTS)) || status=$$?; \
	tools/k8s/build.sh && $(PYTEST) $(K8S_TESTS) && exit $$status
else
	$(PYTEST) $(PYTEST_ARGS)
endif

test: check pytest

soak: install
	SLOTCTL_SOAK=1 $(BIN)/python -m pytest -m slow --timeout=1800 $(PYTEST_ARGS)

bench: install
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(DEMO_DIR) .mypy_cache .ruff_cache .pytest_cache .hypothesis
