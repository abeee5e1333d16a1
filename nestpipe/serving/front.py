"""``nestpipe serve --replicas N``: N ranking processes behind one front that keeps every user on one replica.

A user's prefix K/V lives in the replica that computed it, so the front routes every request of a user to the same
replica: jump consistent hashing (Lamping and Veach, 2014) of the user id over the N replicas, a pure function, so
any front computes the same route and adding a replica moves only 1 / (N + 1) of the users. The replicas memory-map
one read-only copy of the model (:func:`~nestpipe.serving.ranker.save_shared`: the tables and the candidates in the
page cache once per host), each keeps its users' history in its own SQLite file (``history-I.sqlite``) and its own
cache (``--cache-mb`` per replica). A replica that exits is restarted on its port by the front's watcher (counted in
``/v1/stats``); its users' next requests are misses that rebuild their windows from the history file. The front
forwards bodies as they are (the replica validates them) with the standard library's HTTP client, from FastAPI's
thread pool.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import List

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool  # FastAPI's own thread pool, for the blocking forward

from nestpipe.serving.admission import MAX_IN_FLIGHT, Admission


def jump_hash(key: int, buckets: int) -> int:
    """Jump consistent hash of a 64-bit key into ``[0, buckets)``."""
    key &= (1 << 64) - 1
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & ((1 << 64) - 1)
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replicas:
    """N ``nestpipe serve`` processes on loopback ports, restarted when they exit."""

    def __init__(self, run: str, shared: str, n: int, cache_mb: float, history_dir: str,
                 spill_dir: str = None, spill_mb: float = 4096.0, max_in_flight: int = MAX_IN_FLIGHT):
        self.run, self.shared, self.cache_mb, self.history_dir = run, shared, cache_mb, history_dir
        self.max_in_flight = max_in_flight
        self.spill_dir, self.spill_mb = spill_dir, spill_mb
        self.ports = [free_port() for _ in range(n)]
        self.procs: List[subprocess.Popen] = [self._start(i) for i in range(n)]
        self.restarts = 0
        self.stopping = False
        for i in range(n):
            self.wait_ready(i)
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _start(self, i: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "nestpipe", "serve", "--run", self.run, "--port", str(self.ports[i]),
               "--cache-mb", str(self.cache_mb), "--shared", self.shared,
               "--history", os.path.join(self.history_dir, f"history-{i}.sqlite"),
               "--max-in-flight", str(self.max_in_flight)]
        if self.spill_dir:
            cmd += ["--spill-dir", os.path.join(self.spill_dir, f"replica-{i}"), "--spill-mb", str(self.spill_mb)]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def wait_ready(self, i: int, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url(i) + "/healthz", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"replica {i} (port {self.ports[i]}) did not start within {timeout:.0f} s")

    def _watch(self) -> None:
        while not self.stopping:
            for i, p in enumerate(self.procs):
                if p.poll() is not None and not self.stopping:
                    self.procs[i] = self._start(i)
                    self.restarts += 1
            time.sleep(0.2)

    def route(self, user: int) -> int:
        return jump_hash(int(user), len(self.procs))

    def stop(self) -> None:
        self.stopping = True
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def _forward(url: str, body: bytes, timeout: float = 120, retry_s: float = 60) -> Response:
    """POST ``body`` to ``url``. While the replica cannot be reached or drops the connection without a byte of
    answer (it is restarting, or died before it answered), retry for ``retry_s``. A replica whose answer is cut short
    or never comes within ``timeout`` had the request: it is not sent again, and the client gets 503 with the
    reason (before, such a failure escaped as a 500 without one)."""
    deadline = time.time() + retry_s
    while True:
        req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return Response(r.read(), status_code=r.status, media_type="application/json")
        except urllib.error.HTTPError as e:
            try:
                return Response(e.read(), status_code=e.code, media_type="application/json")
            except (OSError, http.client.HTTPException) as cut:
                raise HTTPException(503, f"replica at {url} failed while answering {e.code}: {cut!r}")
        except (urllib.error.URLError, ConnectionError) as e:  # refused, reset or closed before any answer
            if time.time() > deadline:
                raise HTTPException(503, f"replica at {url} unavailable: {getattr(e, 'reason', e)}")
            time.sleep(0.2)
        except (OSError, http.client.HTTPException) as e:  # an answer cut short, or none in time
            raise HTTPException(503, f"replica at {url} failed while answering ({type(e).__name__}: {e}); the "
                                     "request may have been applied: rank without new events to see the state")


def create_front_app(replicas: Replicas, max_in_flight: int = MAX_IN_FLIGHT) -> FastAPI:
    """``max_in_flight``: per replica (the front admits N times it, see server.Admission)."""
    app = FastAPI(title="NestPipe ranking front", description="routes each user to the replica holding its prefix")
    admission = Admission(max_in_flight * len(replicas.procs))
    admission.install(app)

    async def routed(request: Request, path: str) -> Response:
        body = await request.body()
        try:
            user = json.loads(body)["user_id"]
            if not isinstance(user, int) or isinstance(user, bool):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise HTTPException(422, "the body must be a JSON object with an integer user_id")
        return await run_in_threadpool(_forward, replicas.url(replicas.route(user)) + path, body)

    @app.post("/v1/prefill")
    async def prefill(request: Request):
        return await routed(request, "/v1/prefill")

    @app.post("/v1/rank")
    async def rank(request: Request):
        return await routed(request, "/v1/rank")

    @app.get("/v1/stats")
    def stats():
        per = []
        for i in range(len(replicas.procs)):
            try:
                with urllib.request.urlopen(replicas.url(i) + "/v1/stats", timeout=10) as r:
                    per.append(json.loads(r.read()))
            except OSError as e:
                per.append({"error": str(e)})
        return {"replicas": per, "restarts": replicas.restarts,
                "admission": {"limit": admission.limit, "in_flight": admission.in_flight,
                              "refused": admission.refused}}

    @app.get("/healthz")
    def health():
        return {"ok": True, "replicas": len(replicas.procs)}

    return app
