"""What a benchmark figure depends on besides the code: the host's CPU model, core count and vector instruction sets.

Kernel speed differs between machines with the same package versions (the vector instruction sets decide which code a
JIT kernel generates and which path torch dispatches to, and a virtual machine's page walks and shared cores change
memory-bound kernels), so every comparing benchmark records this beside its versions.
"""

from __future__ import annotations

import os
import platform
from typing import Any, Dict

# the instruction-set flags that decide which code paths native kernels (fbgemm's JIT, oneDNN, LLVM) take
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16")


def describe_host(cpuinfo: str = "/proc/cpuinfo") -> Dict[str, Any]:
    """``{"cpu_model", "logical_cpus", "usable_cpus", "isa", "machine", "system"}``; ``isa`` lists the flags of
    :data:`ISA_FLAGS` the first CPU reports (empty where ``/proc/cpuinfo`` is absent)."""
    model, flags = "", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    model = model or platform.processor()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_model": model, "logical_cpus": os.cpu_count(), "usable_cpus": usable,
            "isa": [f for f in ISA_FLAGS if f in flags], "machine": platform.machine(), "system": platform.system()}


def host_line(info: Dict[str, Any]) -> str:
    return (f"host: {info['cpu_model'] or 'unknown CPU'}, {info['usable_cpus']} usable of {info['logical_cpus']} "
            f"logical CPUs, {' '.join(info['isa']) or 'no ISA flags read'}")
