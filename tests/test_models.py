"""The sequential models' encoders (hstu, sasrec): causal (a token's state never depends on later tokens) and
independent of the other samples of the micro-batch (padding to the longest sample changes nothing); both share
the objective (``next_item_loss``). Negative control: without the causal mask a later token changes earlier
states."""

from __future__ import annotations

import pytest
import torch

from nestpipe.trainer.models.common import init_parameters
from nestpipe.trainer.models.hstu import HSTU, HSTUConfig
from nestpipe.trainer.models.sasrec import SASRec, SASRecConfig

D, L = 16, 12


def _model(name):
    m = (HSTU(HSTUConfig(num_layers=2, num_heads=2, linear_dim=8), D, ["action", "item"], L) if name == "hstu"
         else SASRec(SASRecConfig(num_layers=2, num_heads=2), D, ["action", "item"], L))
    init_parameters(m, torch.Generator().manual_seed(0))
    with torch.no_grad():
        m.pos.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    return m.double()


def _emb(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    n = int(sum(lengths))
    return {"item": torch.randn(n, D, generator=g, dtype=torch.float64),
            "action": torch.randn(n, D, generator=g, dtype=torch.float64)}


@pytest.mark.parametrize("name", ["hstu", "sasrec"])
def test_encoder_is_causal_and_per_sample(name):
    m = _model(name)
    lengths = torch.tensor([5, 9, 3])
    emb = _emb(lengths.tolist(), 2)
    h = m.encode(emb, lengths)
    # alone in its micro-batch (no padding to 9), sample 0 gets the same states
    alone = m.encode({k: v[:5] for k, v in emb.items()}, lengths[:1])
    torch.testing.assert_close(alone, h[:5], rtol=1e-12, atol=1e-12)
    # a changed later token (sample 1, position 6) leaves positions 0..5 of sample 1 unchanged
    emb2 = {k: v.clone() for k, v in emb.items()}
    emb2["item"][5 + 6] += torch.linspace(-1, 1, D, dtype=torch.float64)  # not a constant shift (LayerNorm removes those)
    h2 = m.encode(emb2, lengths)
    torch.testing.assert_close(h2[5:5 + 6], h[5:5 + 6], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(h2[5 + 6], h[5 + 6])


def test_negative_control_sasrec_without_causal_mask_sees_the_future(monkeypatch):
    m = _model("sasrec")
    monkeypatch.setattr(torch, "tril", lambda x: torch.ones_like(x))  # every key visible
    lengths = torch.tensor([9])
    emb = _emb([9], 3)
    emb2 = {k: v.clone() for k, v in emb.items()}
    emb2["item"][6] += torch.linspace(-1, 1, D, dtype=torch.float64)
    assert not torch.allclose(m.encode(emb2, lengths)[:6], m.encode(emb, lengths)[:6])
