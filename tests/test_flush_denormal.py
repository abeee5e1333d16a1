"""Subnormal floats are flushed to zero in a rank's threads (``TrainConfig.flush_denormal``, default on): the mode
set before the process group starts reaches threads started later, torch ops and the Numba kernels alike; and
``flush_denormal = False`` keeps subnormals (the negative control)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys, threading
import torch
from nestpipe.trainer.distributed.device import set_flush_denormal
import nestpipe.kernels as K

active = set_flush_denormal(sys.argv[1] == "1")
out = {"active": active}

def work():
    torch.set_num_threads(2)  # torch's intra-op pool starts here, after the setting
    big = torch.full((1 << 20,), 1e-39) * 2.0
    out["torch_big_nonzero"] = int((big != 0).sum())
    # torch: a subnormal input (DAZ) and a product that underflows into the subnormal range (FTZ)
    out["torch_input"] = float(torch.tensor([1e-39]) * 2.0)
    out["torch_result"] = float(torch.tensor([1e-30]) * torch.tensor([1e-9]))
    # the fused row-wise AdaGrad (Numba): a subnormal gradient; flushed, it is zero and the row does not move
    w, s = torch.zeros(4, 8), torch.zeros(4)
    K.adagrad_update(w, s, torch.tensor([1, 3]), torch.full((2, 8), 1e-39), lr=0.1)
    out["adagrad_row"] = float(w[1, 0])
    out["adagrad_moved"] = float(w.abs().max())

t = threading.Thread(target=work)  # started after the setting, as the pipeline's threads are
t.start()
t.join()
print(json.dumps(out))
"""


def _probe(enabled: bool):
    r = subprocess.run([sys.executable, "-c", PROBE, "1" if enabled else "0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="threads inherit the floating-point mode on Linux (POSIX)")
def test_flush_denormal_reaches_threads_started_later_and_the_kernels():
    on = _probe(True)
    if not on["active"]:
        pytest.skip("this CPU has no flush-to-zero mode")
    assert on["torch_input"] == 0.0 and on["torch_result"] == 0.0 and on["torch_big_nonzero"] == 0
    assert on["adagrad_row"] == 0.0 and on["adagrad_moved"] == 0.0
    # negative control: without the mode the same work keeps the subnormals, and the row moves
    off = _probe(False)
    assert off["active"] is False
    assert off["torch_input"] == pytest.approx(2e-39, rel=1e-3) and 0 < off["torch_result"] < 1.2e-38
    assert off["adagrad_row"] < 0.0 and off["torch_big_nonzero"] == 1 << 20
