# Quick start: `make demo` (set up + run the main job end to end), `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test clean torchrec-env gpu-check

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

# The suite in two parts: the modules two at a time (pytest-xdist, one module per worker so that a module's fixtures
# are built once), then the timing-sensitive tests (marked `serial`) alone; both always run, either failing fails.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not serial" tests; a=$$?; \
	$(PY) -m pytest -q -m serial tests; b=$$?; \
	test $$a -eq 0 -a $$b -eq 0

# The TorchRec comparison baseline (benchmarks/torchrec_env.sh): pinned versions, its own venv.
torchrec-env:
	benchmarks/torchrec_env.sh .venv-torchrec

# The accelerator path on a CUDA machine (about 5 minutes; prints "no CUDA device" and exits 0 elsewhere). Runs with
# the python on PATH: on a GPU machine without network, install the project's wheels with --no-deps first (see
# benchmarks/gpu_check.py --help).
gpu-check:
	python benchmarks/gpu_check.py

clean:
	rm -rf runs $(VENV) .venv-torchrec
