"""The fixed rule that picks each op's path: device kind and installed extras only, never timings.

Given the same installed packages, every rank picks the same paths; :func:`kernel_paths` returns them for the
run's metadata.

| device | ``route_keys``                                | ``adagrad_bags``                          | every other op                          |
|--------|-----------------------------------------------|-------------------------------------------|-----------------------------------------|
| cpu    | ``fbgemm`` if fbgemm_gpu imports, else torch   | ``fbgemm`` (its CPU TBE op) on AVX-512 hosts, else ``numba``, else torch | ``numba`` if numba imports, else torch (``gather_rows``: torch's ``index_select`` always) |
| cuda   | ``fbgemm`` if its op has a CUDA kernel, else torch | torch                                 | ``triton`` if triton imports, else torch |
| npu    | ``npu`` (torch_npu required)                   | torch                                     | ``npu``                                 |
| other  | ``reference``                                  | ``reference``                             | ``reference``                           |

The host ops (``place_keys``, ``dedup_rows``, ``csr_by_segment``, ``micro_batch_values``, ``pooled_owner_plan``: the
step's keys and rows as NumPy arrays on the host, whatever the device) take ``numba`` if numba imports, else the NumPy/torch reference.
``hstu_attention`` (the dense model's jagged attention, :mod:`nestpipe.kernels.attention`) takes ``numba`` on CPU (its exact loops for
micro-batches of sequences up to 64 tokens, the ``blocked`` torch tiles for longer ones; ``blocked`` for all without
numba), ``triton`` on CUDA when triton imports, and the padded torch reference otherwise (on npu too).

``adagrad_bags`` on CPU takes fbgemm's TBE backward where fbgemm_gpu imports and torch dispatches at AVX-512
(:func:`cpu_has_avx512`), the Numba kernel (bitwise the same arithmetic) elsewhere. Why the instruction set: fbgemm
generates its row-wise AdaGrad loop per instruction set (asmjit), and its speed is what differs between hosts: its
AVX-512 loop beats the Numba kernel, while below AVX-512 it has been slower (``benchmarks/kernels_bench.py`` times
both in one run; docs/benchmarks.md). Hosts below AVX-512 keep the Numba kernel until a measurement there says
otherwise.

Overrides, for tests and debugging (set them on every rank alike): ``NESTPIPE_KERNELS=reference`` forces the
plain-torch references everywhere; ``NESTPIPE_KERNELS=op:path,...`` forces the named ops only (for example
``adagrad_update:reference,dual_buffer_sync:triton``); :func:`forced` does the same inside a ``with`` block of the
calling process. A forced path is taken as is: forcing ``triton`` on CPU tensors runs Triton's interpreter mode
only where ``TRITON_INTERPRET=1`` is set.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
from typing import Dict, Iterator, Union

import torch

OPS = ("route_keys", "place_keys", "dedup_rows", "csr_by_segment", "micro_batch_values", "pooled_owner_plan",
       "gather_rows", "lookup",
       "adagrad_update", "adagrad_bags", "dual_buffer_sync", "hstu_attention")
PATHS = ("reference", "fbgemm", "numba", "triton", "npu", "blocked")
# ops on the host's NumPy arrays of keys and rows (routing, grouping): their path does not depend on the device
HOST_OPS = ("place_keys", "dedup_rows", "csr_by_segment", "micro_batch_values", "pooled_owner_plan")
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
def cpu_has_avx512() -> bool:
    """Whether torch's CPU dispatch runs at AVX-512 here (``torch.backends.cpu.get_cpu_capability()``; the
    ``ATEN_CPU_CAPABILITY`` variable lowers it for every op of the process, on every rank alike)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


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
    """The path op ``op`` takes for tensors on ``device`` (one of :data:`PATHS`): a forced path, else this host's
    measured choice (:mod:`.tuning`, CPU only: among bitwise-equal paths), else the rule."""
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; ops are {', '.join(OPS)}")
    override = _override(op)
    if override is not None:
        return override
    if op in _TUNED and _device_kind(device) == "cpu":
        return _TUNED[op]
    return rule_path(op, device)


def _device_kind(device: Union[str, torch.device]) -> str:
    return device if isinstance(device, str) and device in ("cpu", "cuda", "npu") else torch.device(device).type


def rule_path(op: str, device: Union[str, torch.device]) -> str:
    """The fixed rule's path (the table above), whatever was forced or measured."""
    kind = torch.device(device).type
    if op == "hstu_attention":  # the dense model's jagged attention (autograd); padded torch ops elsewhere
        return ("numba" if has_numba() else "blocked") if kind == "cpu" else \
            ("triton" if has_triton() else "reference") if kind == "cuda" else "reference"
    if op == "adagrad_bags":
        if kind != "cpu":
            return "reference"
        if has_fbgemm_tbe_cpu() and cpu_has_avx512():
            return "fbgemm"
        return "numba" if has_numba() else "fbgemm" if has_fbgemm_tbe_cpu() else "reference"
    if op in HOST_OPS:  # host-side bookkeeping of the step's keys (NumPy arrays), whatever the device
        return "numba" if has_numba() else "reference"
    if kind == "cpu":
        if op == "gather_rows":  # torch's index_select: no CPU kernel of ours beats a memory-bound copy
            return "reference"
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


