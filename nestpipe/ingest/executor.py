"""The ingest's worker pool: units of work in this process (one worker) or on one spawn pool shared by every stage.

Importing this module costs only the standard library, so a command can start the pool before it imports the
ingest itself (Polars, NumPy, ...): the workers then import those at the same time as the parent process, instead
of after it (about a quarter of a second of a short ingest on two cores). Workers exit when their driver dies,
even by SIGKILL (each watches its parent process).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import multiprocessing as mp
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


class WorkerDied(RuntimeError):
    """A worker process ended abruptly (killed by a signal, e.g. by the kernel when memory ran out)."""


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _progress(total: int, desc: str, enabled: bool, unit: str = "unit"):
    from nestpipe.utils.progress import progress  # start-up time: this module imports the standard library only

    return progress(total, desc, unit, enabled=enabled, file=sys.stderr)


# how often a worker checks that its driver is alive
ORPHAN_CHECK_S = 0.5


def _exit_with_driver(driver: int) -> None:
    """A worker's watch (a daemon thread): exit as soon as the driver that started it is gone. A driver killed with
    SIGKILL cannot stop its pool, and spawn workers would live on, adopted by init (or a subreaper), holding their
    memory; the resource tracker exits by itself once no process holds its pipe."""
    while True:
        time.sleep(ORPHAN_CHECK_S)
        if os.getppid() != driver:
            os._exit(1)


def _preload(polars_threads: int, modules: Tuple[str, ...], driver: int) -> None:
    """Worker initializer: import ``modules`` (the caller's stage functions) now, while the parent is still starting
    up. The thread count is also set here, for a worker the pool launches later than :meth:`Executor.__enter__`.
    Starts the watch that ends the worker when its driver dies (:func:`_exit_with_driver`)."""
    threading.Thread(target=_exit_with_driver, args=(driver,), name="driver-watch", daemon=True).start()
    os.environ.setdefault("POLARS_MAX_THREADS", str(polars_threads))
    for name in modules:
        importlib.import_module(name)


def _noop(_: int) -> None:
    return None


class Executor:
    """Runs units in order in this process (``workers == 1``) or on one spawn pool shared by every stage.

    Each worker process gets ``cores // workers`` Polars threads (Polars sizes its pool when it is imported, so the
    variable is set while the workers are launched). Results come back in unit order whatever order units finish
    in; ``stage_seconds`` records each stage's wall time.
    """

    def __init__(self, workers: int, preload: Sequence[str] = ()):
        self.workers = int(workers)
        self.preload = tuple(preload)  # modules every worker imports at start (by name: this module imports none)
        self.pool: Optional[cf.ProcessPoolExecutor] = None
        self.stage_seconds: Dict[str, float] = {}

    def __enter__(self) -> "Executor":
        if self.workers > 1:
            threads = max(1, usable_cores() // self.workers)
            old = os.environ.get("POLARS_MAX_THREADS")
            os.environ["POLARS_MAX_THREADS"] = str(threads)
            try:
                self.pool = cf.ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                                   initializer=_preload,
                                                   initargs=(threads, self.preload, os.getpid()))
                # Each submit launches one more worker until there are ``workers`` (the launch is synchronous, so
                # they all see the variable); nothing waits for them here.
                for i in range(self.workers):
                    self.pool.submit(_noop, i)
            finally:
                if old is None:
                    os.environ.pop("POLARS_MAX_THREADS", None)
                else:
                    os.environ["POLARS_MAX_THREADS"] = old
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def on_workers(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` in every worker process that outlives the run. Nothing to do here: the pool's workers belong
        to this executor and exit with it (and without a pool, units run in the calling process)."""

    def run(self, fn: Callable, units: List[Any], cfg, desc: str,
            rows_of: Callable[[Dict[str, Any]], int] = lambda s: s.get("rows", 0),
            cost: Optional[Callable[[Any], float]] = None) -> List[Dict[str, Any]]:
        """Run ``fn`` on every unit; results in unit order. With ``cost`` (an estimate per unit) the pool starts the
        costliest units first, so the stage does not end on one worker finishing a big unit while the other idles
        (longest-processing-time-first). ``cfg.progress``: show a progress bar with rows/s."""
        results: List[Optional[Dict[str, Any]]] = [None] * len(units)
        bar = _progress(len(units), desc, cfg.progress)
        t0 = time.time()
        rows = 0

        def done(i: int, r: Dict[str, Any]) -> None:
            nonlocal rows
            results[i] = r
            rows += rows_of(r)
            bar.update(1)
            bar.set_postfix_str(f"{rows / max(time.time() - t0, 1e-9):,.0f} rows/s")

        try:
            if self.pool is None or len(units) <= 1:
                for i, u in enumerate(units):
                    done(i, fn(u))
            else:
                order = range(len(units))
                if cost is not None:
                    order = sorted(order, key=lambda i: (-cost(units[i]), i))
                try:
                    # submit raises too when a worker died earlier (in an earlier stage, or while idle)
                    futs = {self.pool.submit(fn, units[i]): i for i in order}
                    for fut in cf.as_completed(futs):
                        done(futs[fut], fut.result())
                except cf.process.BrokenProcessPool as e:
                    left = sum(r is None for r in results)
                    raise WorkerDied(
                        f"stage {desc!r}: a worker process died (killed by a signal, e.g. out of memory: try fewer "
                        f"--workers or a smaller --chunk-mb) with {left} of {len(units)} units unfinished; rerun "
                        "the same command to resume (finished units and shards are kept)") from e
        finally:
            bar.close()
            self.stage_seconds[desc.split(" ", 1)[1]] = round(time.time() - t0, 3)
        return results  # type: ignore[return-value]
