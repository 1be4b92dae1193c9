# Every target installs into .venv from requirements.lock (exact pins: no resolver backtracking).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-timeout guards every test; distributed tests set tighter ones themselves.
PYTEST_ARGS ?=

.PHONY: install run test bench lock lint clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -qq --upgrade pip
	$(BIN)/pip install -qq -r requirements.lock
	$(BIN)/pip install -qq --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/pyflyte run workflows/train.py training_pipeline $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks

lint: $(STAMP)
	$(BIN)/hadolint Dockerfile

# Recompile the lock after changing pyproject.toml or lock-constraints.txt (needs `pip install uv`).
# --find-links is where pip's configuration on our machines keeps the CPU torch wheel.
lock:
	uv pip compile pyproject.toml --extra dev -c lock-constraints.txt \
	  --find-links /opt/wheels --python-version 3.11 --no-header --no-emit-find-links \
	  -o requirements.lock

clean:
	rm -rf $(VENV) mlflow.db mlartifacts .flyscale
