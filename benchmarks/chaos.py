"""Faults on purpose: seeded, randomised trials with a verdict each, printed as a table and recorded.

    python benchmarks/chaos.py [--trials-per-class 20] [--classes CLASS ...] [--seed 0] [--out /tmp/nestpipe-chaos]

Fault classes so far: ingest input fuzz on the synthetic KuaiRand logs (``nestpipe synth --scale tiny``), one fault
per trial in a file and at a place drawn from the trial's seed:

    byte_flip       a random byte of a random raw CSV replaced by a random byte
    truncate        a random raw CSV cut at a random byte
    duplicate_line  a random data line of an interaction log repeated after itself
    drop_line       a random data line of an interaction log removed
    extra_column    a random data line of an interaction log given one more field
    latin1_line     a random data line of an interaction log given a byte that is not UTF-8 (a Latin-1 letter)

Verdict of a trial (every one must hold; the table counts each):

- clean exit or one message: the ingest succeeds, or fails with a message whose last line names the file (never a
  Python traceback as the only message);
- deterministic: a second run on the same fuzzed input writes byte-identical shards, manifest rows and rejects.csv;
- accounted (the line-level classes): the rows read differ from the clean input's by exactly the lines added or
  removed, and a line given an extra field or a bad byte is in ``rejects.csv`` with a reason, named by file and line;
- no process left behind: no child of the run is alive after it returns.

Every trial's seed is recorded, so ``--replay SEED --classes CLASS`` runs it again. Writes ``OUT/results.json`` and
the record ``benchmarks/results/chaos.json``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import Recorder  # noqa: E402

CLASSES = ("byte_flip", "truncate", "duplicate_line", "drop_line", "extra_column", "latin1_line")
LINE_CLASSES = {"duplicate_line": 1, "drop_line": -1, "extra_column": 0, "latin1_line": 0}
MUST_REJECT = ("extra_column", "latin1_line")
INGEST = ["--task", "gr", "--batch-size", "32", "--micro-batches", "4", "--quiet"]


def _logs(raw: str) -> List[str]:
    return sorted(f for f in os.listdir(raw) if f.startswith("log_") and f.endswith(".csv"))


def _csvs(raw: str) -> List[str]:
    return sorted(f for f in os.listdir(raw) if f.endswith(".csv"))


def fuzz(clean: str, out: str, cls: str, seed: int) -> Dict:
    """A copy of ``clean`` with one fault of ``cls`` drawn from ``seed``; returns what was done (file, line, byte)."""
    rng = random.Random(seed)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(clean, out)
    name = rng.choice(_csvs(out) if cls in ("byte_flip", "truncate") else _logs(out))
    path = os.path.join(out, name)
    data = open(path, "rb").read()
    what: Dict = {"file": name}
    if cls == "byte_flip":
        at = rng.randrange(len(data))
        new = bytes([rng.randrange(256)])
        data = data[:at] + new + data[at + 1:]
        what.update(byte=at, value=new[0])
    elif cls == "truncate":
        at = rng.randrange(1, len(data))
        data = data[:at]
        what.update(byte=at)
    else:
        lines = data.split(b"\n")
        body = [i for i in range(1, len(lines)) if lines[i]]
        i = rng.choice(body)
        what["line"] = i + 1  # 1-based file line
        if cls == "duplicate_line":
            lines.insert(i + 1, lines[i])
        elif cls == "drop_line":
            del lines[i]
        elif cls == "extra_column":
            lines[i] = lines[i] + b",extra"
        elif cls == "latin1_line":
            cut = rng.randrange(len(lines[i]) + 1)
            lines[i] = lines[i][:cut] + "é".encode("latin-1") + lines[i][cut:]
        data = b"\n".join(lines)
    with open(path, "wb") as f:
        f.write(data)
    return what


def run_tracked(cmd: List[str], timeout: float = 300, grace: float = 5.0) -> Dict:
    """Run ``cmd``, watching its process tree while it runs (every descendant seen, as ``ingest_bench.py`` samples
    it: once the driver exits its orphans belong to init and cannot be found from it), then give the descendants
    ``grace`` seconds to exit. Returns the exit code, the output's tails and the pids still alive (killed)."""
    import tempfile

    import psutil

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        root, seen = psutil.Process(p.pid), {}
        deadline = time.time() + timeout
        while p.poll() is None:
            try:
                seen.update((c.pid, c) for c in root.children(recursive=True))
            except psutil.Error:
                pass
            if time.time() > deadline:
                p.kill()
            time.sleep(0.02)
        _, alive = psutil.wait_procs(list(seen.values()), timeout=grace)
        for c in alive:  # do not leave them behind for the next trial
            c.kill()
        out.seek(0)
        err.seek(0)
        return {"rc": p.returncode, "stdout": out.read()[-2000:], "stderr": err.read()[-4000:],
                "left_behind": [c.pid for c in alive]}


def ingest(raw: str, out: str, timeout: float = 300) -> Dict:
    shutil.rmtree(out, ignore_errors=True)
    return run_tracked([sys.executable, "-m", "nestpipe", "ingest", "--raw", raw, "--out", out, *INGEST], timeout)


