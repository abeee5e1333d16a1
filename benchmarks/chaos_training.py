"""Training fault classes of ``benchmarks/chaos.py``: a rank killed or stopped, a checkpoint write interrupted, a
shard truncated, a checkpoint damaged. The run: ``hstu`` at world 2 over gloo on the shards the ingest makes from the
synthetic KuaiRand logs (``chaos_ingest.References``), 12 steps, a checkpoint every 4; its uninterrupted export is
the reference (``nestpipe.trainer.export.assemble``: every table row and dense tensor).

    kill_rank           SIGKILL of a random rank at a moment drawn by progress: during the ranks' start-up or a
                        drawn fraction of a step time after a drawn step was logged
    kill_in_checkpoint  SIGKILL of a random rank while a drawn checkpoint is being written (each rank pauses 0.5 s
                        inside the write: the ``checkpoint_sleep_s`` testing hook), at a drawn delay into it
    stop_rank           SIGSTOP of a random rank at a moment drawn by progress among the steps (a hang), with
                        ``timeout_s = 10``
    truncate_shard      a random training shard cut at a random byte before the run
    damage_checkpoint   a finished run's random checkpoint file truncated or one byte changed, then ``--resume
                        --steps 16``

Verdicts: a run that fails ends in one message whose last line names the rank (a killed or stopped rank), the shard
(a truncated shard) or says why; ``--resume`` (or, with no complete checkpoint yet, the run again) finishes with an
export bitwise equal to the reference (``damage_checkpoint``: equal to an uninterrupted 16-step run, and a damaged
newest checkpoint is reported by name and skipped); a stopped rank's peers give up within the collective timeout
plus a margin; no process is left behind.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time
from typing import Dict, List, Optional

from chaos_proc import one_message, run_tracked

CLASSES = ("kill_rank", "kill_in_checkpoint", "stop_rank", "truncate_shard", "damage_checkpoint")
STEPS, EVERY, TIMEOUT_S = 12, 4, 10
SETS = ["--set", "embedding.replicate_max_rows=200", "--set", "hstu.num_layers=1",
        "--set", "hstu.num_random_negatives=8", "--set", "hstu.num_popular_negatives=8", "--set", "pipe.gantt_steps=0",
        "--set", f"timeout_s={TIMEOUT_S}"]


def train_cmd(shards: str, out: str, steps: int = STEPS) -> List[str]:
    return [sys.executable, "-m", "nestpipe", "train", "--shards", shards, "--out", out, "--model", "hstu",
            "--nproc-per-node", "2", "--steps", str(steps), "--checkpoint-every", str(EVERY), "--no-progress", *SETS]


def resume_cmd(out: str, steps: Optional[int] = None) -> List[str]:
    return [sys.executable, "-m", "nestpipe", "train", "--resume", out, "--nproc-per-node", "2", "--no-progress",
            *(["--steps", str(steps)] if steps else [])]


def _env(**hooks) -> Dict[str, str]:
    from nestpipe.trainer import testing_hooks

    return dict(os.environ, OMP_NUM_THREADS="1", **(testing_hooks.as_env(**hooks) if hooks else {}))


def export_equal(a: str, b: str) -> bool:
    from nestpipe.trainer.export import assemble

    import torch

    try:
        x, y = assemble(a), assemble(b)
    except Exception:  # noqa: BLE001 - no export is no equality
        return False
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _ranks(procs) -> Dict[int, object]:
    """The training ranks among ``procs``, by rank."""
    import psutil

    out = {}
    for p in procs:
        try:
            if "--worker-run" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out[int(p.environ().get("RANK", "-1"))] = p
        except (psutil.Error, ValueError):
            pass
    return out


class Reference:
    """The shards and the uninterrupted runs (12 steps; and 16 for ``damage_checkpoint``, made on first use)."""

    def __init__(self, work: str, shards: str):
        self.work, self.shards = work, shards
        self.runs: Dict[int, Dict] = {}

    def get(self, steps: int = STEPS) -> Dict:
        if steps not in self.runs:
            out = os.path.join(self.work, f"train-ref-{steps}")
            shutil.rmtree(out, ignore_errors=True)
            started = os.path.join(out, "scalars.jsonl")  # rank 0 logs the start once the ranks are up
            window: Dict[str, float] = {}

            def observe(elapsed, root, procs):
                """When the ranks run (the moments a rank can be killed or stopped) and when training starts."""
                if len(_ranks(procs)) >= 2:
                    window.setdefault("ranks_up_s", elapsed)
                    window["ranks_last_s"] = elapsed
                if "started_s" not in window and os.path.exists(started):
                    window["started_s"] = elapsed
                return None

            r = run_tracked(train_cmd(self.shards, out, steps), timeout=600, grace=10.0, env=_env(), act=observe)
            if r["rc"] != 0 or "ranks_last_s" not in window:
                raise SystemExit(f"the clean training run fails:\n{r['stderr'][-3000:]}")
            self.runs[steps] = {"out": out, "seconds": r["seconds"], **{k: round(v, 2) for k, v in window.items()}}
        return self.runs[steps]


def _finish(v: Dict, out: str, shards: str, ref: str, steps: int = STEPS, resume_steps: Optional[int] = None) -> None:
    """Resume ``out`` (or run it again when no checkpoint was completed) and compare its export with ``ref``."""
    from nestpipe.trainer import checkpoint

    if checkpoint.latest(out, quiet=True) is not None:
        again = run_tracked(resume_cmd(out, resume_steps), timeout=600, grace=10.0, env=_env())
        v["recovery"] = "resume"
    else:
        shutil.rmtree(out, ignore_errors=True)
        again = run_tracked(train_cmd(shards, out, steps), timeout=600, grace=10.0, env=_env())
        v["recovery"] = "rerun"
    v["rerun_rc"] = again["rc"]
    v["deterministic"] = again["rc"] == 0 and export_equal(ref, out)
    v.setdefault("left", []).extend(again["left_behind"])
    v["resume_stderr"] = again["stderr"][-600:]


def _verdict(v: Dict) -> Dict:
    v["no_process_left"] = not v.pop("left", [])
    v["accounted"] = None
    v["ok"] = all(v.get(k) is not False for k in ("one_message", "deterministic", "no_process_left"))
    return v


def _signal_rank(sig: int, at: float, rng: random.Random, when=None):
    """A fault for run_tracked: at ``at`` seconds (and once ``when()`` holds), ``sig`` to a drawn rank."""
    def act(elapsed, root, procs):
        if elapsed < at:
            return None
        ranks = _ranks(procs)
        if len(ranks) < 2 or (when is not None and not when()):
            return None
        r = rng.choice(sorted(ranks))
        try:
            ranks[r].send_signal(sig)
        except Exception:  # noqa: BLE001 - it exited in between: another moment
            return None
        return {"rank": r, "signal": signal.Signals(sig).name, "at_s": round(elapsed, 2)}
    return act


def _steps_logged(out: str) -> int:
    """Steps the run has logged so far (``scalars.jsonl``: a start line, then a line per step)."""
    try:
        with open(os.path.join(out, "scalars.jsonl")) as f:
            return sum(1 for line in f if '"event"' not in line)
    except OSError:
        return -1


def _moment(rng: random.Random, base: Dict, out: str, first_step: int = -1):
    """A moment of the run drawn by progress, not by the clock (the load on the machine changes how long a run
    takes): a step k (``-1``: the ranks' start-up, before the first step) and a fraction of the clean run's time for
    that phase to wait after k's step was logged. Returns (what was drawn, a ``when()`` for :func:`_signal_rank`)."""
    k = rng.randrange(first_step, STEPS)
    frac = rng.random()
    step_s = max(0.05, (base["ranks_last_s"] - base.get("started_s", base["ranks_up_s"])) / STEPS)
    wait = frac * (max(0.1, base.get("started_s", base["ranks_up_s"]) - base["ranks_up_s"]) if k < 0 else step_s)
    seen: Dict = {}

    def when():  # called while both ranks run (_signal_rank)
        if "t" not in seen and (k < 0 or _steps_logged(out) >= k + 1):
            seen["t"] = time.time()
        return "t" in seen and time.time() - seen["t"] >= wait
    return {"after_step": k, "wait_s": round(wait, 2)}, when


def kill_trial(work: str, ref: Reference, cls: str, seed: int) -> Dict:
    rng = random.Random(seed)
    base = ref.get()
    out = os.path.join(work, f"train-{cls}-{seed}")
    shutil.rmtree(out, ignore_errors=True)
    hooks: Dict = {}
    when = None
    at = 0.0
    if cls == "kill_rank":  # a moment over the ranks' life: start-up, any step, checkpoints
        planned, when = _moment(rng, base, out)
    else:  # inside a checkpoint write: each rank sleeps 0.5 s between writing its file and renaming it
        hooks = {"checkpoint_sleep_s": 0.5}
        k = rng.choice(range(EVERY, STEPS, EVERY))
        delay = rng.uniform(0.0, 0.6)
        tmp = os.path.join(out, "checkpoints", f".tmp-step-{k:08d}")
        seen: Dict = {}

        def when():
            if "t" not in seen and os.path.isdir(tmp):
                seen["t"] = time.time()
            return "t" in seen and time.time() - seen["t"] >= delay
        planned = {"checkpoint_step": k, "delay_s": round(delay, 2)}
    first = run_tracked(train_cmd(ref.shards, out), timeout=600, grace=10.0, env=_env(**hooks),
                        act=_signal_rank(signal.SIGKILL, at, rng, when))
    v: Dict = {"class": cls, "seed": seed, "fault": dict(planned, **(first["fault"] or {"killed": None})),
               "rc": first["rc"], "left": list(first["left_behind"])}
    if first["fault"] is None:  # the run ended before the moment came: it must be the reference
        v["one_message"] = first["rc"] == 0
        v["deterministic"] = first["rc"] == 0 and export_equal(base["out"], out)
        shutil.rmtree(out, ignore_errors=True)
        return _verdict(v)
    msg = one_message(first["stderr"], [f"rank {first['fault']['rank']}"], "nestpipe train")
    v["one_message"], v["message"] = first["rc"] != 0 and msg["ok"], msg["message"]
    _finish(v, out, ref.shards, base["out"])
    shutil.rmtree(out, ignore_errors=True)
    return _verdict(v)


def stop_trial(work: str, ref: Reference, cls: str, seed: int) -> Dict:
    """SIGSTOP of a drawn rank after start-up (a hang): the other rank must give up within the collective timeout
    plus a margin, naming the stopped rank; then the stopped process is killed and the run resumed."""
    rng = random.Random(seed)
    base = ref.get()
    out = os.path.join(work, f"train-{cls}-{seed}")
    shutil.rmtree(out, ignore_errors=True)
    planned, training = _moment(rng, base, out, first_step=0)  # during the steps: collectives in flight

    def peers_gone(elapsed, root, procs, fault):
        """When every rank but the stopped one has exited (they gave up on it)."""
        if "peers_gone_at_s" not in fault and set(_ranks(procs)) <= {fault["rank"]}:
            fault["peers_gone_at_s"] = round(elapsed, 2)

    first = run_tracked(train_cmd(ref.shards, out), timeout=300, grace=10.0, env=_env(),
                        act=_signal_rank(signal.SIGSTOP, 0.0, rng, training), watch=peers_gone)
    v: Dict = {"class": cls, "seed": seed,
               "fault": dict(planned, **(first["fault"] or {"stopped": None})),
               "rc": first["rc"], "left": list(first["left_behind"])}
    if first["fault"] is None:
        v["one_message"] = first["rc"] == 0
        v["deterministic"] = first["rc"] == 0 and export_equal(base["out"], out)
        shutil.rmtree(out, ignore_errors=True)
        return _verdict(v)
    r = first["fault"]["rank"]
    if first["rc"] == 0:  # stopped after the last collective: the launcher ends it once the run is complete
        v["one_message"] = f"rank {r} did not exit" in first["stderr"]
        v["message"] = next((x for x in first["stderr"].splitlines() if "did not exit" in x), "")[-300:]
        v["deterministic"] = export_equal(base["out"], out)
        shutil.rmtree(out, ignore_errors=True)
        return _verdict(v)
    gone = first["fault"].get("peers_gone_at_s", first["seconds"])
    v["peers_gave_up_after_s"] = round(gone - first["fault"]["at_s"], 1)
    v["run_ended_after_s"] = round(first["seconds"] - first["fault"]["at_s"], 1)
    v["within_timeout"] = v["peers_gave_up_after_s"] <= TIMEOUT_S + 10  # the timeout, the heartbeat read, a margin
    msg = one_message(first["stderr"], [f"rank {first['fault']['rank']} stopped answering"],
                      "nestpipe train")
    v["one_message"] = first["rc"] != 0 and msg["ok"] and v["within_timeout"]
    v["message"] = msg["message"]
    _finish(v, out, ref.shards, base["out"])
    shutil.rmtree(out, ignore_errors=True)
    return _verdict(v)


def truncate_trial(work: str, ref: Reference, cls: str, seed: int) -> Dict:
    """A training shard cut at a random byte: the run fails naming the shard, or (the cut part never read) trains
    to the reference; with the shard restored, the run recovers to the reference."""
    rng = random.Random(seed)
    base = ref.get()
    shards = os.path.join(work, f"shards-{seed}")
    shutil.rmtree(shards, ignore_errors=True)
    shutil.copytree(ref.shards, shards)
    names = sorted(n for n in os.listdir(shards) if n.startswith("train-") and n.endswith(".tar"))
    name = rng.choice(names)
    path = os.path.join(shards, name)
    size = os.path.getsize(path)
    cut = rng.randrange(1, size)
    with open(path, "r+b") as f:
        f.truncate(cut)
    out = os.path.join(work, f"train-{cls}-{seed}")
    shutil.rmtree(out, ignore_errors=True)
    first = run_tracked(train_cmd(shards, out), timeout=600, grace=10.0, env=_env())
    v: Dict = {"class": cls, "seed": seed, "fault": {"shard": name, "byte": cut, "bytes": size}, "rc": first["rc"],
               "left": list(first["left_behind"])}
    if first["rc"] == 0:
        v["one_message"] = True
        v["deterministic"] = export_equal(base["out"], out)
    else:
        msg = one_message(first["stderr"], [name], "nestpipe train")
        v["one_message"], v["message"] = msg["ok"], msg["message"]
        shutil.copyfile(os.path.join(ref.shards, name), path)  # restored: the run picks up where it failed
        _finish(v, out, shards, base["out"])
    for d in (shards, out):
        shutil.rmtree(d, ignore_errors=True)
    return _verdict(v)


def damage_trial(work: str, ref: Reference, cls: str, seed: int) -> Dict:
    """A finished 12-step run, one file of a drawn checkpoint truncated or changed, then ``--resume --steps 16``:
    the export equals an uninterrupted 16-step run's; a damaged newest checkpoint is named and skipped."""
    from nestpipe.trainer import checkpoint

    rng = random.Random(seed)
    base, longer = ref.get(), ref.get(STEPS + EVERY)
    out = os.path.join(work, f"train-{cls}-{seed}")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base["out"], out)
    root = checkpoint.ckpt_root(out)
    ckpt = os.path.join(root, rng.choice(sorted(d for d in os.listdir(root) if d.startswith("step-"))))
    name = rng.choice(sorted(checkpoint.read_meta(ckpt)["files"]))
    path = os.path.join(ckpt, name)
    data = open(path, "rb").read()
    how = rng.choice(["truncate", "byte"])
    at = rng.randrange(len(data))
    with open(path, "wb") as f:
        f.write(data[:at] if how == "truncate" else data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
    v: Dict = {"class": cls, "seed": seed, "fault": {"checkpoint": os.path.basename(ckpt), "file": name, "how": how,
                                                     "byte": at}, "rc": None, "left": []}
    again = run_tracked(resume_cmd(out, STEPS + EVERY), timeout=600, grace=10.0, env=_env())
    newest = ckpt.endswith(f"step-{STEPS:08d}")
    v["rc"] = v["rerun_rc"] = again["rc"]
    named = f"{os.path.basename(ckpt)} is damaged, not used ({name}:" in again["stderr"]
    v["one_message"] = again["rc"] == 0 and (named or not newest)
    v["message"] = next((x for x in again["stderr"].splitlines() if "damaged" in x), "")[-300:]
    v["deterministic"] = again["rc"] == 0 and export_equal(longer["out"], out)
    v["left"] = list(again["left_behind"])
    shutil.rmtree(out, ignore_errors=True)
    return _verdict(v)


def run_trial(work: str, ref: Reference, cls: str, seed: int) -> Dict:
    if cls in ("kill_rank", "kill_in_checkpoint"):
        return kill_trial(work, ref, cls, seed)
    if cls == "stop_rank":
        return stop_trial(work, ref, cls, seed)
    if cls == "truncate_shard":
        return truncate_trial(work, ref, cls, seed)
    return damage_trial(work, ref, cls, seed)


__all__ = ["CLASSES", "Reference", "run_trial"]
