"""The dense parameters' AdamW, called without importing TorchDynamo.

``torch.optim`` wraps ``Optimizer.add_param_group`` / ``zero_grad`` / ``state_dict`` / ``load_state_dict``
(``torch._compile._disable_dynamo``) and every optimizer's ``step`` (``_use_grad_for_differentiable``) so that
``torch.compile`` does not trace into them. Either wrapper imports ``torch._dynamo`` at its first call, and that
import pulls in sympy, Triton (where installed) and FSDP: more CPU time than importing torch itself, paid by every
rank process of every launch. The trainer never compiles, so in its rank processes (:func:`skip_dynamo_import`,
called once at a worker's start) the wrappers are bypassed: the lazy ``disable`` each wrapper would build is the
method itself (there is no tracing to disable), and :func:`step` runs the optimizer's own ``step`` under
``torch.no_grad`` (what the wrapper sets for an optimizer that is not ``differentiable``). The arithmetic is the same
function on the same tensors: bitwise the same parameters and state (``tests/test_dense_optim.py``).

Where torch's wrappers are not what this expects (another torch version), nothing is bypassed and the ordinary
calls run: slower to start, never different.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

_WRAPPED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
_active = False


def _inner(fn) -> Optional[Callable]:
    inner = getattr(fn, "__wrapped__", None)
    code = getattr(fn, "__code__", None)
    if inner is None or code is None or not code.co_filename.endswith("_compile.py"):
        return None
    return inner


def skip_dynamo_import() -> bool:
    """Bypass the wrappers in this process (a rank process of ours, which never compiles). Returns whether they are
    bypassed; False (nothing changed) where TorchDynamo is already imported or torch's wrappers differ."""
    global _active
    if _active:
        return True
    if "torch._dynamo" in sys.modules:
        return False
    inners = [_inner(getattr(torch.optim.Optimizer, name, None)) for name in _WRAPPED]
    if any(i is None for i in inners):
        return False
    for fn in inners:
        # the attribute torch's wrapper caches its ``torch._dynamo.disable(fn)`` in: the function itself
        setattr(fn, "__dynamo_disable", fn)
    _active = True
    return True


def _raw_step(optimizer: torch.optim.Optimizer) -> Optional[Callable]:
    fn = type(optimizer).step
    for _ in range(4):  # the profiling hook's wrapper, then the grad-mode wrapper, then the method
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    if fn is type(optimizer).step or getattr(optimizer, "defaults", {}).get("differentiable", False):
        return None
    return fn


def step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``; without the TorchDynamo import where :func:`skip_dynamo_import` is active. Step hooks
    are not run on that path (the trainer registers none)."""
    raw = _raw_step(optimizer) if _active else None
    if raw is None:
        optimizer.step()
        return
    with torch.no_grad():
        raw(optimizer)
