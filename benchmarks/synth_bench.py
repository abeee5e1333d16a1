"""Wall time and peak RSS of `nestpipe synth` at one or more scales (each run in its own subprocess).

    python benchmarks/synth_bench.py --scale medium 27k [--interactions N] [--keep DIR]

Prints one line per scale: rows written, seconds, rows/s, peak RSS of the child process, MiB written; writes the
record ``benchmarks/results/synth.json`` (``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from nestpipe.datasets.synth import SynthConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import Recorder  # noqa: E402


def run(scale: str, interactions: int | None, out: str) -> dict:
    # The generator alone (not the `nestpipe` entry point, whose start-up imports every component's CLI).
    code = (
        "import sys; from nestpipe.datasets import synth; "
        "synth.generate(sys.argv[1], scale=sys.argv[2], interactions=None if sys.argv[3] == '-' else int(sys.argv[3]), "
        "progress=False)"
    )
    cmd = [sys.executable, "-c", code, out, scale, "-" if interactions is None else str(interactions)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    cfg = SynthConfig.for_scale(scale, interactions=interactions)
    return {
        "scale": scale, "log_rows": cfg.interactions, "video_rows": cfg.num_videos, "seconds": seconds,
        "peak_rss_mib": max(peak_kib, before) / 1024, "written_mib": size / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", nargs="+", default=["medium"], choices=["tiny", "small", "medium", "27k"])
    ap.add_argument("--interactions", type=int, default=None)
    ap.add_argument("--keep", default=None, help="write into DIR/<scale> and keep the files")
    args = ap.parse_args()
    rec = Recorder("synth", script=__file__)
    rows = []
    for scale in args.scale:
        base = args.keep or tempfile.mkdtemp(prefix="synth-bench-")
        out = os.path.join(base, scale)
        shutil.rmtree(out, ignore_errors=True)
        try:
            r = run(scale, args.interactions, out)
        finally:
            if not args.keep:
                shutil.rmtree(base, ignore_errors=True)
        print(
            f"synth {r['scale']:>6}: {r['log_rows']:>11,} log rows + {r['video_rows']:>11,} video rows in "
            f"{r['seconds']:7.1f} s ({r['log_rows'] / r['seconds']:,.0f} log rows/s), peak RSS "
            f"{r['peak_rss_mib']:,.0f} MiB, {r['written_mib']:,.0f} MiB written",
            flush=True,
        )
        rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
    rec.write({"scales": rows})


if __name__ == "__main__":
    main()
