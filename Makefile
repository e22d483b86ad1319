# The README's two commands: `make demo` and `make test`. Each does its own set-up and is idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export KVFLEET_CACHE ?= $(CURDIR)/.cache

.PHONY: demo test venv controlplane unit e2e lint crds clean

# The venv is rebuilt when the project's dependency files change.
$(STAMP): pyproject.toml $(wildcard scripts/install-*.sh)
	bash scripts/install-python-deps.sh $(VENV) $(PYTHON)
	touch $(STAMP)

venv: $(STAMP)

controlplane:
	bash e2e/build-controlplane.sh

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy --strict -p kvfleet.mell -p kvfleet.sim -p kvfleet.api

crds: venv
	$(VENV)/bin/kvfleet crds

unit: venv
	$(PY) -m pytest tests

e2e: venv controlplane
	$(PY) -m pytest e2e

test: venv controlplane
	$(MAKE) --no-print-directory lint
	$(PY) -m pytest tests e2e

demo: venv controlplane
	PYTHONPATH=e2e $(PY) -m kvfleet_e2e.demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .hypothesis
