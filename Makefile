# Two set-up commands for a new machine: `make run` and `make test`. Each creates .venv
# and installs what it needs first (pinned torch 2.13.0, CPU build, for development).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: run test test-slow bench bench-baseline bench-compare clean

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

# Benchmarks (pytest-benchmark, bench/): `make bench` runs and saves a numbered run under
# .benchmarks/; `make bench-baseline` saves a run as the baseline; `make bench-compare` fails
# when any benchmark's mean is more than BENCH_FAIL slower than the baseline. On a shared
# machine, BENCH_ENV=OMP_WAIT_POLICY=PASSIVE keeps OpenMP threads from spinning.
BENCH_ENV ?=
BENCH_FLAGS ?= -p benchmark --benchmark-only --benchmark-storage=.benchmarks \
	--benchmark-columns=min,median,iqr,rounds --benchmark-sort=name
BENCH_FAIL ?= mean:25%

bench: $(VENV)/.installed
	$(BENCH_ENV) $(PY) -m pytest bench $(BENCH_FLAGS) --benchmark-autosave

bench-baseline: $(VENV)/.installed
	$(BENCH_ENV) $(PY) -m pytest bench $(BENCH_FLAGS) --benchmark-save=baseline

bench-compare: $(VENV)/.installed
	$(BENCH_ENV) $(PY) -m pytest bench $(BENCH_FLAGS) --benchmark-compare='*_baseline' \
		--benchmark-compare-fail=$(BENCH_FAIL)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .benchmarks
