# FanStore: `make demo` and `make test` work on a fresh Debian machine (as root or with sudo).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# test processes for `make test`: one per CPU and two more, 4 to 10. Some modules mostly
# wait (node deaths, start timeouts, Slurm jobs): they start first, beside those that
# compute. On 2 cores: 2 processes 9:20 (CPUs idle 19%), 3 6:14, 4 5:40 (pytest alone).
TEST_JOBS ?= $(shell n=$$(nproc); echo $$(( n < 2 ? 4 : (n > 8 ? 10 : n + 2) )))
# `make test-quick` waits for nothing: one process per CPU, 2 to 8
QUICK_JOBS ?= $(shell n=$$(nproc); echo $$(( n < 2 ? 2 : (n > 8 ? 8 : n) )))
TORCH_VERSION ?= 2.13.0
# Tests start thousands of fanstore processes: let them (and pytest's assertion rewriting)
# cache bytecode, even where PYTHONDONTWRITEBYTECODE is set, under .pytest_cache/ rather
# than beside the sources (a third of each CLI start's CPU; measured in the commit).
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(CURDIR)/.pytest_cache/pycache

.PHONY: setup system-deps demo test test-quick test-slow bench slurm-e2e clean

## setup: install missing Debian packages, create .venv, install FanStore with all extras
setup: system-deps $(STAMP)

system-deps:
	@bash tools/setup-system.sh

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all]'
	@# PyTorch (optional; its tests skip without it): only a build the machine already has
	@# locally, never a multi-GB CUDA download from the index.
	@if $(PY) -c 'import torch' 2>/dev/null; then :; \
	elif $(PY) -m pip install --dry-run -q --no-index --no-deps \
	        'torch==$(TORCH_VERSION)' >/dev/null 2>&1; then \
	    echo "setup: installing the local CPU build of torch $(TORCH_VERSION)"; \
	    $(PY) -m pip install -q 'torch==$(TORCH_VERSION)'; \
	else echo "setup: no local build of torch: the PyTorch tests will be skipped"; fi
	@# The tests' processes read bytecode from .pytest_cache/pycache (TEST_ENV), not from
	@# the __pycache__ pip wrote: compile it there once, now (about 13,000 modules, 24 s on
	@# 2 cores), not in a fresh clone's first suite, by many processes at once (that run
	@# took 6:11 where the next took 5:12: 84 more CPU-seconds).
	@echo "setup: compiling bytecode for the tests' processes"
	@$(TEST_ENV) $(PY) -m compileall -q -j0 \
	    "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
	    fanstore compressors tests >/dev/null 2>&1 || true
	@touch $(STAMP)

## demo: pack a generated sample dataset, mount it, read it back, select a codec, unmount
demo: setup
	@bash tools/demo.sh

## test: the whole default suite (real FUSE mounts, real MPI ranks, real local Slurm), on
## TEST_JOBS processes; then the tests that must run alone (they drop the kernel's caches).
## The 25 slowest tests are listed at the end, so a slow one is seen on the CI log.
## pytest's exit code 5 means "no test selected" (a -k in PYTEST_ARGS): not a failure.
test: setup
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadscope -m "not slow and not serial" \
	    --durations=25 $(PYTEST_ARGS)
	$(TEST_ENV) $(PY) -m pytest -q -m "serial and not slow" $(PYTEST_ARGS) || test $$? -eq 5

## test-quick: the edit loop: no FUSE, MPI, Slurm or S3 endpoint, none of the `long` tests
## (measured selections, memory-measured packs, faults injected into pack workers): format,
## codecs, read core, kernel handler without a kernel, pack, select, CLI
test-quick: setup
	$(TEST_ENV) $(PY) -m pytest -q -n $(QUICK_JOBS) --dist load \
	    -m "not fuse and not mpi and not slurm and not s3 and not long and not slow and not serial" \
	    $(PYTEST_ARGS)

## test-slow: the long stress and fuzz tests as well
test-slow: setup
	$(TEST_ENV) $(PY) -m pytest -q -m "slow or not slow" $(PYTEST_ARGS)

## bench: the benchmarks of tools/bench (long; writes docs/benchmarks.md)
bench: setup
	bash tools/bench/run_all.sh

## slurm-e2e: pack and train on a local two-node Slurm (tools/slurm-local.sh)
slurm-e2e: setup
	$(TEST_ENV) $(PY) -m pytest -q -m slurm tests/test_slurm_e2e.py $(PYTEST_ARGS)

clean:
	rm -rf demo-work bench-work .pytest_cache build *.egg-info