_FORCED: Dict[str, str] = {}  # the innermost ``forced`` block's per-op paths
_TUNED: Dict[str, str] = {}  # this process's measured choices among bitwise-equal paths (tuning.apply)


def set_tuned(paths: Dict[str, str]) -> None:
    """Take ``paths`` (``{op: path}``, from :mod:`.tuning`) on CPU where nothing is forced, replacing earlier ones."""
    bad = {op: p for op, p in paths.items() if op not in OPS or p not in PATHS}
    if bad:
        raise ValueError(f"set_tuned: unknown op or path in {bad}")
    _TUNED.clear()
    _TUNED.update(paths)


def tuned_paths() -> Dict[str, str]:
    return dict(_TUNED)


def forced_path(op: str):
    """The path forced for ``op`` (``NESTPIPE_KERNELS`` or a :func:`forced` block), or None."""
    return _override(op)


def _parse_overrides(text: str) -> Dict[str, str]:
    """``reference`` -> every op; ``op:path,op:path`` -> those ops. Unknown ops or paths are refused."""
    text = text.strip()
    if text in ("", "reference"):
        return {op: "reference" for op in OPS} if text else {}
    out = {}
    for item in text.split(","):
        op, sep, path = item.strip().partition(":")
        if not sep or op not in OPS or path not in PATHS:
            raise ValueError(f"{FORCE_ENV}: {item.strip()!r} is not OP:PATH with OP one of {', '.join(OPS)} and PATH "
                             f"one of {', '.join(PATHS)} (or the whole value 'reference')")
        out[op] = path
    return out


def _override(op: str):
    if op in _FORCED:
        return _FORCED[op]
    return _parse_overrides(os.environ.get(FORCE_ENV, "")).get(op)


@contextlib.contextmanager
def forced(paths: Union[str, Dict[str, str]]) -> Iterator[None]:
    """Inside the block, the ops named in ``paths`` (a dict, or the ``NESTPIPE_KERNELS`` syntax) take the given
    path in this process, whatever the rule and the environment say."""
    new = _parse_overrides(paths) if isinstance(paths, str) else dict(paths)
    bad = {op: p for op, p in new.items() if op not in OPS or p not in PATHS}
    if bad:
        raise ValueError(f"forced: unknown op or path in {bad} (ops {', '.join(OPS)}; paths {', '.join(PATHS)})")
    saved = dict(_FORCED)
    _FORCED.update(new)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(saved)


def kernel_rule(device: Union[str, torch.device]) -> Dict[str, str]:
    """``{op: path}`` of the fixed rule for ``device`` (nothing forced or measured)."""
    return {op: rule_path(op, device) for op in OPS}


def kernel_paths(device: Union[str, torch.device]) -> Dict[str, str]:
    """``{op: path}`` the rule selects for ``device`` (what ``nestpipe kernels-info`` prints). What a run actually
    executed is :func:`taken_paths`."""
    return {op: select_path(op, device) for op in OPS}


# What this process executed: every public op of nestpipe.kernels notes (op, path) at the call, so a run's metadata
# lists only paths it took (``taken_paths``), never the rule's table of paths it might take.
# A trainer resets it at the start of every run (a process may run several), so a run's record is its own.
_TAKEN: Dict[str, Dict[str, int]] = {}
_TAKEN_LOCK = threading.Lock()  # the pipeline's stage threads note concurrently


def note(op: str, path: str) -> str:
    """Record one call of ``op`` on ``path`` (the path that executes, fallbacks included) in this process; returns
    ``path``."""
    with _TAKEN_LOCK:
        calls = _TAKEN.setdefault(op, {})
        calls[path] = calls.get(path, 0) + 1
    return path


def taken_paths() -> Dict[str, Dict[str, int]]:
    """``{op: {path: calls}}`` of every kernel op this process executed since the last :func:`reset_taken`."""
    with _TAKEN_LOCK:
        return {op: dict(sorted(paths.items())) for op, paths in sorted(_TAKEN.items())}


@contextlib.contextmanager
def calls_unrecorded() -> Iterator[None]:
    """Calls inside the block are not part of :func:`taken_paths` (the kernel calibration's own calls: a run's
    record lists what its training executed)."""
    with _TAKEN_LOCK:
        saved = {op: dict(paths) for op, paths in _TAKEN.items()}
    try:
        yield
    finally:
        with _TAKEN_LOCK:
            _TAKEN.clear()
            _TAKEN.update(saved)


def reset_taken() -> None:
    """Forget the calls noted so far (a trainer calls it when a run starts)."""
    with _TAKEN_LOCK:
        _TAKEN.clear()
