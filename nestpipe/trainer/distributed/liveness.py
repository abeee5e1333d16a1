"""Which ranks stopped answering, when a collective fails.

A collective that times out (gloo, NCCL: after ``timeout_s``) or loses its connection says only that, not which
peer is missing: a rank that is stopped (SIGSTOP, a debugger), on a hung host or dead leaves the others waiting.
Each rank runs a :class:`Heartbeat`: a daemon thread that adds 1 to the rank's counter in the job's key-value store
(the one torchrun serves at ``MASTER_ADDR:MASTER_PORT``) every ``interval_s``, independent of the training threads,
so a rank blocked in a collective keeps beating while a stopped or dead one does not. A rank whose run fails with a
communication error reads every counter twice, a few intervals apart (:meth:`Heartbeat.silent_ranks`), and its
error names the ranks whose counter did not move (:func:`name_silent_peers`).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import List, Optional

import torch.distributed as dist

PREFIX = "nestpipe/heartbeat/"
# what a failed collective's message says (gloo, NCCL, the store): a timeout, or a peer's connection gone
COMM_FAILURE = ("timeout", "timed out", "connection reset", "connection closed", "broken pipe", "peer")


class Heartbeat:
    """This rank's proof of life in the job's store, and the reading of everyone's (see the module docstring)."""

    def __init__(self, store, rank: int, world: int, interval_s: float = 1.0):
        self.store, self.rank, self.world, self.interval_s = store, rank, world, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

    @staticmethod
    def from_env(interval_s: float = 1.0) -> Optional["Heartbeat"]:
        """A started heartbeat for this torchrun rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT), or None for one rank or
        where the store cannot be reached (the run does not depend on it)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world < 2 or "MASTER_ADDR" not in os.environ:
            return None
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
        except Exception:  # noqa: BLE001 - diagnostics only: a run never fails for want of them
            return None
        beat = Heartbeat(store, int(os.environ.get("RANK", "0")), world, interval_s)
        beat.start()
        return beat

    def start(self) -> None:
        self.store.add(f"{PREFIX}{self.rank}", 1)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(f"{PREFIX}{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing left to tell
                return

    def counts(self) -> List[int]:
        return [int(self.store.add(f"{PREFIX}{r}", 0)) for r in range(self.world)]

    def silent_ranks(self, intervals: float = 3.0) -> List[int]:
        """The other ranks whose heartbeat did not move in ``intervals`` beat intervals (stopped, hung or dead)."""
        before = self.counts()
        time.sleep(intervals * self.interval_s)
        after = self.counts()
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]


def is_comm_failure(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}".lower()
    return any(k in text for k in COMM_FAILURE)


def name_silent_peers(e: BaseException, beat: Optional[Heartbeat]) -> Optional[RuntimeError]:
    """For a communication failure: an error whose first line names the ranks that stopped answering (None when
    it is not one, there is no heartbeat, or every peer is alive: then ``e`` says it best)."""
    if beat is None or not is_comm_failure(e):
        return None
    try:
        silent = beat.silent_ranks()
    except Exception:  # noqa: BLE001 - the store is gone with the failure: nothing to add
        return None
    if not silent:
        return None
    who = ", ".join(f"rank {r}" for r in silent)
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return RuntimeError(f"{who} stopped answering (no heartbeat for {3 * beat.interval_s:.0f} s: stopped, hung "
                        f"or dead); this rank's collective failed: {type(e).__name__}: {first}")
