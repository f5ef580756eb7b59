# Two commands a fresh machine needs: `make demo` and `make test`. Both build the
# virtual environment first when it is missing (CPU torch pinned by constraints-cpu.txt).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= constraints-cpu.txt
DEMO_ARGS ?=

.PHONY: demo test test-topology faults test-kernels test-gpu lint format venv clean apply-patches revert-patches patch-status drift matrix bench-gpu bench-report bench-checkpoint bench-moments bench-codec

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[test]'
	touch $@

demo: venv
	$(PY) -m miles_plugins.demo $(DEMO_ARGS)

# The suite runs on every core, up to 8 (pytest-xdist workers, one torch thread each);
# TEST_WORKERS=0 runs it in one process, TEST_WORKERS=N on N workers.
TEST_WORKERS ?= auto
PARALLEL := -n $(TEST_WORKERS) --maxprocesses 8 --dist worksteal

test: venv
	$(PY) -m pytest -q $(PARALLEL) -m "not topology" tests

# Resume at other TP, PP and EP sizes with real megatron-core on spawned CPU ranks (slow: each
# world imports megatron-core once per rank), online and through `ckpt reshard`.
test-topology: venv
	$(PY) -m pytest -q -m topology tests/unit

# The failure scenarios (also part of `make test`), with their report table.
faults: venv
	$(PY) -m pytest -q $(PARALLEL) -m fault --fault-report tests/unit

# The fused codec kernels run by Triton's interpreter on the CPU: their bytes against the
# reference, and their self-test against planted bugs. Triton (CPU use only) goes into
# $(TRITON_DIR) the first time; `make test` skips these tests without it.
TRITON_DIR ?= .triton
test-kernels: venv
	test -f $(TRITON_DIR)/triton/__init__.py || $(PY) -m pip install --quiet --target $(TRITON_DIR) triton==3.7.1
	PYTHONPATH=$(CURDIR)/$(TRITON_DIR) $(PY) -m pytest -q tests/unit/test_fused_codec_interpreted.py tests/unit/test_fused_kernel_mutants.py

# The GPU tier, on a CUDA machine with megatron-core importable: it runs with that
# machine's own torch (no venv), e.g. PYTHONPATH=/tmp/site for a carried wheel.
test-gpu:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON) -m pytest -q -m gpu tests/gpu

# The patch series on a Megatron-LM tree (a checkout, or a dir holding megatron/ such as
# a megatron-core >= 0.17 wheel's site-packages): idempotent; nothing changes on a conflict.
apply-patches revert-patches patch-status drift: MEGATRON_CLI = $(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m megatron_hooks
apply-patches:
	@test -n "$(MEGATRON_DIR)" || { echo "usage: make $@ MEGATRON_DIR=/path/to/Megatron-LM"; exit 2; }
	$(MEGATRON_CLI) apply --megatron-dir "$(MEGATRON_DIR)"

revert-patches:
	@test -n "$(MEGATRON_DIR)" || { echo "usage: make $@ MEGATRON_DIR=/path/to/Megatron-LM"; exit 2; }
	$(MEGATRON_CLI) revert --megatron-dir "$(MEGATRON_DIR)"

# The command's exit status 1 means "not (or not fully) patched": a report, not a failure
# of make (whose "*** Error 1" after it reads like a crash); 2, it could not run, fails.
patch-status:
	@test -n "$(MEGATRON_DIR)" || { echo "usage: make $@ MEGATRON_DIR=/path/to/Megatron-LM"; exit 2; }
	@$(MEGATRON_CLI) status --megatron-dir "$(MEGATRON_DIR)" || { status=$$?; test $$status -eq 1 || exit $$status; \
		echo "(not patched as this version needs: make apply-patches MEGATRON_DIR=$(MEGATRON_DIR) applies the series)"; }

drift: venv
	@test -n "$(MEGATRON_DIR)" || { echo "usage: make $@ MEGATRON_DIR=/path/to/Megatron-LM"; exit 2; }
	$(PY) -m megatron_hooks drift --megatron-dir "$(MEGATRON_DIR)"

# The matrix of Megatron sources (ci/matrix.toml). Wheel entries need only the package
# registry; git entries run given local clones: make matrix MEGATRON_REPOS="/src/Megatron-LM /src/radixark".
matrix: venv
	$(PY) -m ci.matrix $(foreach r,$(MEGATRON_REPOS),--megatron-repo $(r)) --json matrix-results.json

# Benchmarks write JSON under bench-results/ and print a table; bench/results/ keeps the
# committed files that `make bench-report` turns into the README's and docs' tables
# (docs/performance.md). The suite (bench/suite.py): Megatron-LM's pretrain_gpt.py in every
# mode of a workload, each beside its resident run and Megatron dev's offload; on the GPU
# machine, with its own torch (no venv), as test-gpu; MEGATRON_LM_DIR names a patched tree,
# MEGATRON_DEV_DIR a dev checkout. E.g. BENCH_ARGS="--workload dense-1b --plan".
bench-gpu:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON) -m bench.suite $(BENCH_ARGS)

bench-report: venv
	$(PY) -m bench.report $(BENCH_ARGS)

bench-checkpoint: venv
	$(PY) -m bench.checkpoint_save $(BENCH_ARGS)

# How moment storage formats train (CPU, about a minute): bench/moment_formats.py. The
# GPU counterpart, a real Megatron GPT for 300 steps, is tests/gpu/harness/moment_training.py.
bench-moments: venv
	$(PY) -m bench.moment_formats $(BENCH_ARGS)

# The storage codecs, reference and fused, on a whole 7.6B GPT's state (CUDA + Triton).
bench-codec: venv
	$(PY) -m bench.codec $(BENCH_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .cache matrix-results.json bench-results
