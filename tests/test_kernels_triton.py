"""The Triton (CUDA) kernels against the torch references, run on CPU tensors in Triton's interpreter.

On a machine with a GPU the same tests also run on CUDA tensors. Shapes are tiny: the interpreter is slow.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere in this process

import pytest
import torch

from nestpipe import kernels
from nestpipe.kernels import reference

from nestpipe.kernels import triton_kernels  # noqa: E402  (fails, not skips, when triton is missing)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def setup_module():
    assert kernels.select_path("adagrad_update", "cuda") == "triton", "triton is not installed"
    assert triton_kernels.INTERPRETED or torch.cuda.is_available(), "neither the Triton interpreter nor a GPU is active"


def _on(device, *tensors):
    return [t.to(device).clone() for t in tensors]  # a copy even on cpu, so inputs stay pristine


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [3, 16, 20])
def test_gather(device, dim):
    w = torch.randn(40, dim)
    for rows in (torch.randint(0, 40, (37,)), torch.full((5,), 39), torch.zeros(0, dtype=torch.int64)):
        w_d, rows_d = _on(device, w, rows)
        assert torch.equal(triton_kernels.gather_rows(w_d, rows_d).cpu(), reference.gather_rows(w, rows))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim,n,momentum", [(16, 20, 1.0), (5, 33, 4.0), (8, 0, 1.0)])
def test_adagrad(device, dim, n, momentum):
    w, s = torch.randn(50, dim), torch.rand(50)
    rows, grads = torch.randperm(50)[:n], torch.randn(n, dim) * 2
    w_ref, s_ref = w.clone(), s.clone()
    reference.adagrad_update(w_ref, s_ref, rows, grads, 0.05, 1e-8, momentum)
    w_d, s_d, rows_d, grads_d = _on(device, w, s, rows, grads)
    triton_kernels.adagrad_update(w_d, s_d, rows_d, grads_d, 0.05, 1e-8, momentum)
    torch.testing.assert_close(s_d.cpu(), s_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w_d.cpu(), w_ref, atol=1e-6, rtol=1e-6)
    if n:
        assert not torch.equal(w_d.cpu(), w)  # negative control: the kernel really wrote the store


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "keys",
    [
        (torch.tensor([1, 4, 6, 9, 12, 30]), torch.tensor([0, 4, 5, 9, 30, 31, 40])),
        (torch.arange(0, 20, 2), torch.arange(1, 20, 2)),
        (torch.arange(17), torch.arange(17)),
        (torch.tensor([I64_MIN, -1, 0, I64_MAX]), torch.tensor([I64_MIN, 5, I64_MAX])),
        (torch.zeros(0, dtype=torch.int64), torch.arange(3)),
    ],
)
def test_dual_buffer_sync(device, keys):
    a_keys, p_keys = keys
    active, prefetch = torch.randn(a_keys.numel(), 5), torch.randn(p_keys.numel(), 5)
    expect = prefetch.clone()
    reference.dual_buffer_sync(a_keys, active, p_keys, expect)
    a_keys_d, active_d, p_keys_d, prefetch_d = _on(device, a_keys, active, p_keys, prefetch)
    triton_kernels.dual_buffer_sync(a_keys_d, active_d, p_keys_d, prefetch_d)
    assert torch.equal(prefetch_d.cpu(), expect)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_state", [True, False])
def test_dual_buffer_sync_rows_equals_the_reference(device, with_state):
    """The trainer's sync of weights and AdaGrad state (what DBP calls on a device): the same rows copied, bitwise,
    and the same count. Control: a prefetch buffer left unsynced differs from the reference's."""
    a_keys, p_keys = torch.tensor([1, 4, 6, 9, 12, 30]), torch.tensor([0, 4, 5, 9, 30, 31, 40])
    aw, as_ = torch.randn(6, 7), torch.rand(6)
    pw, ps = torch.randn(7, 7), torch.rand(7)
    ew, es = pw.clone(), ps.clone()
    n_ref = reference.dual_buffer_sync_rows(a_keys, p_keys, aw, as_ if with_state else None, ew,
                                            es if with_state else None, False)
    args = _on(device, a_keys, p_keys, aw, as_, pw, ps)
    n = triton_kernels.dual_buffer_sync_rows(args[0], args[1], args[2], args[3] if with_state else None, args[4],
                                             args[5] if with_state else None)
    assert n == n_ref == 3
    assert torch.equal(args[4].cpu(), ew) and not torch.equal(pw, ew)
    assert torch.equal(args[5].cpu(), es if with_state else ps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_rows,n,dim", [(6, 40, 3), (1, 25, 16), (5, 0, 4)])
def test_lookup_segment_sums(device, num_rows, n, dim):
    rows = torch.randn(num_rows, dim)
    inverse = torch.randint(0, num_rows, (n,))
    offsets = torch.tensor([0, n // 3, n // 3, n])  # includes an empty bag
    grad_tok = torch.randn(n, dim)
    grad_bag = torch.randn(3, dim)
    rows_d, inv_d, off_d, gt_d, gb_d = _on(device, rows, inverse, offsets, grad_tok, grad_bag)
    # pooled forward: bags are contiguous segments of tokens
    pooled = triton_kernels.segment_sum_rows(rows_d, inv_d, off_d).cpu()
    assert torch.equal(pooled, reference.pooled_lookup(rows, inverse, offsets))  # same serial order: bitwise
    # sequence backward
    order, row_offsets = triton_kernels.csr_by_segment(inv_d, num_rows)
    assert torch.equal(triton_kernels.segment_sum_rows(gt_d, order, row_offsets).cpu(), reference.sequence_lookup_backward(grad_tok, inverse, num_rows))
    # pooled backward
    src_index = reference.bag_of_token(off_d)[order]
    got = triton_kernels.segment_sum_rows(gb_d, src_index, row_offsets).cpu()
    assert torch.equal(got, reference.pooled_lookup_backward(grad_bag, inverse, offsets, num_rows))


@pytest.mark.parametrize("device", DEVICES)
def test_public_api_dispatches_to_triton(device, monkeypatch):
    """The public ops routed through the Triton path (on CPU tensors: the dispatch rule forced to 'triton')."""
    import nestpipe.kernels as package

    if device == "cpu":
        monkeypatch.setattr(package, "select_path", lambda op, dev: "triton")
    calls = []
    real = triton_kernels.segment_sum_rows
    monkeypatch.setattr(triton_kernels, "segment_sum_rows", lambda *a: calls.append(1) or real(*a))
    rows = torch.randn(10, 8, device=device, requires_grad=True)
    inverse = torch.randint(0, 10, (30,), device=device)
    offsets = torch.tensor([0, 10, 30], device=device)
    (kernels.sequence_lookup(rows, inverse).sum() + kernels.pooled_lookup(rows, inverse, offsets).sum()).backward()
    assert len(calls) == 3  # pooled forward, both backwards
    expect = reference.sequence_lookup_backward(torch.ones(30, 8), inverse.cpu(), 10) * 2
    assert torch.equal(rows.grad.cpu(), expect)
    w, s = torch.randn(10, 8, device=device), torch.rand(10, device=device)
    w_ref, s_ref = w.cpu().clone(), s.cpu().clone()
    g = torch.randn(3, 8, device=device)
    kernels.adagrad_update(w, s, torch.tensor([1, 5, 7], device=device), g, 0.1)
    reference.adagrad_update(w_ref, s_ref, torch.tensor([1, 5, 7]), g.cpu(), 0.1, 1e-8)
    torch.testing.assert_close(w.cpu(), w_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(kernels.gather_rows(w, torch.tensor([7, 1], device=device)).cpu(), w.cpu()[[7, 1]])
