# Quick start: `make demo` (set up + run the main job end to end), `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean torchrec-env

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch 2.13 first, so nothing pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nestpipe demo --out runs/demo

test: $(STAMP)
	$(PY) -m pytest -q tests

# The TorchRec comparison baseline (benchmarks/torchrec_env.sh): pinned versions, its own venv.
torchrec-env:
	benchmarks/torchrec_env.sh .venv-torchrec

clean:
	rm -rf runs $(VENV) .venv-torchrec
