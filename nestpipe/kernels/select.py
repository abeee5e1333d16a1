"""The fixed rule that picks each op's path: device kind and installed extras only, never timings.

Given the same installed packages, every rank picks the same paths; :func:`kernel_paths` returns them for the
run's metadata.

| device | ``route_keys``                                | ``adagrad_bags``                          | every other op                          |
|--------|-----------------------------------------------|-------------------------------------------|-----------------------------------------|
| cpu    | ``fbgemm`` if fbgemm_gpu imports, else torch   | ``fbgemm`` if its CPU TBE op exists, else torch | ``numba`` if numba imports, else torch  |
| cuda   | ``fbgemm`` if its op has a CUDA kernel, else torch | torch                                 | ``triton`` if triton imports, else torch |
| npu    | ``npu`` (torch_npu required)                   | torch                                     | ``npu``                                 |
| other  | ``reference``                                  | ``reference``                             | ``reference``                           |

``NESTPIPE_KERNELS=reference`` forces the plain-torch references everywhere (for debugging; set it on every
rank alike).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Dict, Union

import torch

OPS = ("route_keys", "gather_rows", "lookup", "adagrad_update", "adagrad_bags", "dual_buffer_sync")
PATHS = ("reference", "fbgemm", "numba", "triton", "npu")
FORCE_ENV = "NESTPIPE_KERNELS"


@functools.lru_cache(maxsize=None)
def has_fbgemm() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401  (optional dependency: probed here)
    except Exception:  # a build against another torch fails with OSError/ImportError/RuntimeError
        return False
    return hasattr(torch.ops.fbgemm, "block_bucketize_sparse_features")


@functools.lru_cache(maxsize=None)
def has_fbgemm_cuda() -> bool:
    return has_fbgemm() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "fbgemm::block_bucketize_sparse_features", "CUDA"
    )


@functools.lru_cache(maxsize=None)
def has_fbgemm_tbe_cpu() -> bool:
    """fbgemm's CPU table-batched embedding backward with fused row-wise AdaGrad (``adagrad_bags``)."""
    return has_fbgemm() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "fbgemm::split_embedding_backward_codegen_rowwise_adagrad_cpu", "CPU"
    )


@functools.lru_cache(maxsize=None)
def has_numba() -> bool:
    try:
        import numba  # noqa: F401  (optional dependency: probed here)
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=None)
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def has_torch_npu() -> bool:
    try:
        import torch_npu  # noqa: F401  (optional dependency: probed here)
    except Exception:
        return False
    return True


def select_path(op: str, device: Union[str, torch.device]) -> str:
    """The path op ``op`` takes for tensors on ``device`` (one of :data:`PATHS`)."""
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; ops are {', '.join(OPS)}")
    forced = os.environ.get(FORCE_ENV, "")
    if forced not in ("", "reference"):
        raise ValueError(f"{FORCE_ENV} must be unset or 'reference', got {forced!r}")
    if forced == "reference":
        return "reference"
    kind = torch.device(device).type
    if op == "adagrad_bags":
        return "fbgemm" if kind == "cpu" and has_fbgemm_tbe_cpu() else "reference"
    if kind == "cpu":
        if op == "route_keys":
            return "fbgemm" if has_fbgemm() else "reference"
        return "numba" if has_numba() else "reference"
    if kind == "cuda":
        if op == "route_keys":
            return "fbgemm" if has_fbgemm_cuda() else "reference"
        return "triton" if has_triton() else "reference"
    if kind == "npu":
        if not has_torch_npu():
            raise RuntimeError("tensors on an npu device but torch_npu does not import")
        return "npu"
    return "reference"


def kernel_paths(device: Union[str, torch.device]) -> Dict[str, str]:
    """``{op: path}`` the rule selects for ``device`` (what ``nestpipe kernels-info`` prints). What a run actually
    executed is :func:`taken_paths`."""
    return {op: select_path(op, device) for op in OPS}


# What this process executed: every public op of nestpipe.kernels notes (op, path) at the call, so a run's metadata
# lists only paths it took (``taken_paths``), never the rule's table of paths it might take.
_TAKEN: Dict[str, Dict[str, int]] = {}


def note(op: str, path: str) -> str:
    """Record one call of ``op`` on ``path`` in this process; returns ``path``."""
    calls = _TAKEN.setdefault(op, {})
    calls[path] = calls.get(path, 0) + 1
    return path


def taken_paths() -> Dict[str, Dict[str, int]]:
    """``{op: {path: calls}}`` of every kernel op this process executed since the last :func:`reset_taken`."""
    return {op: dict(sorted(paths.items())) for op, paths in sorted(_TAKEN.items())}


def reset_taken() -> None:
    _TAKEN.clear()
