"""``nestpipe ingest --engine dask``: the same stages, their units run as Dask tasks.

Dask distributed runs a real multi-process cluster (a LocalCluster of ``--workers`` processes bound to localhost,
or an existing scheduler given by ``--scheduler tcp://HOST:8786``, deployed with dask-ssh, dask-jobqueue or
dask-kubernetes). The driver plans the units and assembles the manifest exactly as with the local engine; every
unit is one task (``client.submit`` of the same top-level unit function), so what crosses the scheduler is a unit's
arguments and its small stats dict, never the data: units read and write the working directory and the output,
which are either a filesystem every worker sees or fsspec URLs (object storage: ``nestpipe.ingest.workdir``). The
stages' outputs do not depend on which worker ran a unit, so the shards are byte-identical to the local engine's. A
worker that dies has its tasks rerun by Dask (units are idempotent: each commits its files with a marker written
after them, and a unit without its marker is redone whole).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional

from nestpipe.ingest.executor import _progress, usable_cores

CONNECT_TIMEOUT_S = 10

# The LocalCluster's settings (a cluster given by --scheduler keeps its own). The units are CPU-bound Python and
# NumPy on few cores, so what Dask runs beside them is overhead:
# - MALLOC_TRIM_THRESHOLD_: Dask's nannies set 65536 in their workers by default, which makes glibc return freed
#   memory to the system at once; the units allocate and free large arrays all the time, so every allocation
#   faults fresh pages in and the shard stage slows down markedly (the local engine does too with that variable
#   set). glibc's adaptive threshold is kept (None unsets).
# - the worker's statistical profiler samples the task thread's stack every 10 ms on the event loop, taking the GIL
#   from the unit each time, and the periodic monitors wake the event loop often: on few cores both take time from
#   the units, and an idle cluster keeps a core busy. With the profiler off and the monitors below slowed, a unit
#   runs about as fast as in a process pool. Nobody reads the profile: the dashboard is off.
LOCAL_CLUSTER_CONFIG = {
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "1s",
    "distributed.admin.system-monitor.interval": "5s",
    "distributed.worker.memory.monitor-interval": "1s",
}


class DaskExecutor:
    """The :class:`~nestpipe.ingest.executor.Executor` interface (``run`` with results in unit order, a progress bar
    per stage, ``stage_seconds``) on a Dask client."""

    def __init__(self, workers: int, scheduler: Optional[str] = None):
        self.workers = int(workers)
        self.scheduler = scheduler
        self.cluster = None
        self.client = None
        self.stage_seconds: Dict[str, float] = {}

    def __enter__(self) -> "DaskExecutor":
        try:
            import dask  # the optional 'dask' extra
            from dask.distributed import Client
        except ImportError:
            raise RuntimeError("--engine dask needs Dask distributed: pip install 'nestpipe[dask]'")
        if self.scheduler:
            try:
                self.client = Client(self.scheduler, timeout=f"{CONNECT_TIMEOUT_S}s")
            except (OSError, TimeoutError) as e:
                raise RuntimeError(f"cannot reach the Dask scheduler at {self.scheduler} within "
                                   f"{CONNECT_TIMEOUT_S} s ({type(e).__name__}: {e})") from None
        else:
            threads = max(1, usable_cores() // self.workers)
            with dask.config.set(LOCAL_CLUSTER_CONFIG):
                self.cluster = self._local_cluster(threads)
            self.client = Client(self.cluster)
        return self

    def _local_cluster(self, threads: int):
        from dask.distributed import LocalCluster  # the optional 'dask' extra

        return LocalCluster(n_workers=self.workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                            dashboard_address=None, preload=["nestpipe.ingest.stages"],
                            env={"POLARS_MAX_THREADS": str(threads), "OMP_NUM_THREADS": "1"})

    def __exit__(self, *exc) -> None:
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()

    def on_workers(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` once in every worker process of the cluster (``client.run``): workers of a cluster outlive the
        run, so what the run left in them (a URL working directory's local cache) is removed this way."""
        self.client.run(fn)

    def run(self, fn: Callable, units: List[Any], cfg, desc: str,
            rows_of: Callable[[Dict[str, Any]], int] = lambda s: s.get("rows", 0),
            cost: Optional[Callable[[Any], float]] = None) -> List[Dict[str, Any]]:
        """Every unit as one task, the costliest first; results in unit order."""
        from dask.distributed import as_completed  # the optional 'dask' extra (imported by __enter__ already)

        results: List[Optional[Dict[str, Any]]] = [None] * len(units)
        bar = _progress(len(units), desc, cfg.progress)
        t0 = time.time()
        rows = 0
        order = list(range(len(units)))
        if cost is not None:
            order.sort(key=lambda i: (-cost(units[i]), i))
        try:
            # at most one task per worker thread in flight, the next submitted as one finishes: the scheduler would
            # otherwise hand a small stage's few big units out round-robin at submission, two on one worker while
            # another idles (the local pool's longest-first order, kept)
            slots = max(1, sum(self.client.nthreads().values()))
            pending = iter(order)
            ac = as_completed()
            futs = {}

            def submit_next() -> None:
                i = next(pending, None)
                if i is not None:
                    # pure=False: a unit's side effects (its files) are the point, never a cached result
                    f = self.client.submit(fn, units[i], pure=False, key=f"{desc.split(' ', 1)[-1]}-{i}-{t0}")
                    futs[f] = i
                    ac.add(f)

            for _ in range(slots):
                submit_next()
            for f in ac:
                i = futs.pop(f)
                results[i] = f.result()
                submit_next()
                rows += rows_of(results[i])
                bar.update(1)
                bar.set_postfix_str(f"{rows / max(time.time() - t0, 1e-9):,.0f} rows/s")
        finally:
            bar.close()
            self.stage_seconds[desc.split(" ", 1)[1]] = round(time.time() - t0, 3)
        return results  # type: ignore[return-value]
