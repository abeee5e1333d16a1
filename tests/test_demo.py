"""The quick start's main job runs end to end (training itself is covered by tests/test_trainer_learning.py)."""

import re
import subprocess
import sys


def test_demo_generates_ingests_and_reports(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "nestpipe", "demo", "--scale", "tiny", "--out", str(out),
                        "--workers", "1", "--skip-training"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("shards verified: OK") == 2
    assert (out / "shards-gr" / "manifest.json").exists() and (out / "shards-ctr" / "manifest.json").exists()
    # the closing line says where the time went, stage by stage
    assert re.search(r"done in [0-9.]+ s \(synth [0-9.]+ s, ingest gr [0-9.]+ s, ingest ctr [0-9.]+ s\)", r.stderr)
