"""Serving fault class of ``benchmarks/chaos.py``: ``nestpipe serve --replicas 2`` (the trained ``hstu`` of
``chaos_training``) under twice its measured capacity, with a replica killed mid-run and malformed requests mixed in.

One run (``overload_kill_replica``), its choices drawn from the seed:

1. 24 users prefilled with 6 events each.
2. Capacity: 6 closed-loop clients (each with its own users) send rank requests (one new event, 50 candidates) for
   4 s; capacity = answered requests per second.
3. Overload: an open-loop generator on loopback sends requests at twice the capacity for 8 s (bounded: rate x 8
   requests, each with a 30 s client timeout); of the valid ones half rank the stored window, half add one new event
   (one user's such requests go out one at a time, oldest event first); one request in five is malformed (not JSON,
   no user, a string user id, an unknown field, a negative action, too many or no candidates, an unknown user
   without events); at a drawn moment one replica is SIGKILLed (the front restarts it).
4. Every user ranked once more (the state the server holds), the server stopped and started again, and every user
   ranked again from the history store alone.

Verdicts: every response to a valid request is 200 with one score per candidate or 503 with a reason (overloaded,
or the replica restarting); every malformed request gets a 4xx with a reason (or the overload's 503: admission
comes before parsing), never a 200, a 5xx other than 503 or a dropped connection; the server keeps answering (every
user is ranked after the kill); after the restart every user's scores equal the ones before it (rtol = atol = 1e-4:
the restarted server recomputes the prefix from the history, the running one read it from its cache); no process
is left behind. Recorded: the capacity, the offered rate, p50 and p99 of the valid requests answered 200, the counts
of 200 / 503 / 4xx.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

CLASSES = ("overload_kill_replica",)
USERS, EVENTS, K = 24, 6, 50
CAPACITY_S, OVERLOAD_S, MALFORMED_SHARE = 4.0, 8.0, 0.2
MALFORMED = ("not_json", "no_user", "string_user", "unknown_field", "negative_action", "too_many_candidates",
             "no_candidates", "unknown_user")


def _post(base: str, path: str, body, timeout: float = 30.0) -> Tuple[int, Dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        return -1, {"client_error": f"{type(e).__name__}: {e}"}


class Server:
    """``nestpipe serve --replicas 2`` on a free loopback port, its history in ``history_dir``."""

    def __init__(self, run: str, history_dir: str):
        from nestpipe.serving.front import free_port

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nestpipe", "serve", "--run", run, "--replicas", "2", "--port", str(self.port),
             "--cache-mb", "64", "--max-in-flight", "16", "--history", os.path.join(history_dir, "history.sqlite")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(self.base + "/healthz", timeout=2):
                    break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"nestpipe serve did not start:\n{self.proc.stderr.read()[-3000:]}")
                time.sleep(0.2)

    def descendants(self) -> List:
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def replica_pids(self) -> Dict[int, int]:
        out = {}
        for p in self.descendants():
            try:
                cmd = " ".join(p.cmdline())
            except Exception:  # noqa: BLE001
                continue
            for i in (0, 1):
                if f"history-{i}.sqlite" in cmd:
                    out[i] = p.pid
        return out

    def stop(self) -> List[int]:
        """SIGTERM, wait, and return the pids of its processes still alive 10 s later (killed)."""
        import psutil

        procs = self.descendants()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        _, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            p.kill()
        return [p.pid for p in alive]


class Clock:
    """Event times later than every earlier one (a user's events arrive oldest first)."""

    def __init__(self):
        self.t, self.lock = 1_000_000, threading.Lock()

    def __call__(self) -> int:
        with self.lock:
            self.t += 1000
            return self.t


def _event(rng: random.Random, clock: Clock) -> Dict:
    return {"item_id": rng.randrange(1, 300), "action": rng.randrange(0, 4), "time_ms": clock()}


def _malformed(kind: str, rng: random.Random, clock: Clock):
    ok = _event(rng, clock)
    user = rng.randrange(USERS)
    return {"not_json": b"{\"user_id\": 1, \"events\": [", "no_user": {"events": [ok], "candidates": [1]},
            "string_user": {"user_id": "u1", "events": [ok], "candidates": [1]},
            "unknown_field": {"user_id": user, "events": [ok], "candidates": [1], "priority": 1},
            "negative_action": {"user_id": user, "events": [dict(ok, action=-1)], "candidates": [1]},
            "too_many_candidates": {"user_id": user, "events": [], "candidates": list(range(10_001))},
            "no_candidates": {"user_id": user, "events": [ok], "candidates": []},
            "unknown_user": {"user_id": 10_000_000 + rng.randrange(1000), "events": [], "candidates": [1]}}[kind]


def _pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))] * 1000, 1)


