# The two commands of the README. Each creates what it needs on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test install-dev clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.dev-installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install-dev: $(VENV)/.dev-installed

## run: start Sluice (embedded Redis, workers, gateway) on http://127.0.0.1:8000
run: $(VENV)/.dev-installed
	$(BIN)/sluice up $(ARGS)

## test: run the whole test suite against real Redis and real processes
test: $(VENV)/.dev-installed
	$(BIN)/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
