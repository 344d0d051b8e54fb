# Two commands: `make bench` (the main job) and `make test` (the whole suite).
# Both create .venv on first use. torch==2.13.0 is installed first and on its own:
# a torch range that admits a newer release makes pip download a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup bench test docs dist clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[all]'
	touch $(STAMP)

setup: $(STAMP)

bench: $(STAMP)
	$(BIN)/torch-r3 bench

test: $(STAMP)
	$(BIN)/python -m pytest -q
	# The host-to-GPU check measures only where CUDA exists; elsewhere it says so and exits 0.
	$(BIN)/python benchmarks/gpu_check.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# The wheel users install (LICENSE and py.typed inside; tests/test_packaging.py checks it).
dist: $(STAMP)
	$(BIN)/pip wheel . --no-deps --no-build-isolation -w dist

clean:
	rm -rf $(VENV) site build dist *.egg-info