def serving_run(work: str, run: str, seed: int) -> Dict:
    import numpy as np

    rng = random.Random(seed)
    clock = Clock()
    hist = os.path.join(work, f"serve-{seed}")
    shutil.rmtree(hist, ignore_errors=True)
    os.makedirs(hist)
    cands = list(range(1, K + 1))
    v: Dict = {"class": CLASSES[0], "seed": seed, "accounted": None}
    left: List[int] = []
    srv = Server(run, hist)
    try:
        for u in range(USERS):
            code, body = _post(srv.base, "/v1/prefill", {"user_id": u, "events": [_event(rng, clock)
                                                                                   for _ in range(EVENTS)]})
            if code != 200:
                raise SystemExit(f"prefill of user {u} failed: {code} {body}")
        # capacity: closed loop
        done, stop_at = [], time.time() + CAPACITY_S

        def closed(c: int) -> None:
            r = random.Random(seed * 100 + c)
            mine = [u for u in range(USERS) if u % 6 == c]  # each client its own users: their events stay in order
            while time.time() < stop_at:
                code, _ = _post(srv.base, "/v1/rank", {"user_id": r.choice(mine), "events": [_event(r, clock)],
                                                       "candidates": cands})
                if code == 200:
                    done.append(1)

        threads = [threading.Thread(target=closed, args=(c,)) for c in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        capacity = len(done) / CAPACITY_S
        rate = 2 * capacity
        n = max(1, int(rate * OVERLOAD_S))
        kill_at = rng.uniform(0.2, 0.8) * OVERLOAD_S
        plan = []
        for i in range(n):
            bad = rng.random() < MALFORMED_SHARE
            kind = rng.choice(MALFORMED) if bad else "valid"
            # valid: a rank of the stored window, or (half of them) with one new event for a user whose requests
            # go out one at a time, oldest event first, as one user's client sends them
            body = _malformed(kind, rng, clock) if bad else {"user_id": rng.randrange(USERS), "events": [],
                                                             "candidates": cands, "new_event": rng.random() < 0.5}
            plan.append((i / rate, kind, body))
        results: List[Tuple[str, int, Dict, float]] = []
        lock = threading.Lock()
        user_locks = [threading.Lock() for _ in range(USERS)]
        t0 = time.time()

        def send(at: float, kind: str, body) -> None:
            if kind == "valid" and body.pop("new_event"):
                with user_locks[body["user_id"]]:
                    body["events"] = [_event(random.Random(at), clock)]
                    start = time.time()
                    code, got = _post(srv.base, "/v1/rank", body)
            else:
                start = time.time()
                code, got = _post(srv.base, "/v1/rank", body)
            with lock:
                results.append((kind, code, got, time.time() - start))

        killed: Dict = {}
        with ThreadPoolExecutor(max_workers=128) as pool:
            for at, kind, body in plan:
                while time.time() - t0 < at:
                    if not killed and time.time() - t0 >= kill_at:
                        i = rng.choice([0, 1])
                        pid = srv.replica_pids().get(i)
                        if pid:
                            os.kill(pid, signal.SIGKILL)
                            killed = {"replica": i, "at_s": round(time.time() - t0, 2)}
                    time.sleep(0.001)
                pool.submit(send, at, kind, body)
        v["fault"] = dict(killed or {"replica": None}, capacity_rps=round(capacity, 1), offered_rps=round(rate, 1),
                          requests=n)
        valid = [r for r in results if r[0] == "valid"]
        bad = [r for r in results if r[0] != "valid"]
        lat = [r[3] for r in valid if r[1] == 200]
        v["counts"] = {"valid_200": sum(r[1] == 200 for r in valid), "valid_503": sum(r[1] == 503 for r in valid),
                       "malformed_4xx": sum(400 <= r[1] < 500 for r in bad),
                       "malformed_503": sum(r[1] == 503 for r in bad)}
        v["p50_ms"], v["p99_ms"] = _pct(lat, 0.5), _pct(lat, 0.99)
        wrong = [(k, c, str(b)[:160]) for k, c, b, _ in valid
                 if not ((c == 200 and len(b.get("scores", [])) == K) or (c == 503 and b.get("detail")))]
        wrong += [(k, c, str(b)[:160]) for k, c, b, _ in bad if not ((400 <= c < 500 or c == 503) and b.get("detail"))]
        v["wrong_answers"] = wrong[:10]
        v["wrong_count"] = len(wrong)
        # the state the server holds: every user ranked (503s retried: overload and restarts are over by now)
        before = {}
        for u in range(USERS):
            for _ in range(50):
                code, body = _post(srv.base, "/v1/rank", {"user_id": u, "events": [], "candidates": cands})
                if code != 503:
                    break
                time.sleep(0.2)
            before[u] = body.get("scores") if code == 200 else None
        v["keeps_answering"] = all(s is not None for s in before.values()) and bool(killed)
        left += srv.stop()
        srv = Server(run, hist)  # a fresh server: the users' windows come from the history store alone
        after = {}
        for u in range(USERS):
            code, body = _post(srv.base, "/v1/rank", {"user_id": u, "events": [], "candidates": cands})
            after[u] = body.get("scores") if code == 200 else None
        v["history_intact"] = all(before[u] is not None and after[u] is not None and
                                  np.allclose(after[u], before[u], rtol=1e-4, atol=1e-4) for u in range(USERS))
    finally:
        left += srv.stop()
    v["rc"] = 0
    v["one_message"] = v.get("wrong_count", 1) == 0
    v["deterministic"] = v.get("keeps_answering", False) and v.get("history_intact", False)
    v["no_process_left"] = not left
    v["ok"] = all(v.get(k) is not False for k in ("one_message", "deterministic", "no_process_left"))
    shutil.rmtree(hist, ignore_errors=True)
    return v


def run_trial(work: str, run: str, cls: str, seed: int) -> Dict:
    return serving_run(work, run, seed)
