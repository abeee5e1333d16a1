"""The record a benchmark writes: ``benchmarks/results/NAME.json``, the only source of the figures that
``benchmarks/report.py`` renders into docs/benchmarks.md and README.md.

    from record import Recorder
    rec = Recorder("ingest")                   # at start: the 1-minute load average and the clock
    ...                                        # measure
    rec.write({"rows": ..., "ratios": ...})    # command line, commit, host, versions, load at start and end, figures

A record holds: ``benchmark`` (its name), ``command`` (the command line as run, from the repository root),
``commit`` (HEAD, with ``+dirty`` where files that change a measurement, ``nestpipe/``, ``benchmarks/*.py`` or
``pyproject.toml``, had uncommitted changes; ``dirty_paths`` lists them), ``host``, ``cpu`` (the CPU model),
``cpus`` (cores the benchmark could use when it started), ``versions`` (python and the libraries a benchmark runs on), ``load_before``
and ``load_after`` (the 1, 5 and 15-minute load averages: the cores are shared), ``date`` (UTC, ISO 8601),
``seconds`` (the benchmark's wall time) and ``figures``. The file is written to a temporary name and renamed, so a
reader never sees half a record.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# The distributions whose versions a record carries (those not installed are left out).
PACKAGES = ("torch", "numpy", "polars", "pyarrow", "numba", "fbgemm-gpu-cpu", "dask", "distributed", "triton",
            "nestpipe")
# Uncommitted changes under these paths change what a benchmark measures; elsewhere (docs) they do not.
CODE_PATHS = ("nestpipe", "benchmarks", "pyproject.toml")


def versions(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if "torch" in sys.modules:  # the build actually imported (its local version label: +cpu)
        out["torch"] = sys.modules["torch"].__version__
    out.update(extra or {})
    return out


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.rstrip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> Dict:
    """HEAD and the uncommitted changes to files that change a measurement (the results themselves excepted)."""
    rev = _git("rev-parse", "HEAD").strip() or "unknown"
    status = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
    dirty = sorted(line[3:] for line in status.splitlines()
                   if line[3:] and not line[3:].startswith("benchmarks/results/"))
    return {"commit": rev + ("+dirty" if dirty else ""), "dirty_paths": dirty}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command(argv: Optional[Sequence[str]] = None, script: Optional[str] = None) -> str:
    """The command line as a user types it from the repository root."""
    script = script or sys.argv[0]
    rel = os.path.relpath(os.path.abspath(script), ROOT) if os.path.isabs(script) or os.path.exists(script) else script
    args = list(sys.argv[1:] if argv is None else argv)

    def quote(a: str) -> str:
        return f'"{a}"' if (" " in a or not a) else a

    return " ".join(["python", rel, *map(quote, args)])


class Recorder:
    """Started when the benchmark starts (load average and clock), written once when it ends."""

    def __init__(self, name: str, argv: Optional[Sequence[str]] = None, script: Optional[str] = None,
                 results: str = RESULTS):
        self.name = name
        self.command = command(argv, script)
        self.results = results
        self.load_before = [round(x, 2) for x in os.getloadavg()]
        self.cpus = _usable_cpus()  # before a benchmark pins itself to fewer
        self.start = time.time()

    def write(self, figures: Optional[Dict] = None, fields: Optional[Dict] = None,
              extra_versions: Optional[Dict[str, str]] = None, path: Optional[str] = None) -> str:
        """Write ``results/NAME.json`` (or ``path``); ``fields`` are added at the top level beside ``figures``."""
        return write_record(self.name, figures, command_line=self.command, load_before=self.load_before,
                            started=self.start, cpus=self.cpus, fields=fields, extra_versions=extra_versions, results=self.results,
                            path=path)


def write_record(name: str, figures: Optional[Dict] = None, argv: Optional[Sequence[str]] = None, *,
                 command_line: Optional[str] = None, load_before: Optional[List[float]] = None,
                 started: Optional[float] = None, cpus: Optional[int] = None, fields: Optional[Dict] = None,
                 extra_versions: Optional[Dict[str, str]] = None, results: str = RESULTS,
                 path: Optional[str] = None) -> str:
    now = time.time()
    record = {
        "benchmark": name,
        "command": command_line or command(argv),
        **commit(),
        "host": platform.node(),
        "cpu": cpu_model(),
        "cpus": cpus or _usable_cpus(),
        "versions": versions(extra_versions),
        "load_before": load_before if load_before is not None else [round(x, 2) for x in os.getloadavg()],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "date": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "seconds": round(now - started, 1) if started is not None else None,
    }
    if figures is not None:
        record["figures"] = figures
    record.update(fields or {})
    path = path or os.path.join(results, f"{name}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True, default=_plain)
        f.write("\n")
    os.replace(tmp, path)
    print(f"record: {os.path.relpath(path, ROOT) if path.startswith(ROOT) else path}", flush=True)
    return path


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _plain(x):
    """NumPy scalars and arrays as JSON numbers and lists; anything else as its text."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    return str(x)
