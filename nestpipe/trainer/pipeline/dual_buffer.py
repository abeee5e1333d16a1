"""DBP's dual buffers: the owner's *active* buffer (rows of batch t, being trained) and *prefetch* buffer (rows of
batch t+1, retrieved while t trains).

The DBP invariant (stated here, enforced by :class:`DualBuffer` and
:meth:`~nestpipe.trainer.embedding.collection.ShardedEmbeddingCollection.sync_dual_buffer`):

    When batch t+1's buffer serves its first embedding request, every row in it (weight and AdaGrad state) equals
    the row in the DRAM store after batch t's update was written back, i.e. what the synchronous step would read.

Why it holds:
1. Retrieval runs at most one batch ahead: the retrieval stage takes one of two buffer permits before gathering
   batch u's rows and the compute thread returns batch t's permit only after t's update was synced into t+1
   (:meth:`DualBuffer.sync`, then :meth:`DualBuffer.release`) and written back to the store, or, where the
   write-back runs on its own device stream, handed to the retrieval stage, which finishes it (waits for the copy
   to the host, scatters the rows) after taking the permit and before its gather. So retrieval of u gathers after
   batch u-2 was written back: every row of u not touched by batch u-1 is current in the store when gathered (the
   store's lock makes each gather and write-back atomic).
2. Rows of keys(u-1) ∩ keys(u) may have been gathered before u-1's write-back: :meth:`DualBuffer.sync` copies
   them from the updated active buffer into the prefetch buffer before u's forward begins (bitwise copies). With
   host-resident buffers (CPU, ``embedding.dbp_update_in_store``) batch u-1 was updated in the store itself and
   its buffer still holds the old rows, so they are copied from the store instead; there the buffers hold weights
   only (the update reads and writes the AdaGrad state in the store).
3. Key routing (stages 1-3) does not read parameters, so it may run any number of batches ahead.

2'. With 2D sparse parallelism the replica synchronisation after batch u-1's update also changes rows of this
   shard that other groups touched (outside this group's keys(u-1)): step 2 copies every row touched by ANY group
   in batch u-1 that batch u holds (:meth:`~nestpipe.trainer.embedding.replica_sync.ReplicaSync.refresh_prefetch`).

``skip_sync`` (the ``skip_dual_buffer_sync`` testing hook) drops step 2: the negative control for this invariant;
``replica_own_keys_only`` (the ``replica_refresh_own_keys_only`` testing hook) drops 2' (the 2D-SP control);
``late_write_back`` (the ``late_write_back`` testing hook) finishes a batch's write-back one retrieval late, after
the gather of u that needed it (the control of step 1 with a write-back stream).
"""

from __future__ import annotations

import threading
import time
from typing import List, Optional

from nestpipe.trainer.embedding.collection import Routing, ShardedEmbeddingCollection


class Stopped(Exception):
    """The pipeline is shutting down."""


class DualBuffer:
    PERMITS = 2  # active + prefetch

    def __init__(self, emb: ShardedEmbeddingCollection, skip_sync: bool = False, replica_own_keys_only: bool = False,
                 late_write_back: bool = False):
        self.emb = emb
        self.skip_sync = skip_sync
        self.replica_own_keys_only = replica_own_keys_only  # debug: 2D-SP negative control
        self.late_write_back = late_write_back  # debug: write-back stream negative control
        self._free = threading.Semaphore(self.PERMITS)
        self._write_backs: List = []  # released batches' pending write-backs, oldest first
        self._lock = threading.Lock()
        self.rows_synced = 0

    def retrieve(self, routing: Routing, stop: threading.Event, copy=None, host_buffer=None) -> float:
        """Retrieval stage (its own thread): wait for a free buffer, finish the write-backs of the batches released
        since (their rows reach the store), then gather batch rows from the store (``copy`` / ``host_buffer``: the
        retrieval stream's :class:`~nestpipe.trainer.pipeline.streams.StageStream` methods). Returns when the gather
        started."""
        while not self._free.acquire(timeout=0.05):
            if stop.is_set():
                raise Stopped()
        self.finish_write_backs(keep_last=self.late_write_back)
        t0 = time.perf_counter()
        self.emb.retrieve(routing, copy=copy, host_buffer=host_buffer)
        return t0

    def finish_write_backs(self, keep_last: bool = False) -> None:
        """Finish the pending write-backs in release order (``keep_last``: all but the newest, the control)."""
        with self._lock:
            n = len(self._write_backs) - (1 if keep_last and self._write_backs else 0)
            todo, self._write_backs = self._write_backs[:n], self._write_backs[n:]
        for pending in todo:
            pending.finish()

    def sync(self, active: Routing, prefetch: Optional[Routing]) -> None:
        """Compute thread, after ``active``'s update (rows written back, kept in the buffer) and before
        ``prefetch``'s first embedding send: copy the rows of keys(t) ∩ keys(t+1) active -> prefetch; after it
        ``prefetch``'s buffer is final (may serve requests). :meth:`release` frees the active buffer next."""
        if prefetch is None or self.skip_sync:
            return
        with self.emb.timer.span("dbp.sync", prefetch.batch.step):
            if self.emb.replica_sync is not None and not self.replica_own_keys_only:
                # 2D-SP: every row the replica synchronisation changed, see replica_sync.refresh_prefetch
                self.rows_synced += self.emb.replica_sync.refresh_prefetch(active, prefetch)
            else:
                self.rows_synced += self.emb.sync_dual_buffer(active, prefetch)

    def release(self, active: Routing) -> None:
        """After :meth:`sync`: free the active buffer and its permit (the retrieval of batch t+2 may start); a
        write-back still on its way to the store goes with the permit (the retrieval finishes it before gathering)."""
        pending, active.pending_write_back = active.pending_write_back, None
        self.emb.release(active)
        if pending is not None:
            with self._lock:
                self._write_backs.append(pending)
        self._free.release()
