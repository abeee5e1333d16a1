"""Jagged causal HSTU attention on the CPU: Numba loops over the causal triangle of each sequence, nothing else.

Why hand-written: no maintained CPU op computes pointwise (SiLU) attention over jagged sequences. fbgemm's jagged
ops cover jagged x dense products and softmax, not a per-sequence causal ``q k^T`` followed by a pointwise
activation; torch's padded batched matmuls compute every padded token and every score above the diagonal (see
``docs/trainer.md``). HSTU's SiLU needs no running softmax state, so a row of scores ends where the causal bound
says and tiles above the diagonal are never visited.

Math, per sequence (tokens ``o .. o + L - 1`` of the flat layout), head ``h``, query ``i`` and key ``j <= i``
(positions within the sequence)::

    z_ij = scale * q_i . k_j + pos_bias[h, min(i - j, P - 1)] + time_bias[h, bucket(t_i - t_j)]
    a_ij = silu(z_ij) * inv_norm
    out_i = sum_{j <= i} a_ij v_j

The backward recomputes ``z`` (nothing of size L^2 is stored). Layouts: ``q, k, v, out, d*`` are ``[T, H, d]``
(token-major); ``kt, vt`` the same values as ``[H, d, T]`` so that the scores of one query against all its keys
are a vector axpy over contiguous keys (independent lanes: vectorised without reassociating any sum).

Determinism: one (sequence, head) pair per loop iteration, which owns its rows of every output and sums in a fixed
order (ascending key for a query's output and ``dq``, ascending query for ``dk``/``dv``); the bias gradients are
summed per pair into its own rows, then over pairs in order by the caller. Results are bitwise
identical run to run and for any thread count; ``fastmath`` is off (IEEE float arithmetic).
"""

from __future__ import annotations

import math

import numba
import numpy as np

_JIT = dict(nopython=True, nogil=True, cache=True)


@numba.jit(inline="always", **_JIT)
def _bucket(dt, m):
    """``min(bit_length(max(dt, 0)), m - 1)`` (:func:`nestpipe.kernels.attention.time_buckets`)."""
    b = 0
    while dt > 0 and b < m - 1:
        dt >>= 1
        b += 1
    return b


@numba.jit(inline="always", **_JIT)
def _scores(z, q, kt, h, qi, o, n, d, scale, bias, nb, tbias, times, nt):
    """``z[0:n] = scale * q[qi, h] . k[o + j, h] + bias[h, min(qi - o - j, nb - 1)] + tbias[h, bucket(times[qi] -
    times[o + j])]`` for keys ``j < n``."""
    for j in range(n):
        z[j] = 0.0
    for c in range(d):
        qc = q[qi, h, c] * scale
        row = kt[h, c]
        for j in range(n):
            z[j] += qc * row[o + j]
    if nb > 0:
        i = qi - o
        for j in range(n):
            r = i - j
            if r > nb - 1:
                r = nb - 1
            z[j] += bias[h, r]
    if nt > 0:
        tq = times[qi]
        for j in range(n):
            z[j] += tbias[h, _bucket(tq - times[o + j], nt)]


@numba.jit(inline="always", **_JIT)
def _forward_pair(q, kt, v, out, o, length, h, d, scale, inv_norm, bias, nb, tbias, times, nt, z, acc, shift, one):
    for i in range(length):
        n = min(i + 1 + shift, length)
        _scores(z, q, kt, h, o + i, o, n, d, scale, bias, nb, tbias, times, nt)
        for c in range(d):
            acc[c] = 0.0
        for j in range(n):
            x = z[j]
            a = x / (one + math.exp(-x)) * inv_norm
            vr = v[o + j, h]
            for c in range(d):
                acc[c] += a * vr[c]
        for c in range(d):
            out[o + i, h, c] = acc[c]


@numba.jit(inline="always", **_JIT)
def _backward_pair(q, k, kt, vt, dout, dq, dkt, dvt, dbias, dtbias, o, length, h, d, scale, inv_norm, bias, nb, tbias,
                   times, nt, z, da, acc, one):
    """Gradients of one (sequence, head). ``dkt``/``dvt`` are ``[H, d, T]`` (zeroed by the caller): every update is
    an axpy over the contiguous keys of the row, like the scores."""
    for i in range(length):
        n = i + 1
        qi = o + i
        _scores(z, q, kt, h, qi, o, n, d, scale, bias, nb, tbias, times, nt)
        for j in range(n):
            da[j] = 0.0
        for c in range(d):
            g = dout[qi, h, c]
            row = vt[h, c]
            for j in range(n):
                da[j] += g * row[o + j]
        for j in range(n):  # z -> a (kept in z), da -> dz (kept in da)
            x = z[j]
            s = one / (one + math.exp(-x))
            z[j] = x * s * inv_norm
            da[j] = da[j] * inv_norm * (s * (one + x * (one - s)))
        if nb > 0:
            for j in range(n):
                r = i - j
                if r > nb - 1:
                    r = nb - 1
                dbias[r] += da[j]
        if nt > 0:
            tq = times[qi]
            for j in range(n):
                dtbias[_bucket(tq - times[o + j], nt)] += da[j]
        for c in range(d):
            gv = dout[qi, h, c]
            gk = q[qi, h, c] * scale
            rv = dvt[h, c]
            rk = dkt[h, c]
            for j in range(n):
                rv[o + j] += gv * z[j]
                rk[o + j] += gk * da[j]
        for c in range(d):
            acc[c] = 0.0
        for j in range(n):
            g = da[j]
            kr = k[o + j, h]
            for c in range(d):
                acc[c] += g * kr[c]
        for c in range(d):
            dq[qi, h, c] = acc[c] * scale


@numba.jit(parallel=True, **_JIT)
def _forward(q, kt, v, offsets, scale, inv_norm, bias, tbias, times, out, max_len, shift, one):
    _, heads, d = q.shape
    nb, nt = bias.shape[1], tbias.shape[1]
    pairs = (len(offsets) - 1) * heads
    for p in numba.prange(pairs):
        s, h = p // heads, p % heads
        o, length = offsets[s], offsets[s + 1] - offsets[s]
        z = np.empty(max_len, q.dtype)
        acc = np.empty(d, q.dtype)
        _forward_pair(q, kt, v, out, o, length, h, d, scale, inv_norm, bias, nb, tbias, times, nt, z, acc, shift, one)


@numba.jit(**_JIT)
def _forward_serial(q, kt, v, offsets, scale, inv_norm, bias, tbias, times, out, max_len, shift, one):
    _, heads, d = q.shape
    nb, nt = bias.shape[1], tbias.shape[1]
    z = np.empty(max_len, q.dtype)
    acc = np.empty(d, q.dtype)
    for s in range(len(offsets) - 1):
        o, length = offsets[s], offsets[s + 1] - offsets[s]
        for h in range(heads):
            _forward_pair(q, kt, v, out, o, length, h, d, scale, inv_norm, bias, nb, tbias, times, nt, z, acc, shift,
                          one)


@numba.jit(parallel=True, **_JIT)
def _backward(q, k, kt, vt, dout, offsets, scale, inv_norm, bias, tbias, times, dq, dkt, dvt, dbias, dtbias, max_len,
              one):
    _, heads, d = q.shape
    nb, nt = bias.shape[1], tbias.shape[1]
    pairs = (len(offsets) - 1) * heads
    for p in numba.prange(pairs):
        s, h = p // heads, p % heads
        o, length = offsets[s], offsets[s + 1] - offsets[s]
        z = np.empty(max_len, q.dtype)
        da = np.empty(max_len, q.dtype)
        acc = np.empty(d, q.dtype)
        _backward_pair(q, k, kt, vt, dout, dq, dkt, dvt, dbias[p], dtbias[p], o, length, h, d, scale, inv_norm, bias,
                       nb, tbias, times, nt, z, da, acc, one)


@numba.jit(**_JIT)
def _backward_serial(q, k, kt, vt, dout, offsets, scale, inv_norm, bias, tbias, times, dq, dkt, dvt, dbias, dtbias,
                     max_len, one):
    _, heads, d = q.shape
    nb, nt = bias.shape[1], tbias.shape[1]
    z = np.empty(max_len, q.dtype)
    da = np.empty(max_len, q.dtype)
    acc = np.empty(d, q.dtype)
    for s in range(len(offsets) - 1):
        o, length = offsets[s], offsets[s + 1] - offsets[s]
        for h in range(heads):
            p = s * heads + h
            _backward_pair(q, k, kt, vt, dout, dq, dkt, dvt, dbias[p], dtbias[p], o, length, h, d, scale, inv_norm,
                           bias, nb, tbias, times, nt, z, da, acc, one)


def forward(q: np.ndarray, kt: np.ndarray, v: np.ndarray, offsets: np.ndarray, scale: float, inv_norm: float,
            bias: np.ndarray, max_len: int, threads: int, causal_shift: int = 0, tbias: np.ndarray = None,
            times: np.ndarray = None) -> np.ndarray:
    """``out [T, H, d]`` of the causal jagged attention (module docstring); ``bias [H, P]`` (``P = 0``: none),
    ``tbias [H, M]`` with ``times`` int64 ``[T]`` (``M = 0``: none).
    ``causal_shift``: keys ``j <= i + causal_shift`` are attended (0: causal; 1 is the off-by-one the tests' negative
    control injects)."""
    out = np.empty_like(q)
    fn = _forward_serial if threads == 1 else _forward
    ty = q.dtype.type
    tbias, times = _time_args(q, tbias, times)
    fn(q, kt, v, offsets, ty(scale), ty(inv_norm), bias, tbias, times, out, max(int(max_len), 1), int(causal_shift),
       ty(1.0))
    return out


def _time_args(q, tbias, times):
    if tbias is None or tbias.shape[1] == 0:
        return np.zeros((q.shape[1], 0), q.dtype), np.zeros(1, np.int64)
    return tbias, times


def backward(q, k, kt, vt, dout, offsets, scale: float, inv_norm: float, bias: np.ndarray, max_len: int,
             threads: int, tbias: np.ndarray = None, times: np.ndarray = None):
    """``(dq, dk, dv, dbias [S * H, P], dtbias [S * H, M])``, ``dk``/``dv`` as ``[H, d, T]`` (transpose to ``[T, H,
    d]``); the caller sums ``dbias`` and ``dtbias`` over sequences (in order)."""
    dq = np.empty_like(q)
    dkt, dvt = np.zeros_like(kt), np.zeros_like(vt)
    heads = q.shape[1]
    dbias = np.zeros(((len(offsets) - 1) * heads, bias.shape[1]), q.dtype)
    tbias, times = _time_args(q, tbias, times)
    dtbias = np.zeros(((len(offsets) - 1) * heads, tbias.shape[1]), q.dtype)
    fn = _backward_serial if threads == 1 else _backward
    ty = q.dtype.type
    fn(q, k, kt, vt, dout, offsets, ty(scale), ty(inv_norm), bias, tbias, times, dq, dkt, dvt, dbias, dtbias,
       max(int(max_len), 1), ty(1.0))
    return dq, dkt, dvt, dbias, dtbias
