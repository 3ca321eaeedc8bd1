# `make demo` and `make test` each set up their own environment first (idempotent).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch/torchvision are installed first, pinned to the pair the CPU tests and CPU results run with
# (no GPU result was measured with it: docs/results/2026-12-04-h200.md ran the machine's torch
# 2.11.0); everything else comes from pyproject.toml lower bounds.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
EXTRAS ?= dev
STAMP  := $(VENV)/.installed
# Test processes at once (a test module each): most tests wait on processes they start (a branch,
# an evaluation, a Prefect worker) and one pytest keeps 2 cores about half busy. The modules go
# out in the order tests/conftest.py gives them (the longest first).
TEST_WORKERS ?= 2
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup install demo test test-release format reference clean

setup: $(STAMP)

# The one install recipe: this machine's .venv (make setup), and the GPU image (docker/Dockerfile:
# make install VENV=/opt/venv EXTRAS=deploy), so CI's fresh set-up runs the image's commands too.
install:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'

$(STAMP): pyproject.toml
	$(MAKE) install
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/merit run configs/demo.yaml --run-dir runs/demo

# The documentation site is built with --strict (a dead link, an unknown anchor or a page missing
# from mkdocs.yml's nav fails it) into an ignored folder, after ruff and before the tests.
SITE_DIR ?= .site

PYTEST = $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(SITE_DIR)
	$(PYTEST) -m "not release" tests

# What only a release needs (pyproject.toml's `release` marker); CI runs it after `make test`.
test-release: $(STAMP)
	$(PYTEST) -m release tests

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The configuration and merge spec references, written from the code (the site's build checks them).
reference: $(STAMP)
	$(BIN)/python docs/hooks.py

clean:
	rm -rf runs .pytest_cache
