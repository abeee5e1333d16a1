"""Launching: ``nestpipe train`` re-enters through ``torch.distributed.run`` with this module as the worker.

``launch_training`` builds the torchrun argument list (``--standalone`` for one node unless a rendezvous is given,
or any torchrun option passed through) and runs ``python -m nestpipe.trainer.launch --worker-run RUN [--worker-resume]`` on every
rank. The worker reads ``RUN/config.json``, joins the process group through the device layer with the configured
timeout, trains, and exits non-zero on any error; torchrun then stops the other ranks, so a failing rank ends the
whole job within about the monitor interval, and a dead peer within the process-group timeout.

One case no collective sees: a rank that stops (SIGSTOP, a hung host) after the run's last collective, when its peers
have finished and exited. torchrun would wait for it forever. :class:`ExitWatch` waits ``timeout_s`` after the run
wrote its final ``metrics.json``, then SIGKILLs the rank processes still there and says so; the run's outputs are
complete by then, so the command succeeds with that warning.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from typing import List, Optional

import torch.distributed as dist
from nestpipe.trainer import dense_optim, testing_hooks
from nestpipe.trainer.distributed import device as devmod, liveness
from nestpipe.trainer.config import load_run_config
from nestpipe.trainer.loop import train_worker


def launch_training(run: str, nproc_per_node: int, resume: bool, torchrun_args: Optional[List[str]] = None) -> int:
    torchrun_args = list(torchrun_args or [])
    args = []
    if not any(a.startswith("--rdzv") or a.startswith("--master") or a.startswith("--nnodes") for a in torchrun_args):
        args.append("--standalone")
    args += ["--nproc-per-node", str(nproc_per_node), "--monitor-interval", "0.5", *torchrun_args,
             "-m", "nestpipe.trainer.launch", "--worker-run", run]
    if resume:
        args.append("--worker-resume")
    # The ranks inherit this process's environment; it is set for the launch only and restored after, so a Python
    # session that calls nestpipe.train keeps its own (Numba refuses a thread count changed after it started).
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "TORCHELASTIC_ERROR_FILE")}
    cfg = load_run_config(run)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.threads))  # the config's intra-op threads
    # Numba's parallel kernels default to an all-core OpenMP pool: with several ranks per machine that
    # oversubscribes the cores (every rank's pool contends for all of them, and the ranks wait for the slowest at
    # every collective); each rank gets the intra-op thread count.
    os.environ.setdefault("NUMBA_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
    os.environ.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(run, "error.json"))
    watch = ExitWatch(run, max(5.0, cfg.timeout_s))
    try:
        try:
            return _launch(args, run)
        except RuntimeError:
            if not watch.killed:
                raise
            return 0  # every output was written before the stray ranks were ended (the watch said so)
    finally:
        watch.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ExitWatch:
    """A thread of the launching process: once ``RUN/metrics.json`` is written by this launch (the run's end: every
    rank passed its last gather), rank processes still alive ``timeout_s`` later are SIGKILLed and named on stderr
    (:attr:`killed`: their ranks)."""

    def __init__(self, run: str, timeout_s: float, poll_s: float = 0.5):
        self.run, self.timeout_s, self.poll_s = run, float(timeout_s), poll_s
        self.started = time.time()
        self.killed: List[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="exit-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _ended(self) -> bool:
        try:
            return os.path.getmtime(os.path.join(self.run, "metrics.json")) >= self.started
        except OSError:
            return False

    def _watch(self) -> None:
        while not self._ended():
            if self._stop.wait(self.poll_s):
                return
        if self._stop.wait(self.timeout_s):
            return
        self.killed = self.kill_stray_ranks()
        if self.killed:
            print(f"nestpipe train: warning: the run finished (metrics.json), but "
                  f"{', '.join(f'rank {r}' for r in self.killed)} did not exit within {self.timeout_s:.0f} s "
                  "(stopped or hung): killed", file=sys.stderr, flush=True)

    @staticmethod
    def kill_stray_ranks() -> List[int]:
        import psutil

        ranks = []
        for p in psutil.Process().children(recursive=True):
            try:
                if "--worker-run" in " ".join(p.cmdline()):
                    ranks.append(int(p.environ().get("RANK", "-1")))
                    p.kill()  # SIGKILL: a stopped process takes no other signal
            except (psutil.Error, ValueError):
                continue
        return sorted(ranks)


def _launch(args: List[str], run: str) -> int:
    from torch.distributed import run as trun  # start-up time: torchrun's machinery only once a run launches

    try:
        trun.main(args)
    except SystemExit as e:  # torchrun exits on argument errors
        if e.code not in (0, None):
            raise RuntimeError(f"torchrun failed ({e.code}); arguments {args}") from None
    except Exception as e:  # ChildFailedError and friends
        raise RuntimeError(f"training failed: {_summarise(e)} (full tracebacks above; logs in {run})") from None
    return 0


def _summarise(e: Exception) -> str:
    failures = getattr(e, "failures", None)
    if failures:
        parts = []
        for rank, f in sorted(failures.items()):
            msg = ""
            try:
                msg = f.message.get("message", "") if isinstance(f.message, dict) else str(f.message)
            except Exception:  # noqa: BLE001
                pass
            first = msg.strip().splitlines()[0] if msg.strip() else f"exit code {f.exitcode}"
            parts.append(f"rank {rank}: {first}")
        return "; ".join(parts)
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def worker_main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    p = argparse.ArgumentParser(prog="nestpipe.trainer.launch")
    p.add_argument("--worker-run", required=True)
    p.add_argument("--worker-resume", action="store_true")
    a = p.parse_args(argv)

    @record
    def _main() -> int:
        dense_optim.skip_dynamo_import()  # a rank process never compiles: seconds less at every start
        cfg = load_run_config(a.worker_run)
        dev = devmod.resolve(cfg.device, devmod.local_rank(), cfg.dist_backend)
        devmod.set_flush_denormal(cfg.flush_denormal)  # before any thread starts: they inherit the mode
        # a failed collective names the peers that stopped answering (distributed/liveness.py)
        beat = liveness.Heartbeat.from_env(interval_s=min(1.0, max(0.05, cfg.timeout_s / 10)))
        rank = int(os.environ.get("RANK", "0"))
        try:
            rank, world = devmod.init_distributed(dev, cfg.timeout_s)
            train_worker(cfg, dev, rank, world, a.worker_resume, hooks=testing_hooks.from_env())
            if world > 1:
                dist.barrier()  # nobody tears down gloo while a peer still talks to it
        except Exception as e:
            print(f"[rank {rank}] error:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            named = liveness.name_silent_peers(e, beat)
            if named is not None:
                raise named from e
            raise
        finally:
            if beat is not None:
                beat.stop()
            if dist.is_initialized():
                dist.destroy_process_group()
        return 0

    rc = _main()
    # Everything the run writes is written atomically and complete by now. Leave without running interpreter and
    # C++ static teardown: a native thread still joinable at that point (gloo's transport loops of the per-stage
    # process groups, the kernels' thread pools) aborts the process with "terminate called without an active
    # exception" after a finished run, about once in tens of launches here, and torchrun reports the rank failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(worker_main())
