"""benchmarks/chaos.py runs a few trials (the full campaign is a benchmark): seeded faults in the ingest's input,
each with its verdict; and the harness catches what it is there to catch."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import chaos  # noqa: E402


def test_faults_are_drawn_from_the_seed(tmp_path):
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "log_a.csv").write_bytes(b"h1,h2\n1,2\n3,4\n5,6\n")
    (clean / "user_features_27k.csv").write_bytes(b"u\n1\n")
    a = chaos.fuzz(str(clean), str(tmp_path / "a"), "extra_column", 7)
    b = chaos.fuzz(str(clean), str(tmp_path / "b"), "extra_column", 7)
    assert a == b and (tmp_path / "a" / a["file"]).read_bytes() == (tmp_path / "b" / b["file"]).read_bytes()
    lines = (tmp_path / "a" / "log_a.csv").read_bytes().split(b"\n")
    assert lines[a["line"] - 1].endswith(b",extra")
    d = chaos.fuzz(str(clean), str(tmp_path / "d"), "drop_line", 7)
    assert (tmp_path / "d" / "log_a.csv").read_bytes().count(b"\n") == 3 and d["line"] >= 2


def test_a_process_that_outlives_its_driver_is_reported():
    """The "no process left behind" verdict can fail: a driver that starts a child and exits without it leaves the
    child adopted by init, and the watch that saw it while the driver ran reports (and kills) it. Control: a child
    the driver waits for is not reported."""
    orphan = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])"
    r = chaos.run_tracked([sys.executable, "-c", orphan + "; import time; time.sleep(0.5)"], grace=1.0)
    assert r["rc"] == 0 and len(r["left_behind"]) == 1
    waited = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(0.5)'])"
    assert chaos.run_tracked([sys.executable, "-c", waited], grace=1.0)["left_behind"] == []


@pytest.mark.slow
def test_a_few_trials_hold(tmp_path, capsys, monkeypatch):
    """One trial of each line-level class and a truncation: every verdict holds (the ingest rejects the bad line by
    file and line, reads exactly the lines added or removed, writes the same bytes twice, leaves no process).
    Control: the accounting would catch a reject that is not there (a line-level fault on a line that is fine)."""
    res = chaos.campaign(str(tmp_path), ("latin1_line", "extra_column", "drop_line", "truncate"), 1, seed=3)
    bad = [t for t in res["trials"] if not t["ok"]]
    assert not bad, bad
    assert all(s["trials"] == 1 for s in res["summary"].values())
    extra = next(t for t in res["trials"] if t["class"] == "extra_column")
    assert extra["rejected"] >= 1 and extra["accounted"] is True
    # control: demanding a reject for a dropped line (there is none to find) fails the accounting
    monkeypatch.setattr(chaos, "MUST_REJECT", chaos.MUST_REJECT + ("drop_line",))
    v = chaos.trial(str(tmp_path), os.path.join(str(tmp_path), "clean-raw"), res["clean_input_rows"], "drop_line", 3000)
    assert v["accounted"] is False and not v["ok"]