def _digest(out: str) -> str:
    """What a run wrote that must not differ between runs on one input: shard bytes, rejects.csv, manifest rows."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if name.endswith(".tar") or name == "rejects.csv":
            h.update(name.encode())
            h.update(open(path, "rb").read())
        elif name == "manifest.json":
            m = json.load(open(path))
            m.get("stats", {}).pop("seconds", None)
            m.get("stats", {}).pop("stage_seconds", None)
            m.pop("created", None)
            h.update(json.dumps({k: m[k] for k in sorted(m) if k not in ("created_at", "date")}, sort_keys=True,
                                default=str).encode())
    return h.hexdigest()


def _rejects(out: str) -> List[Dict]:
    path = os.path.join(out, "rejects.csv")
    if not os.path.exists(path):
        return []
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        return list(csv.DictReader(f))


def _input_rows(out: str) -> Optional[int]:
    try:
        return int(json.load(open(os.path.join(out, "manifest.json")))["stats"]["input_rows"])
    except (OSError, KeyError, ValueError):
        return None


def trial(work: str, clean_raw: str, clean_rows: int, cls: str, seed: int) -> Dict:
    raw = os.path.join(work, f"raw-{cls}-{seed}")
    what = fuzz(clean_raw, raw, cls, seed)
    a, b = os.path.join(work, f"out-{cls}-{seed}-a"), os.path.join(work, f"out-{cls}-{seed}-b")
    ra, rb = ingest(raw, a), ingest(raw, b)
    v: Dict = {"class": cls, "seed": seed, "fault": what, "rc": ra["rc"]}
    last = ra["stderr"].strip().splitlines()[-1] if ra["stderr"].strip() else ""
    if ra["rc"] == 0:
        v["one_message"] = True
    else:
        v["one_message"] = ("Traceback" not in ra["stderr"] and what["file"] in last)
        v["message"] = last[-300:]
    v["deterministic"] = ra["rc"] == rb["rc"] and (ra["rc"] != 0 or _digest(a) == _digest(b))
    v["no_process_left"] = not ra["left_behind"] and not rb["left_behind"]
    if cls in LINE_CLASSES and ra["rc"] == 0:
        rows = _input_rows(a)
        rejects = _rejects(a)
        hit = [r for r in rejects if what["file"] in (r.get("file") or "") and str(r.get("line")) == str(what["line"])]
        v["rows_read"], v["rejected"] = rows, len(rejects)
        ok = rows is not None and rows == clean_rows + LINE_CLASSES[cls]
        if cls in MUST_REJECT:
            ok = ok and bool(hit) and bool((hit[0].get("reason") or "").strip())
        v["accounted"] = ok
    else:
        v["accounted"] = None  # not a line-level fault, or the run refused the input (checked by one_message)
    v["ok"] = all(v[k] is not False for k in ("one_message", "deterministic", "no_process_left", "accounted"))
    for d in (raw, a, b):
        shutil.rmtree(d, ignore_errors=True)
    return v


def campaign(out: str, classes, trials: int, seed: int, replay: Optional[int] = None) -> Dict:
    os.makedirs(out, exist_ok=True)
    clean = os.path.join(out, "clean-raw")
    if not os.path.exists(os.path.join(clean, "user_features_27k.csv")):
        subprocess.run([sys.executable, "-m", "nestpipe", "synth", "--scale", "tiny", "--out", clean], check=True,
                       capture_output=True)
    ref = ingest(clean, os.path.join(out, "clean-out"))
    if ref["rc"] != 0:
        raise SystemExit(f"the clean input does not ingest:\n{ref['stderr']}")
    clean_rows = _input_rows(os.path.join(out, "clean-out"))
    rows = []
    for cls in classes:
        seeds = [replay] if replay is not None else [seed * 1000 + k for k in range(trials)]
        for s in seeds:
            v = trial(out, clean, clean_rows, cls, s)
            rows.append(v)
            verdicts = {k: v[k] for k in ("one_message", "deterministic", "no_process_left", "accounted", "message")
                        if k in v}
            print(f"{cls:15} seed {s:6} {'ok  ' if v['ok'] else 'FAIL'} rc {v['rc']} {json.dumps(v['fault'])}"
                  + ("" if v["ok"] else f"  {json.dumps(verdicts)}"), flush=True)
    return {"trials": rows, "clean_input_rows": clean_rows, "summary": summarise(rows)}


def summarise(rows: List[Dict]) -> Dict:
    out = {}
    for cls in sorted({r["class"] for r in rows}):
        rs = [r for r in rows if r["class"] == cls]
        out[cls] = {"trials": len(rs), "ok": sum(r["ok"] for r in rs), "refused": sum(r["rc"] != 0 for r in rs),
                    "silent_losses": sum(r["accounted"] is False or r["deterministic"] is False for r in rs),
                    "raw_tracebacks": sum(r["one_message"] is False for r in rs),
                    "left_behind": sum(r["no_process_left"] is False for r in rs)}
    return out


def print_table(summary: Dict) -> None:
    print(f"\n{'class':15} {'trials':>6} {'ok':>4} {'refused':>8} {'silent losses':>14} {'tracebacks':>11} "
          f"{'left behind':>12}")
    for cls, s in summary.items():
        print(f"{cls:15} {s['trials']:6} {s['ok']:4} {s['refused']:8} {s['silent_losses']:14} "
              f"{s['raw_tracebacks']:11} {s['left_behind']:12}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials-per-class", type=int, default=20)
    ap.add_argument("--classes", nargs="+", default=list(CLASSES), choices=CLASSES)
    ap.add_argument("--seed", type=int, default=0, help="campaign seed: trial k of a class uses seed*1000 + k")
    ap.add_argument("--replay", type=int, default=None, help="run only the trial with this seed")
    ap.add_argument("--out", default="/tmp/nestpipe-chaos")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args(argv)
    rec = None if (a.no_record or a.replay is not None) else Recorder("chaos", argv, __file__)
    res = campaign(a.out, a.classes, a.trials_per_class, a.seed, a.replay)
    print_table(res["summary"])
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    if rec is not None:
        rec.write(res)
    return 0 if all(r["ok"] for r in res["trials"]) else 1


if __name__ == "__main__":
    sys.exit(main())
