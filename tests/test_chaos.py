"""benchmarks/chaos.py runs a few trials (the full campaign is a benchmark): seeded faults in the ingest's input and
its process, each with its verdict; and the harness catches what it is there to catch."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import chaos  # noqa: E402
import chaos_ingest  # noqa: E402
import chaos_proc  # noqa: E402


def test_faults_are_drawn_from_the_seed(tmp_path):
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "log_a.csv").write_bytes(b"h1,h2\n1,2\n3,4\n5,6\n")
    (clean / "user_features_27k.csv").write_bytes(b"u\n1\n")
    a = chaos_ingest.fuzz(str(clean), str(tmp_path / "a"), "extra_column", 7)
    b = chaos_ingest.fuzz(str(clean), str(tmp_path / "b"), "extra_column", 7)
    assert a == b and (tmp_path / "a" / a["file"]).read_bytes() == (tmp_path / "b" / b["file"]).read_bytes()
    lines = (tmp_path / "a" / "log_a.csv").read_bytes().split(b"\n")
    assert lines[a["line"] - 1].endswith(b",extra")
    d = chaos_ingest.fuzz(str(clean), str(tmp_path / "d"), "drop_line", 7)
    assert (tmp_path / "d" / "log_a.csv").read_bytes().count(b"\n") == 3 and d["line"] >= 2


def test_a_process_that_outlives_its_driver_is_reported():
    """The "no process left behind" verdict can fail: a driver that starts a child and exits without it leaves the
    child adopted by init, and the watch that saw it while the driver ran reports (and kills) it. Control: a child
    the driver waits for is not reported."""
    orphan = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])"
    r = chaos_proc.run_tracked([sys.executable, "-c", orphan + "; import time; time.sleep(0.5)"], grace=1.0)
    assert r["rc"] == 0 and len(r["left_behind"]) == 1
    waited = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(0.5)'])"
    assert chaos_proc.run_tracked([sys.executable, "-c", waited], grace=1.0)["left_behind"] == []


def test_the_one_message_verdict():
    """A failed run's message passes when its last line names the file and no traceback was printed; a command's
    summary (nestpipe train: error: ..., with indented lines under it) may stand below the ranks' tracebacks."""
    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1\nOSError: [Errno 30] Read-only: '/o/_work'\n"
    assert not chaos_proc.one_message(tb, ["/o"])["ok"]  # a traceback as the only message
    assert chaos_proc.one_message("nestpipe ingest: error: [Errno 30] Read-only: '/o/_work'\n", ["/o"])["ok"]
    assert not chaos_proc.one_message("nestpipe ingest: error: something\n", ["/o"])["ok"]  # names nothing
    summary = tb + "nestpipe train: error: 1 shard problem(s):\n  /s/train-000000.tar: shard is corrupt\n"
    assert chaos_proc.one_message(summary, ["train-000000.tar"], "nestpipe train")["ok"]
    assert not chaos_proc.one_message(tb, ["train-000000.tar"], "nestpipe train")["ok"]  # no summary line


@pytest.mark.slow
def test_a_few_trials_hold(tmp_path, capsys, monkeypatch):
    """One trial of two line-level classes, a driver killed mid-run and an output that cannot be written: every verdict holds (the ingest rejects the bad line by file and line, reads exactly the lines added or
    removed, writes the same bytes twice, resumes to the clean run's shards, fails in one message naming the path,
    leaves no process). Control: the accounting would catch a reject that is not there (a line-level fault on a
    line that is fine)."""
    classes = ("latin1_line", "extra_column", "kill_driver", "unwritable_output")  # drop_line: the control below
    # the kill early in the run (a drawn moment late in a run that went faster than the clean one would miss it)
    monkeypatch.setattr(chaos_ingest, "KILL_WINDOW", (0.2, 0.3))
    res = chaos.campaign(str(tmp_path), classes, 1, seed=3)
    bad = [t for t in res["trials"] if not t["ok"]]
    assert not bad, bad
    assert all(s["trials"] == 1 for s in res["summary"].values())
    extra = next(t for t in res["trials"] if t["class"] == "extra_column")
    assert extra["rejected"] >= 1 and extra["accounted"] is True
    killed = next(t for t in res["trials"] if t["class"] == "kill_driver")
    assert killed["fault"]["killed"] == "driver" and killed["rc"] == -9 and killed["deterministic"] is True
    # control: demanding a reject for a dropped line (there is none to find) fails the accounting
    monkeypatch.setattr(chaos_ingest, "MUST_REJECT", chaos_ingest.MUST_REJECT + ("drop_line",))
    v = chaos_ingest.trial(str(tmp_path), os.path.join(str(tmp_path), "clean-raw"), res["clean_input_rows"],
                           "drop_line", 3000)
    assert v["accounted"] is False and not v["ok"]
