# The two set-up commands: `make demo` and `make test`. Both create or refresh .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvpool-installed

# NOTE: without CUDA, install the CPU build of torch before anything that depends on torch, so
# that the unpinned `torch` requirement is already satisfied and no CUDA build is downloaded.
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvpool demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
