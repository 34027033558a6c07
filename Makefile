# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; an unpinned `torch` would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test install install-dev lint kernels bench data clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

demo: install
	$(BIN)/splitphase demo

lint: install-dev
	$(BIN)/ruff check src tests bench tools
	$(BIN)/mypy src

# The native decode kernel (C++, built with this machine's g++; torch fallback if it fails).
kernels: install
	$(BIN)/python -m splitphase.kernels.build

# Two workers (pytest-xdist), each module's tests on one of them so a module's server or model
# fixture is set up once: the suite keeps about one core busy on its own, and on a slow
# 2-core host (AMD Zen 3 under load, session 43) it took 15.5 min serially, 8.7 min so. Tests
# marked `serial` hold timings to bounds and run afterwards, alone.
TEST_WORKERS ?= 2

test: lint kernels
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope -m "not serial"
	$(BIN)/python -m pytest -m serial

# Benchmarks are not tests: llama-cpp-python compiles llama.cpp from source (minutes).
$(VENV)/.installed-bench: $(VENV)/.installed-dev
	$(BIN)/pip install -q gguf llama-cpp-python
	touch $@

bench: $(VENV)/.installed-bench kernels
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$$(nproc)} $(BIN)/python bench/phase_limits.py

data: install
	$(BIN)/splitphase data prepare

clean:
	rm -rf $(VENV) build dist src/*.egg-info
