"""Ingest fault classes of ``benchmarks/chaos.py``: input fuzz, SIGKILL of the driver or a worker (local and Dask
engines), a full disk and an unwritable output, on the synthetic KuaiRand logs (``nestpipe synth --scale tiny``).

Input fuzz, one fault per trial in a file and at a place drawn from the trial's seed:

    byte_flip          a random byte of a random raw CSV replaced by a random byte
    truncate           a random raw CSV cut at a random byte
    duplicate_line     a random data line of an interaction log repeated after itself
    drop_line          a random data line of an interaction log removed
    extra_column       a random data line of an interaction log given one more field
    latin1_line        a random data line of an interaction log given a byte that is not UTF-8 (a Latin-1 letter)
    parquet_byte_flip  an interaction log as Parquet, a random byte of it replaced
    parquet_truncate   an interaction log as Parquet, cut at a random byte

Verdicts: the ingest succeeds, or fails with one message whose last line names the file or says what is wrong with
the input as a whole (too little data left, too many rows rejected: see rejects.csv), never a traceback; a
second run on the same fuzzed input writes byte-identical shards, manifest rows and rejects.csv; for the line-level
classes the rows read differ from the clean input's by exactly the lines added or removed, and a line given an
extra field or a bad byte is in ``rejects.csv`` with a reason, named by file and line.

Process and disk faults (``--workers 2``):

    kill_driver, kill_driver_dask   SIGKILL of ``nestpipe ingest`` at a moment drawn over the clean run's duration
    kill_worker, kill_worker_dask   SIGKILL of one of its worker processes (drawn) at such a moment
    full_disk                       the output on a tmpfs of a size drawn below what the run needs
    unwritable_output               the output under a read-only filesystem, or a path that is a regular file

The other public formats (a format drawn per trial among MovieLens 100K / 1M / CSV, atomic files, Amazon ratings CSV
and review JSON lines 2014 / 2023, written by ``nestpipe.ingest.formats.samples``): ``format_byte_flip``,
``format_truncate`` (a drawn file) and ``format_bad_line`` (a line of the interactions file replaced by one that is
not a record: rejected by file and line with its raw text, or the run fails naming the file).

Verdicts: a run that fails says so in one message (a killed driver prints nothing: it was killed); the rerun of the
same command (after the disk is grown again) writes shards and rejects.csv byte-identical to a clean uninterrupted
run's, and leaves no temporary file or working directory; a shard present after the fault is a finished one
(byte-identical to the clean run's); an unwritable output fails with a message naming the path and writes nothing;
no process is left behind (the watch sees every descendant and waits 10 s for them after the run).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

from chaos_proc import can_mount, one_message, python_descendants, resize, run_tracked, tmpfs

FUZZ_CLASSES = ("byte_flip", "truncate", "duplicate_line", "drop_line", "extra_column", "latin1_line",
                "parquet_byte_flip", "parquet_truncate")
# SIGKILL of the ingest driver or of one worker process, at a moment drawn over the clean run's duration
KILL_CLASSES = {"kill_driver": ("local", "driver"), "kill_worker": ("local", "worker"),
                "kill_driver_dask": ("dask", "driver"), "kill_worker_dask": ("dask", "worker")}
DISK_CLASSES = ("full_disk", "unwritable_output")
KILL_WINDOW = (0.02, 0.98)  # the kill moment, as fractions of the clean run's duration
CLASSES = FUZZ_CLASSES + tuple(KILL_CLASSES) + DISK_CLASSES
# a failure about the input as a whole names no one file: too little data left, or too many rows rejected (the
# message points to rejects.csv, which names each file and line)
WHOLE_INPUT = ("provide more data", "no complete training batch", "--max-reject-fraction")
# the other public formats (nestpipe.ingest.formats.samples: MovieLens, atomic, Amazon), a format drawn per trial
FORMAT_CLASSES = ("format_byte_flip", "format_truncate", "format_bad_line")
# the samples hold ~530 interactions: one bad record is 0.2% of them (above the default reject bound of 0.1%)
FORMAT_INGEST = ["--task", "gr", "--batch-size", "16", "--micro-batches", "2", "--max-seq-len", "12", "--quiet",
                 "--workers", "2", "--max-reject-fraction", "0.05"]
LINE_CLASSES = {"duplicate_line": 1, "drop_line": -1, "extra_column": 0, "latin1_line": 0}
MUST_REJECT = ("extra_column", "latin1_line")
INGEST = ["--task", "gr", "--batch-size", "32", "--micro-batches", "4", "--quiet", "--workers", "2"]


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
    if cls.startswith("parquet_"):  # the table as Parquet (the ingest reads NAME.parquet in place of NAME.csv)
        import polars as pl

        pq = path[:-len(".csv")] + ".parquet"
        pl.read_csv(path, infer_schema_length=0).write_parquet(pq, statistics=False)
        os.remove(path)
        path, name = pq, os.path.basename(pq)
        cls = cls[len("parquet_"):]
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


def ingest_cmd(raw: str, out: str, engine: str = "local") -> List[str]:
    return [sys.executable, "-m", "nestpipe", "ingest", "--raw", raw, "--out", out, *INGEST, "--engine", engine]


def ingest(raw: str, out: str, timeout: float = 300, engine: str = "local", fresh: bool = True, act=None) -> Dict:
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    return run_tracked(ingest_cmd(raw, out, engine), timeout, grace=10.0, act=act)


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


def shard_digests(out: str) -> Dict[str, str]:
    """sha256 of every finished shard and of rejects.csv (what a resumed run must reproduce byte for byte)."""
    if not os.path.isdir(out):
        return {}
    return {name: hashlib.sha256(open(os.path.join(out, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(out)) if name.endswith(".tar") or name == "rejects.csv"}


def _leftovers(out: str) -> List[str]:
    """Temporary files or the working directory a finished run left in its output."""
    if not os.path.isdir(out):
        return []
    return sorted(n for n in os.listdir(out) if ".tmp" in n or n == "_work")


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
    """One input-fuzz trial: the ingest twice on one fuzzed copy of the clean input."""
    raw = os.path.join(work, f"raw-{cls}-{seed}")
    what = fuzz(clean_raw, raw, cls, seed)
    a, b = os.path.join(work, f"out-{cls}-{seed}-a"), os.path.join(work, f"out-{cls}-{seed}-b")
    ra, rb = ingest(raw, a), ingest(raw, b)
    v: Dict = {"class": cls, "seed": seed, "fault": what, "rc": ra["rc"]}
    if ra["rc"] == 0:
        v["one_message"] = True
    else:
        msg = one_message(ra["stderr"], [what["file"], *WHOLE_INPUT])
        v["one_message"], v["message"] = msg["ok"], msg["message"]
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




class References:
    """The clean input and its uninterrupted runs, one per engine (made on first use): shard digests, seconds,
    output bytes, rows read."""

    def __init__(self, work: str):
        self.work = work
        self.raw = os.path.join(work, "clean-raw")
        if not os.path.exists(os.path.join(self.raw, "user_features_27k.csv")):
            subprocess.run([sys.executable, "-m", "nestpipe", "synth", "--scale", "tiny", "--out", self.raw],
                           check=True, capture_output=True)
        self._refs: Dict[str, Dict] = {}

    def get(self, engine: str = "local") -> Dict:
        if engine not in self._refs:
            out = os.path.join(self.work, f"clean-out-{engine}")
            r = ingest(self.raw, out, engine=engine)
            if r["rc"] != 0:
                raise SystemExit(f"the clean input does not ingest with --engine {engine}:\n{r['stderr']}")
            size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
            self._refs[engine] = {"out": out, "digests": shard_digests(out), "seconds": r["seconds"],
                                  "bytes": size, "rows": _input_rows(out)}
        return self._refs[engine]


def _kill_at(at: float, target: str, rng: random.Random):
    """A fault for :func:`run_tracked`: at ``at`` seconds, SIGKILL the driver or one of its worker processes (the
    first moment one exists, drawn among them)."""
    def act(elapsed, root, procs):
        if elapsed < at:
            return None
        if target == "driver":
            os.kill(root.pid, signal.SIGKILL)
            return {"killed": "driver", "at_s": round(elapsed, 2)}
        workers = sorted(python_descendants(procs), key=lambda p: p.pid)
        if not workers:
            return None
        w = rng.choice(workers)
        try:
            w.kill()
        except Exception:  # noqa: BLE001 - it exited between the listing and the kill: try another moment
            return None
        return {"killed": "worker", "at_s": round(elapsed, 2), "workers_seen": len(workers)}
    return act


def _rerun_after_fault(v: Dict, raw: str, out: str, ref: Dict, first: Dict, engine: str, before=None) -> None:
    """The verdicts after a fault that interrupted a run into ``out``: every shard it left is a finished one (the
    clean run's bytes); the same command again (after ``before()``, e.g. growing the disk) gives the clean run's
    shards and rejects.csv byte for byte and leaves no temporary file or working directory; no process left."""
    finished = {n: d for n, d in shard_digests(out).items() if n.endswith(".tar")}
    v["partial_shards"] = sorted(n for n, d in finished.items() if ref["digests"].get(n) != d)
    if before is not None:
        before()
    again = ingest(raw, out, engine=engine, fresh=False)
    v["rerun_rc"] = again["rc"]
    v["deterministic"] = again["rc"] == 0 and shard_digests(out) == ref["digests"] and not v["partial_shards"]
    v["leftovers"] = _leftovers(out)
    v["no_process_left"] = not first["left_behind"] and not again["left_behind"] and not v["leftovers"]


def kill_trial(work: str, refs: References, cls: str, seed: int) -> Dict:
    engine, target = KILL_CLASSES[cls]
    ref = refs.get(engine)
    rng = random.Random(seed)
    at = rng.uniform(*KILL_WINDOW) * ref["seconds"]
    out = os.path.join(work, f"out-{cls}-{seed}")
    first = ingest(refs.raw, out, engine=engine, act=_kill_at(at, target, rng))
    v: Dict = {"class": cls, "seed": seed, "fault": first["fault"] or {"killed": None, "planned_at_s": round(at, 2)},
               "rc": first["rc"]}
    if first["rc"] in (0, -signal.SIGKILL) or first["fault"] is None:
        v["one_message"] = first["rc"] in (0, -signal.SIGKILL)  # finished, or killed (a killed driver says nothing)
    else:
        msg = one_message(first["stderr"])
        v["one_message"], v["message"] = msg["ok"], msg["message"]
    _rerun_after_fault(v, refs.raw, out, ref, first, engine)
    v["accounted"] = None
    v["ok"] = all(v[k] is not False for k in ("one_message", "deterministic", "no_process_left"))
    shutil.rmtree(out, ignore_errors=True)
    return v


def disk_trial(work: str, refs: References, cls: str, seed: int) -> Dict:
    """``full_disk``: a tmpfs of 5-95% of the clean output's bytes; the run fails with one message naming the
    output or the lack of space, or succeeds; grown to four times the size, the rerun completes byte-identical.
    ``unwritable_output``: the output under a read-only tmpfs (a missing directory or an existing empty one), or a
    path that is a regular file: one message naming the path, nothing written, nothing left."""
    ref = refs.get("local")
    rng = random.Random(seed)
    v: Dict = {"class": cls, "seed": seed, "accounted": None}
    if not can_mount():
        v.update(fault={"skipped": "cannot mount a tmpfs here (not root)"}, rc=None, ok=True, skipped=True,
                 one_message=None, deterministic=None, no_process_left=None)
        return v
    mnt = os.path.join(work, f"mnt-{cls}-{seed}")
    if cls == "full_disk":
        size = int(rng.uniform(0.05, 0.95) * ref["bytes"])
        out = os.path.join(mnt, "out")
        v["fault"] = {"disk_bytes": size, "clean_output_bytes": ref["bytes"]}
        with tmpfs(mnt, size):
            first = ingest(refs.raw, out)
            v["rc"] = first["rc"]
            if first["rc"] == 0:
                v["one_message"] = True
            else:
                msg = one_message(first["stderr"], [out, "space", "No space"])
                v["one_message"], v["message"] = msg["ok"], msg["message"]
            _rerun_after_fault(v, refs.raw, out, ref, first, "local",
                               before=lambda: resize(mnt, 4 * ref["bytes"] + (64 << 20)))
    else:
        variant = rng.choice(["missing_under_read_only", "empty_read_only", "regular_file"])
        v["fault"] = {"variant": variant}
        os.makedirs(mnt, exist_ok=True)
        if variant == "regular_file":
            out = os.path.join(mnt, "out")
            with open(out, "w") as f:
                f.write("not a directory\n")
            first = ingest(refs.raw, out, fresh=False)
            unchanged = open(out).read() == "not a directory\n"
        else:
            out = os.path.join(mnt, "out") if variant == "missing_under_read_only" else mnt
            with tmpfs(mnt, 1 << 20, read_only=True):
                first = ingest(refs.raw, out, fresh=False)
                unchanged = not os.path.exists(out) or os.listdir(out) == []
        v["rc"] = first["rc"]
        msg = one_message(first["stderr"], [out])
        v["one_message"], v["message"] = first["rc"] not in (0, None) and msg["ok"], msg["message"]
        v["deterministic"] = unchanged  # nothing written where it could not be
        v["no_process_left"] = not first["left_behind"]
    v["ok"] = all(v.get(k) is not False for k in ("one_message", "deterministic", "no_process_left"))
    shutil.rmtree(mnt, ignore_errors=True)
    return v


def format_trial(work: str, cls: str, seed: int) -> Dict:
    """A drawn public format's sample files (``formats.samples``) with one fault: a flipped byte or a cut in a
    drawn file, or a line of the interactions file replaced by one that is not a record. Verdicts: the ingest
    succeeds deterministically or fails in one message naming the file; a bad line that does not fail the run is
    in rejects.csv by file and line with a reason and its raw text."""
    from nestpipe.ingest.formats.samples import WRITERS, sample_events

    rng = random.Random(seed)
    key = sorted(WRITERS)[rng.randrange(len(WRITERS))]
    raw = os.path.join(work, f"raw-{cls}-{seed}")
    shutil.rmtree(raw, ignore_errors=True)
    WRITERS[key](raw, sample_events(7))
    names = sorted(os.listdir(raw))
    inter = [n for n in names if not n.startswith("meta_")
             and any(t in n for t in ("u.data", "ratings", ".inter", "reviews_", "Mini.jsonl"))]
    name = rng.choice(names if cls != "format_bad_line" else inter)
    path = os.path.join(raw, name)
    data = open(path, "rb").read()
    what: Dict = {"format": "/".join(key), "file": name}
    if cls == "format_byte_flip":
        at = rng.randrange(len(data))
        data = data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
        what["byte"] = at
    elif cls == "format_truncate":
        at = rng.randrange(1, len(data))
        data, what["byte"] = data[:at], at
    else:
        import gzip

        packed = name.endswith(".gz")
        lines = (gzip.decompress(data) if packed else data).split(b"\n")
        body = [i for i in range(1 if b":token" in lines[0] or b"userId" in lines[0] else 0, len(lines)) if lines[i]]
        i = rng.choice(body)
        lines[i] = b"this is not a record"
        what["line"] = i + 1
        data = b"\n".join(lines)
        data = gzip.compress(data, mtime=0) if packed else data
    with open(path, "wb") as f:
        f.write(data)
    outs = [os.path.join(work, f"out-{cls}-{seed}-{k}") for k in "ab"]
    runs = []
    for out in outs:
        shutil.rmtree(out, ignore_errors=True)
        runs.append(run_tracked([sys.executable, "-m", "nestpipe", "ingest", "--raw", raw, "--out", out,
                                 *FORMAT_INGEST], 300, grace=10.0))
    ra, rb = runs
    v: Dict = {"class": cls, "seed": seed, "fault": what, "rc": ra["rc"]}
    if ra["rc"] == 0:
        v["one_message"] = True
    else:
        msg = one_message(ra["stderr"], [name, *WHOLE_INPUT])
        v["one_message"], v["message"] = msg["ok"], msg["message"]
    v["deterministic"] = ra["rc"] == rb["rc"] and (ra["rc"] != 0 or _digest(outs[0]) == _digest(outs[1]))
    v["no_process_left"] = not ra["left_behind"] and not rb["left_behind"]
    v["accounted"] = None
    if cls == "format_bad_line" and ra["rc"] == 0:
        hit = [r for r in _rejects(outs[0])
               if name in (r.get("file") or "") and str(r.get("line")) == str(what["line"])]
        v["accounted"] = bool(hit) and bool((hit[0].get("reason") or "").strip()) and \
            hit[0].get("raw") == "this is not a record"
    v["ok"] = all(v[k] is not False for k in ("one_message", "deterministic", "no_process_left", "accounted"))
    for d in [raw] + outs:
        shutil.rmtree(d, ignore_errors=True)
    return v


def run_trial(work: str, refs: References, cls: str, seed: int) -> Dict:
    """One trial of any ingest class."""
    if cls in FORMAT_CLASSES:
        return format_trial(work, cls, seed)
    if cls in KILL_CLASSES:
        return kill_trial(work, refs, cls, seed)
    if cls in DISK_CLASSES:
        return disk_trial(work, refs, cls, seed)
    return trial(work, refs.raw, refs.get("local")["rows"], cls, seed)
