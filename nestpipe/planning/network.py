"""Collective costs on the cluster of :class:`~nestpipe.planning.hardware.HardwareConfig`.

All2All among ``peers`` rank-contiguous workers, each sending ``nbytes`` in total (spread evenly over the
others). Traffic splits into intra-node (``intra_bw``), intra-pod (``net_bw``) and cross-pod
(``net_bw / oversubscription``) shares by where the peers sit; the NIC carries the last two one after the other,
the intra-node fabric runs beside it.

- ``direct``: one message per peer, ``(peers - 1)`` latencies.
- ``hierarchical``: an intra-node transpose, then one message per remote *node* (``peers / node_size - 1``
  latencies) carrying the node's aggregated rows; same NIC bytes, fewer messages.

A ring AllReduce of ``nbytes`` over ``members`` workers placed ``stride`` ranks apart moves
``2 (members - 1) / members * nbytes`` per worker with ``2 (members - 1)`` latencies.
"""

from __future__ import annotations

from .hardware import HardwareConfig


def _shares(hw: HardwareConfig, peers: int):
    others = max(peers - 1, 1)
    node = min(peers, hw.node_size)
    pod = min(peers, hw.pod_size)
    intra = (node - 1) / others
    in_pod = (pod - node) / others
    cross = (peers - pod) / others
    return intra, in_pod, cross


def all2all_seconds(hw: HardwareConfig, peers: int, nbytes: float) -> float:
    """Seconds of one All2All among ``peers`` workers, ``nbytes`` sent per worker."""
    if peers <= 1 or nbytes <= 0:
        return 0.0
    intra, in_pod, cross = _shares(hw, peers)
    t_intra = nbytes * intra / hw.intra_bw
    t_nic = nbytes * in_pod / hw.net_bw + nbytes * cross * hw.oversubscription / hw.net_bw
    if hw.all2all == "hierarchical" and peers > hw.node_size:
        nodes = -(-peers // hw.node_size)
        # the transpose moves the remote share once more over the intra-node fabric
        t_intra += nbytes * (in_pod + cross) / hw.intra_bw
        lat = (nodes - 1) * hw.latency_us + (min(peers, hw.node_size) - 1) * hw.intra_latency_us
    else:
        node = min(peers, hw.node_size)
        lat = (peers - node) * hw.latency_us + (node - 1) * hw.intra_latency_us
    return max(t_intra, t_nic) + lat * 1e-6


def allreduce_seconds(hw: HardwareConfig, members: int, nbytes: float, stride: int = 1,
                      latency: bool = True) -> float:
    """Seconds of a ring AllReduce of ``nbytes`` over ``members`` workers placed ``stride`` ranks apart.
    ``latency=False``: the bandwidth term only (bytes that ride in an AllReduce issued anyway)."""
    if members <= 1 or nbytes <= 0:
        return 0.0
    span = members * stride
    if stride >= hw.pod_size or span > hw.pod_size:
        bw, lat = hw.net_bw / hw.oversubscription, hw.latency_us
    elif span <= hw.node_size:
        bw, lat = hw.intra_bw, hw.intra_latency_us
    else:
        bw, lat = hw.net_bw, hw.latency_us
    return 2.0 * (members - 1) / members * nbytes / bw + (2.0 * (members - 1) * lat * 1e-6 if latency else 0.0)
