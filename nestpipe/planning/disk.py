"""The local disk as the memory-mapped tier sees it: random page reads and written-back pages, measured.

``nestpipe plan --store-dir DIR`` measures the disk under ``DIR`` once: a file of ``size_mb`` is written and
synced (write bandwidth), dropped from the page cache (``POSIX_FADV_DONTNEED``), then read at random 4 KiB pages,
all advised at once first (``POSIX_FADV_WILLNEED``) as the memory-mapped tier reads its missed rows (random read
bandwidth: a missed row costs a page). The file is removed.
"""

from __future__ import annotations

import os
import time
from typing import Tuple

import numpy as np

PAGE = 4096


def measure(directory: str, size_mb: int = 256, reads: int = 4000, seed: int = 0) -> Tuple[float, float]:
    """(random read bytes/s, write bytes/s) of the disk holding ``directory``."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".nestpipe-disk-probe-{os.getpid()}")
    size = int(size_mb) << 20
    block = np.random.default_rng(seed).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(0, size, len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write_bw = size / (time.perf_counter() - t0)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            pages = np.unique(np.random.default_rng(seed + 1).integers(0, size // PAGE, reads))
            t0 = time.perf_counter()
            # as the tier reads: every page advised at once (the disk serves them in parallel), then read
            for p in pages:
                os.posix_fadvise(fd, int(p) * PAGE, PAGE, os.POSIX_FADV_WILLNEED)
            for p in pages:
                os.pread(fd, PAGE, int(p) * PAGE)
            read_bw = len(pages) * PAGE / (time.perf_counter() - t0)
        finally:
            os.close(fd)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return read_bw, write_bw
