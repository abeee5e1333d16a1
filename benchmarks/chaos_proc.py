"""What the fault campaigns (``benchmarks/chaos.py``) share: running a command while watching its process tree (and
injecting a fault into it), the "one message" verdict, and small filesystems to fill or to forbid writes on."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from typing import Dict, Iterable, List, Optional


def run_tracked(cmd: List[str], timeout: float = 300, grace: float = 5.0, act=None, env=None, watch=None) -> Dict:
    """Run ``cmd``, watching its process tree while it runs (every descendant seen, as ``ingest_bench.py`` samples
    it: once the driver exits its orphans belong to init and cannot be found from it), then give the descendants
    ``grace`` seconds to exit. ``act(elapsed, root, descendants)``: called while the command runs until it returns
    something (what it did: the fault); ``watch(elapsed, root, descendants, fault)``: called after it while the
    command runs (to time what follows the fault). Returns the exit code, the output's tails, the seconds it ran,
    the fault and the pids still alive after the grace (killed)."""
    import tempfile

    import psutil

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.time()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        root, seen, done = psutil.Process(p.pid), {}, None
        deadline = t0 + timeout
        while p.poll() is None:
            try:
                seen.update((c.pid, c) for c in root.children(recursive=True))
            except psutil.Error:
                pass
            if act is not None and done is None:
                done = act(time.time() - t0, root, list(seen.values()))
            elif done is not None and watch is not None:
                watch(time.time() - t0, root, list(seen.values()), done)
            if time.time() > deadline:
                p.kill()
            time.sleep(0.01)
        seconds = time.time() - t0
        _, alive = psutil.wait_procs(list(seen.values()), timeout=grace)
        for c in alive:  # do not leave them behind for the next trial
            c.kill()
        out.seek(0)
        err.seek(0)
        return {"rc": p.returncode, "stdout": out.read()[-2000:], "stderr": err.read()[-4000:],
                "seconds": round(seconds, 2), "fault": done, "left_behind": [c.pid for c in alive]}




def one_message(stderr: str, names: Iterable[str] = (), summary_of: str = "") -> Dict:
    """The "one message" verdict of a run that failed: no Python traceback in what it printed, and its last line
    names one of ``names`` (a file, a path, a rank) when any are given. ``summary_of`` (a command, ``nestpipe
    train``): the ranks' tracebacks may stand above, as long as the last line is that command's one-line summary
    (``nestpipe train: error: ...``), so a traceback is never the only message. Returns {"ok", "message"}."""
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    last = lines[-1] if lines else ""
    names = [n for n in names if n]
    if summary_of:  # the summary may continue on indented lines (one per problem)
        starts = [i for i, x in enumerate(lines) if x.startswith(f"{summary_of}: error:")]
        block = lines[starts[-1]:] if starts else []
        clean = bool(block) and all(x.startswith("  ") for x in block[1:])
        last = "\n".join(block) if block else last
    else:
        clean = "Traceback (most recent call last)" not in stderr
    ok = bool(last) and clean and (not names or any(n in last for n in names))
    return {"ok": ok, "message": last[-400:]}


def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root on Linux)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0 and os.path.exists("/proc/filesystems") and \
        "tmpfs" in open("/proc/filesystems").read()


@contextlib.contextmanager
def tmpfs(path: str, size_bytes: int, read_only: bool = False):
    """A tmpfs of ``size_bytes`` mounted at ``path`` (created) for the block; unmounted after it, whatever happens."""
    os.makedirs(path, exist_ok=True)
    opts = f"size={max(4096, int(size_bytes))}" + (",ro" if read_only else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], check=True, capture_output=True)
    try:
        yield path
    finally:
        for _ in range(50):
            if subprocess.run(["umount", path], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)  # a process of the run may still hold a file there for a moment


def resize(path: str, size_bytes: int) -> None:
    """Grow (or shrink) the tmpfs mounted at ``path``, keeping its files."""
    subprocess.run(["mount", "-o", f"remount,size={int(size_bytes)}", path], check=True, capture_output=True)


def python_descendants(procs: List) -> List:
    """The live Python processes among ``procs`` that do real work (not multiprocessing's resource tracker)."""
    import psutil

    out = []
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "python" in cmd and \
                    "resource_tracker" not in cmd:
                out.append(p)
        except psutil.Error:
            pass
    return out
