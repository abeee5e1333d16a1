"""Host memory for the DRAM tier: large store tensors backed by transparent huge pages where Linux offers them.

Why: a store row of a random id costs a TLB miss. With 4 KiB pages every miss walks the page tables (a nested walk
in a virtual machine), and the walks, not DRAM bandwidth, bound the random row gather of a large store; 2 MiB pages
shorten them (``benchmarks/kernels_bench.py --default-pages`` compares the two; docs/kernels.md). PyTorch's CPU
allocator gives no way to ask for huge pages, so large tensors are mapped here: a private anonymous mapping advised
``MADV_HUGEPAGE`` (a *shared* anonymous mapping is shmem, which THP leaves alone unless ``shmem_enabled`` allows it),
wrapped by ``torch.frombuffer`` (the tensor keeps the mapping alive).

The trainer asks for huge pages for the stores it initialises whole (``embedding.huge_pages``): a lazily
initialised store on huge pages would make 2 MiB of rows resident at the first touch of one of them.

Invariants: the memory is zero-filled (anonymous mappings are), so :func:`host_zeros` costs no pass over it and
untouched pages are never faulted in (a lazily materialised store stays free until rows are touched). Where huge
pages are unavailable (not Linux, THP ``never``, ``NESTPIPE_HUGE_PAGES=0``, small tensors) the plain torch allocator
is used; :func:`huge_pages_mode` says which, for the run's metadata.
"""

from __future__ import annotations

import mmap
import os
from typing import Sequence

import torch

HUGE_PAGE_MIN_BYTES = 32 << 20  # smaller tensors: the torch allocator (huge pages would round them up to 2 MiB)
ENV = "NESTPIPE_HUGE_PAGES"  # "0" turns huge pages off for every store of the process
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_mode() -> str:
    """``"madvise"`` when store tensors may get transparent huge pages, else why not (``"off (...)"``)."""
    if os.environ.get(ENV, "1") == "0":
        return f"off ({ENV}=0)"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "off (no MADV_HUGEPAGE on this platform)"
    try:
        with open(_THP_ENABLED) as f:
            setting = f.read()
    except OSError:
        return "off (no transparent huge page support)"
    if "[never]" in setting:
        return "off (transparent_hugepage is never)"
    return "madvise"


def _mapped(shape, dtype: torch.dtype, huge_pages: bool):
    """A huge-page-advised tensor of ``shape`` (zero-filled), or None where the torch allocator should be used."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not huge_pages or nbytes < HUGE_PAGE_MIN_BYTES or huge_pages_mode() != "madvise":
        return None
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def host_empty(shape: Sequence[int], dtype: torch.dtype = torch.float32, huge_pages: bool = True) -> torch.Tensor:
    """A contiguous CPU tensor whose contents are not to be read before written (``torch.empty``'s contract; no
    page is touched here); large ones on pages advised ``MADV_HUGEPAGE``."""
    shape = tuple(int(s) for s in shape)
    t = _mapped(shape, dtype, huge_pages)
    return t if t is not None else torch.empty(shape, dtype=dtype)


def host_zeros(shape: Sequence[int], dtype: torch.dtype = torch.float32, huge_pages: bool = True) -> torch.Tensor:
    """A zero-filled contiguous CPU tensor; large ones on pages advised ``MADV_HUGEPAGE`` (zero without a pass)."""
    shape = tuple(int(s) for s in shape)
    t = _mapped(shape, dtype, huge_pages)
    return t if t is not None else torch.zeros(shape, dtype=dtype)
