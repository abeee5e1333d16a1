#!/usr/bin/env bash
# Build the TorchRec comparison environment from pinned versions (the baseline every TorchRec figure in
# docs/benchmarks.md is measured against), then print its versions.
#
#   benchmarks/torchrec_env.sh DIR          # creates the venv DIR (default .venv-torchrec)
#   make torchrec-env                       # the same, into .venv-torchrec
#
# Then pass DIR/bin/python as --torchrec-python to benchmarks/trainer_bench.py and benchmarks/pipeline_bench.py.
# torch 2.13 is the CPU build (`pip install torch==2.13.0` takes the CPU wheel on these machines); fbgemm-gpu-cpu
# 1.8.0 is the build that loads against torch 2.13; torchrec 1.8.0 is installed without its dependencies (with
# them it pulls the CUDA fbgemm), its runtime dependencies pinned one by one.
set -euo pipefail
DIR=${1:-.venv-torchrec}
PYTHON=${PYTHON:-python3}
PINS=(
  "torch==2.13.0"
  "fbgemm-gpu-cpu==1.8.0"
  "numpy==2.4.6"
  "tensordict==0.15.3"
  "torchmetrics==1.0.3"
  "tqdm"
  "pyre-extensions"
  "iopath"
)
test -x "$DIR/bin/python" || "$PYTHON" -m venv "$DIR"
"$DIR/bin/python" -m pip install -q --upgrade pip
"$DIR/bin/python" -m pip install -q "${PINS[@]}"
"$DIR/bin/python" -m pip install -q --no-deps "torchrec==1.8.0"
"$DIR/bin/python" - <<'PY'
import importlib.metadata as md
import torch, fbgemm_gpu, torchrec  # noqa: F401  (fails here if the build does not load)
names = ["torch", "fbgemm-gpu-cpu", "torchrec", "tensordict", "torchmetrics", "numpy"]
print("TorchRec environment:", ", ".join(f"{n} {md.version(n)}" for n in names))
PY
