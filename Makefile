# Two entry points: `make demo` (the main job on its embedded default) and `make test`.
# Both create/reuse the project's own virtualenv in .venv (CPU torch first, then the rest).
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint format bench

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	# CPU torch first: otherwise a dependency resolves to the newest CUDA torch (GBs).
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[cpu,dev]'
	# Both fail to load against CPU torch and break `import vllm`.
	$(VENV)/bin/pip uninstall -q -y torchaudio torchcodec || true
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rollmatch demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .
	# Import layers: a module imports only from its own layer and below (tools/check_layers.py).
	$(VENV)/bin/python tools/check_layers.py

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	for b in bench/*.py; do echo "== $$b"; $(VENV)/bin/python $$b || exit 1; done
