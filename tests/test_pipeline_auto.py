"""--pipeline auto's rule (nestpipe.trainer.pipeline.auto.decide): a pure function of the reduced measurements."""

from __future__ import annotations

import pytest

from nestpipe.trainer.pipeline import auto


@pytest.mark.parametrize("device,world,cores,gbps,expect", [
    ("cuda", 8, 1, None, "nested"),        # accelerator streams
    ("npu", 2, 1, 50.0, "nested"),
    ("cpu", 1, 16, None, "off"),           # one rank: nothing to overlap
    ("cpu", 2, 4, None, "nested"),         # cores of their own for the pipeline's threads
    ("cpu", 2, 2, 100.0, "nested"),
    ("cpu", 2, 1, 0.03, "nested"),         # one core, slow link: wire time to hide
    ("cpu", 2, 1, 5.0, "off"),             # one core, fast link: overlap cannot pay
    ("cpu", 4, 1, auto.LINK_BOUND_GBPS, "off"),  # the threshold itself is not slow
])
def test_decide(device, world, cores, gbps, expect):
    schedule, reason, pays = auto.decide(device, world, cores, gbps)
    assert schedule == expect and reason
    assert pays == (expect == "nested")
    if expect == "off" and world > 1:
        assert "overlap cannot pay" in reason


def test_explicit_schedule_is_kept_and_unknown_refused():
    import torch

    ch = auto.choose("fwp", torch.device("cpu"), 1)
    assert ch.schedule == "fwp" and ch.requested == "fwp"
    assert ch.reason.startswith("--pipeline fwp (explicit); auto would choose off")
    assert auto.choose("auto", torch.device("cpu"), 1).schedule == "off"
    with pytest.raises(ValueError, match="expected auto or one of"):
        auto.choose("fast", torch.device("cpu"), 1)
