"""Progress output off a terminal: plain lines, rate-limited, no carriage returns (batch-job logs stay readable)."""

import io
import subprocess
import sys

from nestpipe.utils.progress import LineProgress, progress


def test_not_a_terminal_gives_rate_limited_plain_lines():
    out = io.StringIO()  # not a terminal
    bar = progress(100, "train", "step", file=out, interval=3600)
    assert isinstance(bar, LineProgress)
    for _ in range(100):
        bar.set_postfix(loss="0.5")
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("train: 100/100 step") and "loss=0.5" in lines[0], lines
    every = io.StringIO()
    bar = LineProgress(10, "x", "it", every, interval=0.0)  # interval 0: a line per update, then the final one
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert len(every.getvalue().splitlines()) == 4 and "\r" not in every.getvalue()


def test_through_a_pipe_no_carriage_returns():
    """synth writes its progress to a pipe: plain lines only (negative control: tqdm itself, told to draw on the
    same pipe, writes carriage returns)."""
    p = subprocess.run([sys.executable, "-c", "from nestpipe.datasets.synth import generate; import tempfile; "
                        "generate(tempfile.mkdtemp(), scale='tiny', seed=0)"], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert b"\r" not in p.stderr and b"synth:" in p.stderr, p.stderr[-500:]  # bytes: text mode would hide \r
    q = subprocess.run([sys.executable, "-c", "from tqdm import tqdm\nfor _ in tqdm(range(3), mininterval=0): pass"],
                       capture_output=True, timeout=60)
    assert b"\r" in q.stderr
