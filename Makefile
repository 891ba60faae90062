# Two entry points: `make demo` (the main job on its embedded default) and `make test`.
# Both create/reuse the project's own virtualenv in .venv (CPU torch first, then the rest).
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
# ms-swift's own request/response classes for the compatibility test: its pins clash with ours, so it
# gets a separate venv (ms-swift --no-deps + the few packages its protocol module imports), built once.
SWIFT_VENV := .venv-swift
SWIFT_STAMP := $(SWIFT_VENV)/.installed
SWIFT_VERSION := 4.6.0

.PHONY: venv swift-venv demo test test-unit test-integration test-stress bench-smoke lint format bench

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	# CPU torch first: otherwise a dependency resolves to the newest CUDA torch (GBs).
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[cpu,dev]'
	# Both fail to load against CPU torch and break `import vllm`.
	$(VENV)/bin/pip uninstall -q -y torchaudio torchcodec || true
	touch $(STAMP)

swift-venv: $(SWIFT_STAMP)

$(SWIFT_STAMP): tests/server/swift_requirements.txt
	test -x $(SWIFT_VENV)/bin/python || $(PY) -m venv $(SWIFT_VENV)
	$(SWIFT_VENV)/bin/pip install -q torch==2.13.0
	$(SWIFT_VENV)/bin/pip install -q --no-deps ms-swift==$(SWIFT_VERSION)
	$(SWIFT_VENV)/bin/pip install -q -r tests/server/swift_requirements.txt
	$(SWIFT_VENV)/bin/python -c "from swift.infer_engine.protocol import RequestConfig, RolloutInferRequest, RolloutOutput"
	touch $(SWIFT_STAMP)

demo: $(STAMP)
	$(VENV)/bin/rollmatch demo

# The suite; the benchmark scripts' smoke runs (marker `bench`) are `make bench-smoke`, which CI runs after it.
# Two tiers: the unit tier on two pytest-xdist workers, then the integration tier (several processes or a
# vLLM engine per test, marked by tests/conftest.py) one test at a time. Both report their slowest tests.
test: test-unit test-integration

test-unit: $(STAMP) $(SWIFT_STAMP)
	$(VENV)/bin/python -m pytest -q -m "not bench and not integration" -n 2 --durations=20

test-integration: $(STAMP) $(SWIFT_STAMP)
	$(VENV)/bin/python -m pytest -q -m "not bench and integration" --durations=20

# `make test` idle, with every core busy with another job, and pinned to one core; durations and
# results in runs/test-stress/results.tsv (tools/test_stress.sh --help). Takes about an hour.
test-stress: $(STAMP) $(SWIFT_STAMP)
	tools/test_stress.sh

bench-smoke: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m bench

lint: $(STAMP)
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .
	# Import layers: a module imports only from its own layer and below (tools/check_layers.py).
	$(VENV)/bin/python tools/check_layers.py

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	# Scripts with a __main__ block, less health_prober.py (server_hammer.py runs it).
	for b in bench/*.py; do grep -q '__main__' $$b && [ $$b != bench/health_prober.py ] || continue; \
	  echo "== $$b"; $(VENV)/bin/python $$b || exit 1; done
