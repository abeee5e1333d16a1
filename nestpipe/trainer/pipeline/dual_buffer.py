"""DBP's dual buffers: the owner's *active* buffer (rows of batch t, being trained) and *prefetch* buffer (rows of
batch t+1, retrieved while t trains).

The DBP invariant (stated here, enforced by :class:`DualBuffer` and
:meth:`~nestpipe.trainer.embedding.collection.ShardedEmbeddingCollection.sync_dual_buffer`):

    When batch t+1's buffer serves its first embedding request, every row in it (weight and AdaGrad state) equals
    the row in the DRAM store after batch t's update was written back, i.e. what the synchronous step would read.

Why it holds:
1. Retrieval runs at most one batch ahead: the retrieval stage takes one of two buffer permits before gathering
   batch u's rows and the compute thread returns batch t's permit only after t's update was written back to the
   store and synced into t+1 (:meth:`DualBuffer.sync`, then :meth:`DualBuffer.release`). So retrieval of u starts after batch u-2 was written
   back: every row of u not touched by batch u-1 is current in the store when gathered (the store's lock makes each
   gather and write-back atomic).
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
``replica_own_keys_only`` (the ``replica_refresh_own_keys_only`` testing hook) drops 2' (the 2D-SP control).
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from nestpipe.trainer.embedding.collection import Routing, ShardedEmbeddingCollection


class Stopped(Exception):
    """The pipeline is shutting down."""


class DualBuffer:
    PERMITS = 2  # active + prefetch

    def __init__(self, emb: ShardedEmbeddingCollection, skip_sync: bool = False, replica_own_keys_only: bool = False):
        self.emb = emb
        self.skip_sync = skip_sync
        self.replica_own_keys_only = replica_own_keys_only  # debug: 2D-SP negative control
        self._free = threading.Semaphore(self.PERMITS)
        self.rows_synced = 0

    def retrieve(self, routing: Routing, stop: threading.Event, copy=None) -> float:
        """Retrieval stage (its own thread): wait for a free buffer, then gather batch rows from the store
        (``copy``: how a gathered host tensor reaches the device, the retrieval stream's
        :meth:`~nestpipe.trainer.pipeline.streams.StageStream.copy`). Returns when the gather started."""
        while not self._free.acquire(timeout=0.05):
            if stop.is_set():
                raise Stopped()
        t0 = time.perf_counter()
        self.emb.retrieve(routing, copy=copy)
        return t0

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
        """After :meth:`sync`: free the active buffer and its permit (the retrieval of batch t+2 may start)."""
        self.emb.release(active)
        self._free.release()
