"""--pipeline auto's rule (nestpipe.trainer.pipeline.auto.decide): a pure function of the reduced measurements."""

from __future__ import annotations

import os

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


@pytest.mark.parametrize("device,world,cores,gbps", [("cpu", 2, 4, None), ("cpu", 2, 1, 0.03), ("cpu", 1, 8, None)])
def test_decide_keeps_parallel_kernels_on_one_thread(device, world, cores, gbps):
    """threads > 1 selects the parallel Numba kernels, unsafe from several pipeline threads: auto chooses off where it
    would otherwise choose nested (negative control: the same measurements with one thread choose nested)."""
    schedule, reason, pays = auto.decide(device, world, cores, gbps, intra_op_threads=2)
    assert schedule == "off" and not pays and "threads = 2" in reason
    if world > 1:
        assert auto.decide(device, world, cores, gbps, intra_op_threads=1)[0] == "nested"
    assert auto.decide("cuda", world, cores, gbps, intra_op_threads=2)[0] == "nested"  # no Numba kernels there


def test_threads_above_one_are_refused_with_pipelined_schedules():
    import torch

    from nestpipe.trainer.config import TrainConfig, validate

    for mode in ("dbp", "fwp", "nested"):
        with pytest.raises(ValueError, match=f"threads = 2 with pipeline = {mode}"):
            validate(TrainConfig(pipeline=mode, threads=2))
        with pytest.raises(ValueError, match="several pipeline threads"):
            auto.choose(mode, torch.device("cpu"), 1, intra_op_threads=2)
    for mode in ("off", "auto"):
        validate(TrainConfig(pipeline=mode, threads=2))
        assert auto.choose(mode, torch.device("cpu"), 1, intra_op_threads=2).schedule == "off"
    validate(TrainConfig(pipeline="nested", threads=1))


def test_explicit_schedule_is_kept_and_unknown_refused():
    import torch

    ch = auto.choose("fwp", torch.device("cpu"), 1)
    assert ch.schedule == "fwp" and ch.requested == "fwp"
    assert ch.reason.startswith("--pipeline fwp (explicit); auto would choose off")
    assert auto.choose("auto", torch.device("cpu"), 1).schedule == "off"
    with pytest.raises(ValueError, match="expected auto or one of"):
        auto.choose("fast", torch.device("cpu"), 1)


@pytest.mark.parametrize("requested,schedule,invariant,expect", [
    ("auto", "off", True, "whole"),          # no frozen window: micro-batches would only add passes
    ("auto", "dbp", True, "whole"),
    ("auto", "fwp", True, "clustered"),      # the frozen window overlaps micro-batch i+1's All2All with i's compute
    ("auto", "nested", True, "clustered"),
    ("auto", "off", False, "clustered"),     # in-batch negatives: the partition is part of the loss
    ("clustered", "off", True, "clustered"),  # anything explicit is kept
    ("whole", "nested", False, "whole"),
    ("random", "off", True, "random"),
])
def test_micro_batching_follows_the_schedule(requested, schedule, invariant, expect):
    assert auto.micro_batching_for(requested, schedule, invariant) == expect


def test_model_specs_say_whether_their_loss_depends_on_the_partition():
    import torch

    from nestpipe.trainer.config import default_config, TrainConfig
    from nestpipe.trainer.models import model_spec

    for model, field in (("hstu", "hstu"), ("sasrec", "sasrec")):
        d = default_config(model)
        assert not model_spec(model).partition_invariant(TrainConfig.from_dict(d))  # in-batch negatives by default
        d[field]["in_batch_negatives"] = 0
        assert model_spec(model).partition_invariant(TrainConfig.from_dict(d))
    assert model_spec("dlrm").partition_invariant(TrainConfig.from_dict(default_config("dlrm")))
    ch = auto.choose("off", torch.device("cpu"), 1, micro_batching="auto", partition_invariant=True)
    assert (ch.schedule, ch.micro_batching) == ("off", "whole")


def test_a_launch_gives_the_ranks_the_configs_intra_op_threads(tmp_path, monkeypatch):
    """The ranks' OpenMP and Numba pools get ``threads`` (a user's own setting wins); negative control: a run of one
    thread gets 1."""
    from nestpipe.measure.launcher import write_run
    from nestpipe.trainer import launch

    seen = {}
    monkeypatch.setattr(launch, "_launch", lambda args, run: seen.update(
        {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}) or 0)
    for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    for threads in (2, 1):
        run = write_run(str(tmp_path / f"t{threads}"), str(tmp_path), "dlrm", "off", 1, {"threads": threads})
        assert launch.launch_training(run, 2, False) == 0
        assert seen == {"OMP_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads)}, seen
        assert "OMP_NUM_THREADS" not in os.environ  # restored after the launch
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch.launch_training(run, 2, False) == 0 and seen["NUMBA_NUM_THREADS"] == "3"
