# Two set-up commands for a new machine: `make run` and `make test`. Each creates .venv
# and installs what it needs first (pinned torch 2.13.0, CPU build, for development).
# torch_gdr itself is installed editable without build isolation, so that setup.py sees the
# venv's torch and compiles the fused CPU kernels in place (git-ignored); where it cannot,
# they are built at first use instead. The venv's bin goes first on PATH for that step, so
# torch's build finds the venv's ninja and compiles the sources side by side.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: run test test-slow bench bench-baseline bench-compare bench-npu bench-npu-saturating clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Not quiet: pip says what it collects and installs (a line every 15 s while it unpacks,
# which it does without a word: torch alone takes half a minute on a loaded machine), and the
# kernels' build (-v shows setup.py's lines) says when each variant starts and ends, with a
# line every 15 s while it compiles. Only the variant this CPU runs is built here
# (TORCH_GDR_CPU_VARIANTS, unless set already; `python torch_gdr/ops/cpu/_variants.py` prints
# it); wheels build them all.
$(VENV)/.installed: setup.py requirements-dev.txt | $(PY)
	( n=0; while sleep 15 >/dev/null 2>&1; do n=$$((n + 15)); echo "make: pip install still running ($$n s)"; done ) & beat=$$!; \
		$(PIP) install -r requirements-dev.txt; status=$$?; kill $$beat; exit $$status
	variants="$${TORCH_GDR_CPU_VARIANTS-$$($(PY) torch_gdr/ops/cpu/_variants.py)}" && \
		echo "torch_gdr: installing editable, building the fused CPU kernels for: $${variants:-none}" && \
		PATH="$(abspath $(VENV))/bin:$$PATH" TORCH_GDR_CPU_VARIANTS="$$variants" \
		$(PIP) install -v --no-deps --no-build-isolation -e .
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
BENCH_FLAGS ?= -n 0 -p benchmark --benchmark-only --benchmark-storage=.benchmarks \
	--benchmark-columns=min,median,iqr,rounds --benchmark-sort=name
BENCH_FAIL ?= mean:25%

bench: $(VENV)/.installed
	$(BENCH_ENV) $(PY) -m pytest bench $(BENCH_FLAGS) --benchmark-autosave

bench-baseline: $(VENV)/.installed
	$(BENCH_ENV) $(PY) -m pytest bench $(BENCH_FLAGS) --benchmark-save=baseline

bench-compare: $(VENV)/.installed
	$(BENCH_ENV) $(PY) -m pytest bench $(BENCH_FLAGS) --benchmark-compare='*_baseline' \
		--benchmark-compare-fail=$(BENCH_FAIL)

# The PyPTO kernel in pypto's cost model (stock SIM, Ascend 910B): T = 256, 1024, 4096,
# 16384, 16 x 256 and 16 x 1024 (H=2, HV=4, K=V=128, fp32, l2norm, initial state); appends
# the table to bench/RESULTS.md. Minutes per row on a loaded machine. BENCH_NPU_FLAGS adds
# options (e.g. --out DIR to keep pypto's SIM output, --dtype bfloat16).
BENCH_NPU_FLAGS ?=

bench-npu: $(VENV)/.installed
	OMP_NUM_THREADS=1 nice -n 10 $(PY) bench/pypto_cost_model.py --suite --append bench/RESULTS.md $(BENCH_NPU_FLAGS)

# The saturating shapes (H16/HV32 8 x 1024, H16/HV16 4 x 4096), forward, fp32 then bf16;
# BENCH_NPU_FLAGS=--backward for the backward (each backward row needs ~9 GB of host memory).
bench-npu-saturating: $(VENV)/.installed
	for dtype in float32 bfloat16; do \
		OMP_NUM_THREADS=1 nice -n 10 $(PY) bench/pypto_cost_model.py --suite saturating --dtype $$dtype \
			--append bench/RESULTS.md $(BENCH_NPU_FLAGS) || exit 1; \
	done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .benchmarks
	rm -f torch_gdr/ops/cpu/_C_*.so torch_gdr/ops/cpu/_C_build.json
