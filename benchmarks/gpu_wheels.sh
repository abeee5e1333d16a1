#!/usr/bin/env bash
# gpu_wheels.sh DIR [PYTHON_VERSION] -- the wheels benchmarks/gpu_check.py needs on a CUDA machine without network
# whose system Python already holds torch, Triton and numpy: this project (built here) and the third-party modules
# the training path imports (scipy: the shard writer's clustering; tqdm: progress), for that Python
# (default 3.11), manylinux x86_64. Prints their total size and fails above 64 MiB. On the GPU machine:
#   pip install --no-deps DIR/*.whl && make gpu-check
set -euo pipefail
if [ $# -lt 1 ]; then echo "usage: $0 DIR [PYTHON_VERSION, e.g. 3.11]" >&2; exit 2; fi
DIR=$1
PYV=${2:-3.11}
PY=${PY:-$(cd "$(dirname "$0")/.." && pwd -P)/.venv/bin/python}
ROOT=$(cd "$(dirname "$0")/.." && pwd -P)
mkdir -p "$DIR"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYV" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$DIR" scipy tqdm
"$PY" -m pip wheel --quiet --no-deps -w "$DIR" "$ROOT"
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
ls -l "$DIR"/*.whl
echo "total $((total / 1048576)) MiB in $(ls "$DIR"/*.whl | wc -l) wheels"
if [ "$total" -gt $((64 * 1048576)) ]; then echo "over the 64 MiB the GPU machine takes" >&2; exit 1; fi
