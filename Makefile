# Every target installs into .venv from requirements.lock (exact pins: no resolver backtracking).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The browser test (tests/test_registry_e2e.py) drives Debian's chromium through Playwright; Playwright's
# own browser download does not work on our machines. Installed once, only when it is missing.
CHROMIUM := /usr/bin/chromium
CHROMIUM_STAMP := $(VENV)/.chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# pytest-timeout guards every test; distributed tests set tighter ones themselves.
PYTEST_ARGS ?=
# Test files run on this many pytest-xdist workers, a whole file to a worker (its module fixtures
# are built once). Serially the suite keeps ~1.2 of 2 cores busy (much of it is one process
# importing, or waiting on a server); 2 workers took it from 18 to 13 minutes. Each worker
# starts its own MLflow and S3 servers. PYTEST_WORKERS=0 runs in this process, one test at a time.
# --no-loadscope-reorder keeps tests/conftest.py's order of files (the long ones first): without
# it xdist hands them out by how many tests each holds, and a two-minute file of one test ends
# the run on one worker.
PYTEST_WORKERS ?= 2

.PHONY: install run test test-fast bench lock lock-cuda lint format clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -qq --upgrade pip
	$(BIN)/pip install -qq -r requirements.lock
	$(BIN)/pip install -qq --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/pyflyte run workflows/train.py training_pipeline $(ARGS)

test: $(STAMP) $(CHROMIUM_STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The unit tier: every test not marked slow (tests/conftest.py), a few minutes at most; `make test` is
# the whole suite, which CI runs.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

$(CHROMIUM_STAMP): | $(STAMP)
	@if [ ! -x $(CHROMIUM) ]; then \
	  echo "installing Debian's chromium for the MLflow UI test (apt-get)"; \
	  { $(SUDO) apt-get update -qq && \
	    $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } || { \
	    echo "error: could not install chromium with apt-get (needs root or sudo, and a Debian package mirror)." >&2; \
	    echo "       Install it yourself: apt-get install chromium (tests/test_registry_e2e.py needs $(CHROMIUM))" >&2; \
	    exit 1; }; \
	fi
	@[ -x $(CHROMIUM) ] || { echo "error: apt-get ran but $(CHROMIUM) is still missing" >&2; exit 1; }
	touch $@

bench: $(STAMP)
	$(BIN)/python -m benchmarks

# The formatter and linter (ruff), the type checker (mypy, its files in pyproject.toml), the import
# contracts (import-linter, pyproject.toml) and the Dockerfile's linter. `make format` applies ruff's fixes.
LINTED := flyscale plugins tasks workflows tests benchmarks

lint: $(STAMP)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy
	$(BIN)/hadolint Dockerfile

format: $(STAMP)
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

# Recompile the lock after changing pyproject.toml or lock-constraints.txt (needs `pip install uv`).
# It is compiled against the CPU build (torch==X+cpu, found in TORCH_WHEELS), so that it lists none
# of the CUDA build's nvidia-* wheels; then torch is pinned as ==X, which the public index has
# (a local +cpu version is on no public index, and satisfies ==X where pip can find one).
TORCH_WHEELS ?= /opt/wheels
lock:
	uv pip compile pyproject.toml --extra dev -c lock-constraints.txt \
	  --find-links $(TORCH_WHEELS) --python-version 3.11 --no-header --no-emit-find-links \
	  -o requirements.lock
	sed -i -E 's/^torch==([^+]+)\+cpu$$/torch==\1/' requirements.lock

# The GPU image's lock (Dockerfile: --build-arg LOCK_FILE=requirements-cuda.lock). Run after `make lock`:
# every pin of requirements.lock but torch is a constraint here, so the two locks agree on all they
# share; torch is PyPI's build of the same version (lock-constraints.txt's pin without +cpu), the
# CUDA one, which adds the nvidia-* wheels. No --find-links: the CPU wheel there would satisfy
# torch==X too. Constraints come on stdin so that no temporary path lands in the lock's comments.
lock-cuda:
	{ sed -E 's/^torch==([^+]+)\+cpu$$/torch==\1/' lock-constraints.txt; \
	  grep -E '^[A-Za-z0-9._-]+==' requirements.lock | grep -v '^torch=='; } | \
	uv pip compile pyproject.toml --extra dev -c - \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header \
	  -o requirements-cuda.lock

clean:
	rm -rf $(VENV) mlflow.db mlruns mlartifacts .flyscale
