"""One process group per concurrent stage, and the one thread allowed to issue collectives on each.

gloo (and NCCL/HCCL) match collectives on a group by issue order: two threads interleaving collectives on one group
hang or swap payloads. So every stage that communicates concurrently with another gets its own group:

    route  - key routing (stage 3): two ``all_to_all_single`` per batch
    embed  - the per-micro-batch embedding All2All (owner -> requester)
    grad   - the per-micro-batch gradient All2All (requester -> owner)
    dense  - the per-batch dense + replicated gradient all-reduce

The groups are created by :func:`create` in exactly this order on every rank (``new_group`` is itself collective).
:meth:`StageGroups.bind` names, per mode, the single thread that issues on each group; :meth:`StageGroups.get`
refuses any other thread. The default group is used only by the main thread while nothing is in flight
(checkpoints, metrics).
"""

from __future__ import annotations

import datetime
import threading
from typing import Dict, Optional

import torch.distributed as dist

STAGE_GROUPS = ("route", "embed", "grad", "dense")

# mode -> stage group -> name of the thread that issues its collectives ("compute" is the main thread)
ISSUERS: Dict[str, Dict[str, str]] = {
    "off": {"route": "compute", "embed": "compute", "grad": "compute", "dense": "compute"},
    "dbp": {"route": "route", "embed": "compute", "grad": "compute", "dense": "compute"},
    "fwp": {"route": "compute", "embed": "embed-comm", "grad": "grad-comm", "dense": "compute"},
    "nested": {"route": "route", "embed": "embed-comm", "grad": "grad-comm", "dense": "compute"},
}
# the Frozen-Window Pipeline's alternative layout: one thread for both exchange groups (``pipe.comm_threads = 1``)
ONE_COMM_THREAD = {"embed": "comm", "grad": "comm"}


def issuers(mode: str, comm_threads: int = 2) -> Dict[str, str]:
    """Stage group -> issuing thread name for ``mode``. With one communication thread it issues on both the
    ``embed`` and the ``grad`` group in one fixed order (the same on every rank, so blocking collectives on two
    groups cannot deadlock): still exactly one issuing thread per group."""
    out = dict(ISSUERS[mode])
    if comm_threads == 1 and mode in ("fwp", "nested"):
        out.update(ONE_COMM_THREAD)
    out["replica"] = "compute"  # 2D sparse parallelism's replica synchronisation (nestpipe.trainer.distributed.sparse_groups)
    return out


class StageGroups:
    def __init__(self, groups: Dict[str, Optional[object]]):
        self.groups = groups
        self._issuer: Dict[str, threading.Thread] = {}  # stage -> the thread that issues its collectives
        self._lock = threading.Lock()

    def bind(self, stage: str, thread: threading.Thread) -> None:
        """Declare ``thread`` the only issuer of ``stage``'s collectives (until :meth:`unbind_all`). Bind before the
        thread starts issuing."""
        with self._lock:
            self._issuer[stage] = thread

    def unbind_all(self) -> None:
        with self._lock:
            self._issuer.clear()

    def issuers(self) -> Dict[str, str]:
        with self._lock:
            return {s: t.name for s, t in self._issuer.items()}

    def get(self, stage: str):
        """The group of ``stage``; raises if the calling thread is not its bound issuer."""
        with self._lock:
            want = self._issuer.get(stage)
        if want is None:
            raise RuntimeError(f"process group {stage!r}: no issuing thread bound")
        if threading.current_thread() is not want:
            raise RuntimeError(f"process group {stage!r}: collective issued from thread "
                               f"{threading.current_thread().name!r}, only {want.name!r} may issue on it")
        return self.groups[stage]


_CACHE: Dict[tuple, Dict[str, object]] = {}


def create(world: int, timeout: Optional[datetime.timedelta] = None) -> StageGroups:
    """Create (once per process and world) the stage groups, in :data:`STAGE_GROUPS` order on every rank.
    ``timeout``: how long their collectives wait for a peer (the run's ``timeout_s``; a group made without one
    waits torch's default, 30 minutes for gloo, whatever the world group's timeout is)."""
    if world <= 1 or not dist.is_initialized():
        return StageGroups({s: None for s in STAGE_GROUPS})
    key = (world, id(dist.group.WORLD))
    if key not in _CACHE:
        ranks = list(range(world))
        _CACHE[key] = {s: dist.new_group(ranks=ranks, timeout=timeout) for s in STAGE_GROUPS}
    return StageGroups(dict(_CACHE[key]))


def forget() -> None:
    """Drop cached groups (call before ``destroy_process_group``)."""
    _CACHE.clear()
