# Two commands a fresh machine needs: `make demo` and `make test`. Both build the
# virtual environment first when it is missing (CPU torch pinned by constraints-cpu.txt).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= constraints-cpu.txt
DEMO_ARGS ?=

.PHONY: demo test test-gpu lint format venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[test]'
	touch $@

demo: venv
	$(PY) -m miles_plugins.demo $(DEMO_ARGS)

test: venv
	$(PY) -m pytest -q tests

# The GPU tier, on a CUDA machine with megatron-core importable: it runs with that
# machine's own torch (no venv), e.g. PYTHONPATH=/tmp/site for a carried wheel.
test-gpu:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON) -m pytest -q -m gpu tests/gpu

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
