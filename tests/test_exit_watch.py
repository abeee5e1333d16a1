"""trainer/launch.ExitWatch: a rank that is still there timeout_s after the run wrote its final metrics.json (stopped
after the last collective: no peer waits for it, so no timeout fires and torchrun would wait forever) is killed and
named; before the end, nothing is touched."""

import json
import os
import signal
import subprocess
import sys
import time

from nestpipe.trainer.launch import ExitWatch


def _rank(rank):
    # a stand-in rank process: its command line carries --worker-run, its environment RANK
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--worker-run", "x"],
                            env=dict(os.environ, RANK=str(rank)))


def test_a_rank_stopped_after_the_end_is_killed_and_named(tmp_path, capsys):
    stuck = _rank(1)
    stuck.send_signal(signal.SIGSTOP)
    watch = ExitWatch(str(tmp_path), timeout_s=0.5, poll_s=0.05)
    try:
        time.sleep(1.0)
        assert stuck.poll() is None and watch.killed == []  # control: no end yet, nothing touched
        (tmp_path / "metrics.json").write_text(json.dumps({"final_loss": 1.0}))
        deadline = time.time() + 10
        while stuck.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert stuck.returncode == -signal.SIGKILL and watch.killed == [1]
        assert "rank 1 did not exit within 0 s (stopped or hung): killed" in capsys.readouterr().err
    finally:
        watch.stop()
        if stuck.poll() is None:
            stuck.kill()
            stuck.wait()


def test_a_metrics_file_from_an_earlier_launch_is_not_the_end(tmp_path):
    (tmp_path / "metrics.json").write_text("{}")
    os.utime(tmp_path / "metrics.json", (time.time() - 100, time.time() - 100))
    rank = _rank(0)
    watch = ExitWatch(str(tmp_path), timeout_s=0.2, poll_s=0.05)
    try:
        time.sleep(0.8)
        assert rank.poll() is None and watch.killed == []
    finally:
        watch.stop()
        rank.kill()
        rank.wait()
