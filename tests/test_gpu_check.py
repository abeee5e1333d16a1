"""benchmarks/gpu_check.py without a GPU: its "no CUDA device" path, its argument handling, the overlap measure it
reads from a torch.profiler trace, and (slow) the very training commands it launches, run on CPU with the profile
and gloo options it sets."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_check  # noqa: E402
from nestpipe.trainer.step_profiler import classify, overlap_share  # noqa: E402


def test_without_cuda_it_says_so_and_exits_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_check, "has_cuda", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not os.listdir(tmp_path)  # nothing trained, nothing written


def test_arguments_are_checked():
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--steps", "4"])  # 2 warm-up + 4 profiled steps do not fit
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--models", "nope"])
    a = gpu_check.parse_args([])
    assert a.models == ["hstu", "dlrm"] and a.worlds == [1, 2] and a.steps >= 2 + a.profile_steps


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_overlap_share_of_copies_and_exchanges_under_compute():
    kernel = _x("kernel", "ampere_sgemm_128x64", 0, 100)
    overlapped = {"traceEvents": [kernel, _x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 10, 20),
                                  _x("kernel", "ncclDevKernel_AllToAll", 50, 30)]}
    assert overlap_share(overlapped)["share"] == 1.0
    # control: the same copy and collective after the compute overlap nothing
    serial = {"traceEvents": [kernel, _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 100, 20),
                              _x("kernel", "ncclDevKernel_AllToAll", 130, 30)]}
    assert overlap_share(serial)["share"] == 0.0
    half = {"traceEvents": [kernel, _x("cpu_op", "gloo:all_to_all", 80, 40)]}
    r = overlap_share(half)
    assert r["share"] == pytest.approx(0.5) and r["exchange_us"] == 40 and r["copy_us"] == 0
    assert classify(_x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 1)) is None  # not a host-to-device copy
    assert classify({"ph": "i", "cat": "kernel", "name": "k"}) is None
    assert overlap_share({"traceEvents": [kernel]})["share"] != overlap_share({"traceEvents": [kernel]})["share"]


@pytest.mark.slow
def test_its_training_commands_run_on_cpu_with_the_profile_and_gloo(tmp_path):
    """The commands gpu_check launches, with the device switched to cpu: the options it sets (dist_backend,
    pipe.profile_steps) are accepted, rank 0 writes the profile, off and nested agree within the check's bound
    (bitwise on CPU), and the device-kernel check reports the CPU paths as not on the device (its control)."""
    import subprocess

    from shard_sets import make_shards
    from nestpipe.trainer.step_profiler import read_overlap

    shards = str(tmp_path / "gr")
    make_shards(shards, "gr", batch_size=12, micro_batches=2, shards=(8, 8), eval_shards=(1,), vocab=300, seq_len=10,
                seed=1)
    runs = {}
    for mode in ("off", "nested"):
        cmd = gpu_check.train_command(str(tmp_path), shards, "hstu", mode, 2, 5, 2, gloo=True)
        cmd[cmd.index("--device") + 1] = "cpu"
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        runs[mode] = cmd[cmd.index("--out") + 1]
        cfg = json.load(open(os.path.join(runs[mode], "config.json")))
        assert cfg["dist_backend"] == "gloo" and cfg["pipe"]["profile_steps"] == 2
        prof = os.path.join(runs[mode], "profile-rank0.json")
        assert os.path.exists(prof) and not os.path.exists(os.path.join(runs[mode], "profile-rank1.json"))
        ov = read_overlap(prof)
        assert ov["exchange_us"] > 0 and ov["compute_us"] == 0  # gloo's calls recorded; no device kernels on CPU
    ag = gpu_check.agreement(runs["off"], runs["nested"])
    assert ag["ok"] and ag["max_abs_diff"] == 0.0
    paths = gpu_check.device_paths(runs["nested"])
    assert not paths["ok"] and set(paths["not_on_device"]) <= set(gpu_check.DEVICE_OPS)
    assert all("triton" not in p for p in paths["not_on_device"].values())
    # the names are those the kernels record: every device op ran here (the CPU's bag update replaces the entry
    # update), so a device run that skipped one would be reported
    assert paths["not_taken"] == ["adagrad_update"] and "adagrad_bags" in paths["kernel_paths"]
    assert "dual_buffer_sync_rows" not in gpu_check.device_paths(runs["off"], "off")["not_taken"] + \
        list(gpu_check.device_paths(runs["off"], "off")["kernel_paths"])
