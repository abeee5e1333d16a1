"""The Criteo-style example runs and its clustering beats the random partition."""

import re
import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "criteo_style_clustering.py"


def test_criteo_style_example(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    found = dict(re.findall(r"(\w+): redundancy [\d.]+ \(rows\), ([\d.]+) \(bytes\)", out))
    assert set(found) == {"random", "default", "kmeans"}
    assert float(found["default"]) < float(found["random"]) - 0.3
    assert "history table" in out
