# moe-rl: `make demo` and `make test` work on a fresh machine (README).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-unit test-dist test-gpu lint format clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned, so that no dependency pulls a CUDA build
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/moe-rl demo

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 tests

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

test-dist: $(STAMP)
	$(BIN)/python -m pytest -q tests/dist

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q tests/gpu

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache
