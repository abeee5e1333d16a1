"""Jagged HSTU attention (nestpipe.kernels.attention): both CPU paths (the exact loops, the blocked tiles) and the
Triton kernels (interpreter mode) equal the padded reference in outputs and in every gradient on adversarial length
mixes, a prefix's outputs do not change when tokens are appended, the kernel
is deterministic across thread counts, and the HSTU model gives the same loss and gradients with either attention.

Tolerance: float32 outputs and gradients within 1e-5 of the largest reference magnitude (the two paths sum the
same products in different orders); float64 within 1e-12."""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from nestpipe.kernels import attention as A
from nestpipe.kernels import attention_cpu, select
from nestpipe.trainer.models.common import sequential_table_widths
from nestpipe.trainer.models.hstu import HSTU, HSTUConfig

LENGTH_MIXES = {
    "one token each": [1, 1, 1],
    "all equal": [7, 7, 7, 7],
    "one long among short": [1, 2, 90, 3, 1],
    "empty micro-batch": [],
    "empty sequences": [0, 5, 0, 2],
}
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _inputs(lengths, heads=2, d=8, dtype=torch.float32, bias_len=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = int(sum(lengths))
    q, k, v, dout = (torch.randn(t, heads, d, generator=g, dtype=dtype) for _ in range(4))
    bias = torch.randn(heads, bias_len, generator=g, dtype=dtype) * 0.5
    offsets = torch.tensor([0] + list(np.cumsum(lengths, dtype=np.int64)), dtype=torch.int64)
    return q, k, v, dout, bias, offsets


def _run(fn, q, k, v, dout, bias, offsets):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    b = bias.clone().requires_grad_(True) if bias is not None else None
    out = fn(*leaves, offsets, b)
    out.backward(dout)
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
    return out.detach(), grads, (b.grad if b is not None and b.grad is not None else None)


def _close(a, b, tol):
    scale = max(float(b.abs().max()) if b.numel() else 0.0, 1e-30)
    return float((a - b).abs().max()) / scale <= tol if b.numel() else a.numel() == 0


def _jagged(q, k, v, offsets, bias):
    return A.hstu_attention(q, k, v, offsets, 128, 0.35, 1 / 64, bias)


def _padded(q, k, v, offsets, bias):
    return A.padded_reference(q, k, v, offsets, 0.35, 1 / 64, bias)


@pytest.fixture(params=["numba", "blocked"])
def cpu_path(request, monkeypatch):
    """Both CPU paths on every length: the exact loops (whatever the length) or the blocked tiles (always)."""
    monkeypatch.setattr(A, "EXACT_MAX_LEN", 10 ** 9 if request.param == "numba" else 0)
    select.reset_taken()
    yield request.param
    taken = select.taken_paths().get("hstu_attention", {})
    assert set(taken) <= {request.param}, taken


@pytest.mark.parametrize("mix", sorted(LENGTH_MIXES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_jagged_equals_padded_outputs_and_gradients(cpu_path, mix, dtype, with_bias):
    assert select.select_path("hstu_attention", "cpu") == "numba"
    q, k, v, dout, bias, offsets = _inputs(LENGTH_MIXES[mix], dtype=dtype)
    bias = bias if with_bias else None
    out_j, grads_j, gb_j = _run(_jagged, q, k, v, dout, bias, offsets)
    out_p, grads_p, gb_p = _run(_padded, q, k, v, dout, bias, offsets)
    tol = TOL[dtype]
    assert out_j.dtype == dtype and out_j.shape == q.shape
    assert _close(out_j, out_p, tol)
    for name, a, b in zip("qkv", grads_j, grads_p):
        assert _close(a, b, tol), name
    if with_bias:
        assert _close(gb_j, gb_p, tol)


def test_distances_past_the_bias_table_share_its_last_value(cpu_path):
    q, k, v, dout, bias, offsets = _inputs([40, 3], bias_len=8)  # distances up to 39 > 7
    out_j, _, gb_j = _run(_jagged, q, k, v, dout, bias, offsets)
    out_p, _, gb_p = _run(_padded, q, k, v, dout, bias, offsets)
    assert _close(out_j, out_p, 1e-5) and _close(gb_j, gb_p, 1e-5)


def test_negative_control_an_off_by_one_causal_bound_is_caught():
    q, k, v, _, bias, offsets = _inputs(LENGTH_MIXES["one long among short"])
    ref = _padded(q, k, v, offsets, bias)
    kt = k.numpy().transpose(1, 2, 0).copy()
    args = (q.numpy(), kt, v.numpy(), offsets.numpy(), 0.35, 1 / 64, bias.numpy(), 128, 1)
    right = torch.from_numpy(attention_cpu.forward(*args, causal_shift=0))
    wrong = torch.from_numpy(attention_cpu.forward(*args, causal_shift=1))  # sees the next token
    assert _close(right, ref, 1e-5)
    assert not _close(wrong, ref, 1e-5)
    blocked = A.blocked_attention(q, k, v, offsets, 0.35, 1 / 64, bias, block=16)
    blocked_wrong = A.blocked_attention(q, k, v, offsets, 0.35, 1 / 64, bias, block=16, causal_shift=1)
    assert _close(blocked, ref, 1e-5)
    assert not _close(blocked_wrong, ref, 1e-5)


def test_a_prefix_is_unchanged_when_tokens_are_appended(cpu_path):
    # causal + a bias of the distance only: what a cached prefix relies on; bitwise on the jagged path
    q, k, v, _, bias, _ = _inputs([50])
    full = _jagged(q, k, v, torch.tensor([0, 50]), bias)
    prefix = _jagged(q[:30], k[:30], v[:30], torch.tensor([0, 30]), bias)
    assert torch.equal(full[:30], prefix)


def test_deterministic_across_thread_counts(cpu_path):
    q, k, v, dout, bias, offsets = _inputs([33, 1, 60, 7, 12], seed=3)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(_jagged, q, k, v, dout, bias, offsets)
        torch.set_num_threads(2)
        two = _run(_jagged, q, k, v, dout, bias, offsets)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one[0], two[0]) and all(torch.equal(a, b) for a, b in zip(one[1], two[1]))
    assert torch.equal(one[2], two[2])


def _times(lengths, seed=0):
    """Per-token int64 times, non-decreasing within each sequence: equal times (difference 0), one-unit steps and
    gaps up to 2**40 (past the last bucket)."""
    g = np.random.default_rng(seed)
    out = []
    for L in lengths:
        steps = g.choice([0, 1, 2, 3, 100, 5000, 2 ** 20, 2 ** 40], size=L)
        out.append(np.cumsum(steps) + g.integers(0, 10 ** 6))
    return torch.from_numpy(np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64))


def _run_time(fn, q, k, v, dout, bias, tbias, times, offsets):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, bias, tbias)]
    out = fn(*leaves[:3], offsets, leaves[3], leaves[4], times)
    out.backward(dout)
    return out.detach(), [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]


def test_time_buckets_are_bit_lengths_the_same_on_every_path():
    dt = torch.tensor([-5, 0, 1, 2, 3, 4, 7, 8, 2 ** 20 - 1, 2 ** 20, 2 ** 52 + 1], dtype=torch.int64)
    want = [0, 0, 1, 2, 2, 3, 3, 4, 20, 21, 23]  # bit_length, the last clamped to M - 1 = 23
    assert A.time_buckets(dt, 24).tolist() == want
    assert [attention_cpu._bucket(int(x), 24) for x in dt] == want


@pytest.mark.parametrize("mix", sorted(LENGTH_MIXES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_time_bias_jagged_equals_padded_outputs_and_gradients(cpu_path, mix, dtype):
    """With the relative time bias (and the position bias): outputs and gradients of q, k, v and both bias tables."""
    lengths = LENGTH_MIXES[mix]
    q, k, v, dout, bias, offsets = _inputs(lengths, dtype=dtype)
    tbias = torch.randn(q.shape[1], 24, generator=torch.Generator().manual_seed(5), dtype=dtype)
    times = _times(lengths)
    jag = _run_time(lambda *a: A.hstu_attention(*a[:4], 128, 0.35, 1 / 64, *a[4:]), q, k, v, dout, bias, tbias,
                    times, offsets)
    pad = _run_time(lambda *a: A.padded_reference(*a[:4], 0.35, 1 / 64, *a[4:]), q, k, v, dout, bias, tbias, times,
                    offsets)
    assert _close(jag[0], pad[0], TOL[dtype])
    for name, a, b in zip(["q", "k", "v", "pos_bias", "time_bias"], jag[1], pad[1]):
        assert _close(a, b, TOL[dtype]), name
    if sum(lengths) > 3:
        assert float(pad[1][4].abs().sum()) > 0  # the time bias is read


def test_negative_control_a_time_bucket_off_by_one_is_caught(monkeypatch):
    """The reference with every bucket one lower (``floor(log2)`` instead of the bit length) differs from the exact
    loops: the comparison above would catch a bucket rule that differs between paths."""
    lengths = LENGTH_MIXES["one long among short"]
    q, k, v, dout, bias, offsets = _inputs(lengths)
    tbias = torch.randn(q.shape[1], 24, generator=torch.Generator().manual_seed(5))
    times = _times(lengths)
    monkeypatch.setattr(A, "EXACT_MAX_LEN", 10 ** 9)
    exact = A.hstu_attention(q, k, v, offsets, 128, 0.35, 1 / 64, bias, tbias, times)
    right = A.padded_reference(q, k, v, offsets, 0.35, 1 / 64, bias, tbias, times)
    assert _close(exact, right, 1e-5)
    real = A.time_buckets
    monkeypatch.setattr(A, "time_buckets", lambda dt, m: (real(dt, m) - 1).clamp(min=0))
    wrong = A.padded_reference(q, k, v, offsets, 0.35, 1 / 64, bias, tbias, times)
    assert not _close(exact, wrong, 1e-3)


def test_a_prefix_is_unchanged_when_tokens_are_appended_with_the_time_bias(cpu_path):
    q, k, v, _, bias, _ = _inputs([50])
    tbias = torch.randn(q.shape[1], 24, generator=torch.Generator().manual_seed(5))
    times = _times([50])
    full = A.hstu_attention(q, k, v, torch.tensor([0, 50]), 128, 0.35, 1 / 64, bias, tbias, times)
    prefix = A.hstu_attention(q[:30], k[:30], v[:30], torch.tensor([0, 30]), 128, 0.35, 1 / 64, bias, tbias,
                              times[:30])
    assert torch.equal(full[:30], prefix)
    # the bias depends on time differences only: every time shifted by one constant changes nothing
    shifted = A.hstu_attention(q, k, v, torch.tensor([0, 50]), 128, 0.35, 1 / 64, bias, tbias, times + 12345)
    assert torch.equal(full, shifted)


def test_time_bias_arguments_are_checked():
    q, k, v, _, bias, offsets = _inputs([3, 2])
    with pytest.raises(ValueError, match="together"):
        A.hstu_attention(q, k, v, offsets, 8, 0.35, 1 / 64, bias, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="int64"):
        A.hstu_attention(q, k, v, offsets, 8, 0.35, 1 / 64, bias, torch.zeros(2, 4), torch.zeros(5))
    with pytest.raises(ValueError, match=r"\[H=2, M >= 1\]"):
        A.hstu_attention(q, k, v, offsets, 8, 0.35, 1 / 64, bias, torch.zeros(3, 4), torch.zeros(5, dtype=torch.int64))


@pytest.mark.parametrize("relative_bias,time_bias", [(False, False), (True, False), (True, True)])
def test_hstu_model_jagged_equals_padded(cpu_path, relative_bias, time_bias):
    torch.manual_seed(0)
    cfg = HSTUConfig(num_layers=2, relative_bias=relative_bias, time_bias=time_bias)
    model = HSTU(cfg, 16, ["action", "item"], 32, 1000)
    with torch.no_grad():
        for layer in model.layers:
            for table in (layer.pos_bias, layer.time_bias):
                if table is not None:
                    table.normal_()
    lengths = torch.tensor([1, 5, 31, 0, 9])
    t = int(lengths.sum())
    g = torch.Generator().manual_seed(1)
    blocks, extra = sequential_table_widths(cfg)["item"]  # the default item rows: [input | output | from | to | bias]
    width = 16 * blocks + extra
    emb = {"item": torch.randn(t, width, generator=g), "action": torch.randn(t, 16, generator=g),
           "item#neg": torch.randn(40, width, generator=g)}
    feats = {"lengths": lengths, "item_ids": torch.randint(0, 1000, (t,), generator=g),
             "neg_ids": torch.randint(0, 1000, (40,), generator=g)}
    if time_bias:
        feats["times"] = _times(lengths.tolist(), seed=2) * 1000  # ms, as the shards hold them
    results = {}
    for attention in ("jagged", "padded"):
        m = copy.deepcopy(model)
        m.cfg = dataclasses.replace(cfg, attention=attention)
        e = {name: x.clone().requires_grad_(True) for name, x in emb.items()}
        loss = m(e, feats).sum()
        loss.backward()
        results[attention] = (loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None},
                              e["item"].grad)
    (lj, gj, ej), (lp, gp, ep) = results["jagged"], results["padded"]
    assert abs(float(lj - lp)) <= 1e-5 * abs(float(lp))
    assert set(gj) == set(gp) and (not relative_bias or any("pos_bias" in n for n in gj))
    assert not time_bias or any("time_bias" in n for n in gj)
    if time_bias:  # a model with the time bias refuses inputs without times
        with pytest.raises(ValueError, match="per-token times"):
            model({n: x.clone() for n, x in emb.items()}, {k: v for k, v in feats.items() if k != "times"})
    for name in gp:
        assert _close(gj[name], gp[name], 1e-5), name
    assert _close(ej, ep, 1e-5)



TRITON_CHECK = r"""
import json, sys
import numpy as np, torch
from nestpipe.kernels import attention as A, attention_triton as AT
mixes = json.loads(sys.argv[1])
worst = {}
for name, lengths in mixes.items():
    g = torch.Generator().manual_seed(0)
    t = int(sum(lengths))
    q, k, v, dout = (torch.randn(t, 2, 8, generator=g) for _ in range(4))
    bias = torch.randn(2, 16, generator=g) * 0.5
    offsets = torch.tensor([0] + list(np.cumsum(lengths, dtype=np.int64)), dtype=torch.int64)
    # the relative time bias too: times non-decreasing per sequence, gaps from 0 to 2**40 (past the last bucket)
    gr = np.random.default_rng(1)
    times = torch.from_numpy(np.concatenate([np.cumsum(gr.choice([0, 1, 3, 5000, 2 ** 40], size=L)) for L in lengths]
                                            ).astype(np.int64) if t else np.zeros(0, np.int64))
    tbias = torch.randn(2, 24, generator=g)
    for timed in (False, True):
        res = []
        extra = (tbias, times) if timed else ()
        for fn in (lambda *a: AT.hstu_attention(*a[:4], 128, 0.35, 1 / 64, a[4], *a[5:]),
                   lambda *a: A.padded_reference(*a[:4], 0.35, 1 / 64, a[4], *a[5:])):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v, bias) + extra[:1]]
            out = fn(leaves[0], leaves[1], leaves[2], offsets, *leaves[3:], *extra[1:])
            out.backward(dout)
            res.append([out.detach()] + [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves])
        errs = [float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30) if b.numel() else 0.0
                for a, b in zip(res[0], res[1])]
        worst[name + (" time bias" if timed else "")] = max(errs)
    # the negative control: a reference with an off-by-one causal bound (keys j <= i + 1 of the same sequence)
    outs = []
    for s_, L in enumerate(lengths):
        if L == 0:
            continue
        o = int(offsets[s_])
        z = torch.einsum("ihd,jhd->hij", q[o:o + L], k[o:o + L]) * 0.35
        rel = (torch.arange(L)[:, None] - torch.arange(L)[None, :]).clamp(0, 15)
        z = z + bias[:, rel]
        m = (torch.arange(L)[None, :] <= torch.arange(L)[:, None] + 1).float()
        outs.append(torch.einsum("hij,jhd->ihd", torch.nn.functional.silu(z) / 64 * m, v[o:o + L]))
    wrong = torch.cat(outs) if outs else torch.zeros(0, 2, 8)
    worst[name + " control"] = float((res[0][0] - wrong).abs().max()) if t else 0.0
print(json.dumps(worst))
"""


def test_triton_kernels_in_interpreter_mode_equal_the_padded_reference():
    import json
    import os
    import subprocess
    import sys

    mixes = {"one token each": [1, 1, 1], "all equal": [7, 7, 7], "one long among short": [1, 2, 40, 3],
             "empty micro-batch": [], "empty sequences": [0, 5, 0, 2]}
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK, json.dumps(mixes)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    worst = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in mixes:
        assert worst[name] <= 1e-5 and worst[name + " time bias"] <= 1e-5, (name, worst)
    # negative control: an off-by-one causal bound (one key past the diagonal) is far outside the tolerance
    assert worst["one long among short control"] > 1e-3, worst


def test_the_dense_probe_gives_a_time_bias_model_its_times(tmp_path):
    """``simulate --calibrate`` times the run's own model: with ``hstu.time_bias`` it must pass per-token times (the
    model refuses inputs without them, as the control in ``test_hstu_model_jagged_equals_padded`` shows)."""
    from shard_sets import make_shards

    from nestpipe.datasets.shards import load_manifest
    from nestpipe.measure.dense_probe import first_record, probe_call_seconds

    shards = str(tmp_path / "gr")
    make_shards(shards, "gr", batch_size=12, micro_batches=3, shards=(2,), eval_shards=(1,), vocab=300, seq_len=8,
                seed=5)
    cfg = {"model": "hstu", "shards": shards, "hstu": {"num_layers": 1, "time_bias": True}}
    out = probe_call_seconds(cfg, load_manifest(shards), first_record(shards), 3, reps=1)
    assert out["counts"] == [1, 3, 6] and all(v > 0 for v in out["batch_s"].values())
