# slotctl: `make demo` runs the main job, `make test` runs every gate and the tests.
# Both create .venv and install the project on their own (idempotent: a stamp file
# records the installed pyproject.toml).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help install demo test check fmt lint typecheck imports pytest soak bench clean crds

help:
	@echo "make demo    validate and show the quickstart stack (the main job)"
	@echo "make test    all gates (format, lint, mypy --strict, import contracts) + tests"
	@echo "make soak    long-running property and crash tests"
	@echo "make bench   benchmarks (print figures; never fail on timing)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $@

install: $(STAMP)

DEMO_DIR ?= .demo
DEMO_ENV := SLOTCTL_CONFIG_DIR=$(DEMO_DIR)/config SLOTCTL_STATE_DIR=$(DEMO_DIR)/state

demo: install
	@$(BIN)/slotctl stack validate examples/quickstart
	@echo
	@echo "Starting the controller on examples/quickstart (Ctrl-C stops it and its servers)."
	@echo "Dashboard: http://127.0.0.1:8800/  (token: $(DEMO_DIR)/state/token)"
	@echo "In another terminal:"
	@echo "  export $(DEMO_ENV)"
	@echo "  $(BIN)/slotctl slot list                      # states, models, memory"
	@echo "  curl -s localhost:8800/v1/chat/completions -H \"Authorization: Bearer \$$(cat $(DEMO_DIR)/state/token)\" -d '{\"model\":\"demo-chat\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'"
	@echo "  $(BIN)/slotctl events                         # follow every transition"
	@echo "  edit examples/quickstart/quickstart.toml      # only the changed slot restarts"
	@echo "  $(BIN)/slotctl stack diff examples/quickstart --exit-code"
	@echo
	$(DEMO_ENV) $(BIN)/slotctl up examples/quickstart

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

# pytest exits 5 when no test ran: make treats that as a failure, as it should.
pytest: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test: check pytest

soak: install
	SLOTCTL_SOAK=1 $(BIN)/python -m pytest -m slow --timeout=1800 $(PYTEST_ARGS)

bench: install
	@for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(DEMO_DIR) .mypy_cache .ruff_cache .pytest_cache .hypothesis
