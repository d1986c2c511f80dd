# Two set-up commands for a new machine: `make run` and `make test`. Each creates .venv
# and installs what it needs first (pinned torch 2.13.0, CPU build, for development).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: run test test-slow bench bench-compare clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: setup.py requirements-dev.txt | $(PY)
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-deps -e .
	touch $@

run: $(VENV)/.installed
	$(PY) -m torch_gdr

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

test-slow: $(VENV)/.installed
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .benchmarks
