"""Online ranking (nestpipe.serving): scores from the cached prefix equal a full recompute of the same window.

Tolerance: the cached path computes attention with dense einsums over the new queries, the reference with the
trainer's jagged kernel (blocked tiles / Numba loops): the same sums in another order, so float32 rounding differs
(observed ~1e-6 on scores of magnitude ~1-10); asserted at rtol = atol = 1e-4. Negative control: a cache whose
positions are off by one fails the same comparison.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch

from nestpipe.measure.launcher import run_plan, write_run
from nestpipe.serving import Ranker
from nestpipe.serving.front import free_port
from nestpipe.serving.ranker import CachedPrefix, events_from_rows
from shard_sets import make_shards

TOL = dict(rtol=1e-4, atol=1e-4)
MAX_LEN = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("serving")
    shards = str(base / "gr")
    make_shards(shards, "gr", batch_size=12, micro_batches=3, shards=(4,), eval_shards=(1,), vocab=300,
                seq_len=MAX_LEN, seed=5)
    out = str(base / "run")
    write_run(out, shards, "hstu", "off", 4, {"hstu": {"num_layers": 2, "num_random_negatives": 16,
                                                       "relative_bias": True, "time_bias": True,
                                                       "transition": 0.5, "item_bias": 0.7},
                                              "pipe": {"gantt_steps": 0}})
    p = run_plan([{"run": out}], 1, str(base / "plan.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    return out


_CLOCK = itertools.count(1)


def _events(rng, n):
    """``n`` events later than every event made before (a user's events arrive oldest first)."""
    return events_from_rows(rng.integers(0, 300, n), rng.integers(0, 64, n), [next(_CLOCK) * 1000 for _ in range(n)])


def _close(a, b):
    torch.testing.assert_close(torch.from_numpy(np.asarray(a, np.float64)), torch.from_numpy(np.asarray(b, np.float64)),
                               **TOL)


def test_cached_prefix_scores_equal_a_full_recompute(run):
    ranker = Ranker.from_run(run)
    assert ranker.window == MAX_LEN
    rng = np.random.default_rng(0)
    cands = list(range(0, 300, 7))
    assert ranker.prefill(7, _events(rng, 3)) == {"cache": "miss", "events": 3}
    for new in (2, 0, 1, 2):  # up to the full window of 8 events: every request served from the cache
        scores, how = ranker.rank(7, _events(rng, new), cands)
        assert how == "hit"
        _close(scores, ranker.full_scores(ranker.window_events(7), cands))
    assert len(ranker.window_events(7)) == 8
    # past the window: rebased to the last max_seq_len // 2 events and recomputed, then hits again
    scores, how = ranker.rank(7, _events(rng, 1), cands)
    assert how == "miss" and len(ranker.window_events(7)) == MAX_LEN // 2
    _close(scores, ranker.full_scores(ranker.window_events(7), cands))
    scores, how = ranker.rank(7, _events(rng, 2), cands)
    assert how == "hit"
    _close(scores, ranker.full_scores(ranker.window_events(7), cands))
    assert ranker.stats()["requests"] == {"miss": 2, "hit": 5, "rebase": 1}


def test_negative_control_a_cache_off_by_one_token_breaks_equality(run):
    ranker = Ranker.from_run(run)
    rng = np.random.default_rng(1)
    cands = list(range(300))
    ranker.prefill(1, _events(rng, 4))
    good = ranker.cache.get(1)
    # the prefix's K/V shifted by one token (its first dropped, its last repeated), still claimed for all 4 positions:
    # an off-by-one in the cache
    ranker.cache.put(1, CachedPrefix(good.start, good.length,
                                     [(torch.cat([k[1:], k[-1:]]), torch.cat([v[1:], v[-1:]])) for k, v in good.kv],
                                     good.last_hidden))
    scores, how = ranker.rank(1, _events(rng, 2), cands)
    assert how == "hit"
    ref = ranker.full_scores(ranker.window_events(1), cands)
    with pytest.raises(AssertionError):
        _close(scores, ref)
    # the control's control: the intact cache gives the reference
    fresh = Ranker.from_run(run)
    fresh.history[1] = ranker.history[1][:4]
    fresh.prefill(1, [])
    got, how = fresh.rank(1, ranker.history[1][4:], cands)
    assert how == "hit"
    _close(got, ref)


def test_time_bias_cached_prefix_equals_a_full_recompute_and_reads_the_times(run):
    """With a random (large) time bias in every layer: the cached prefix still gives the full recompute's scores,
    and the times matter (control: the same events at other times score differently)."""
    ranker = Ranker.from_run(run)
    assert all(layer.time_bias is not None for layer in ranker.model.layers)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in ranker.model.layers:
            layer.time_bias.copy_(torch.randn(layer.time_bias.shape, generator=g) * 3)
    rng = np.random.default_rng(4)
    cands = list(range(0, 300, 3))
    ranker.prefill(11, _events(rng, 3))
    later = _events(rng, 3)
    scores, how = ranker.rank(11, later, cands)
    assert how == "hit"
    window = ranker.window_events(11)
    _close(scores, ranker.full_scores(window, cands))
    spread = events_from_rows(window.item, window.action, window.time[0] + (window.time - window.time[0]) * 1000)
    with pytest.raises(AssertionError):
        _close(scores, ranker.full_scores(spread, cands))


def test_scores_add_the_transition_term_of_the_last_event_and_the_item_bias(run):
    """The run has ``hstu.transition = 0.5`` and ``hstu.item_bias = 0.7``: a score is ``(cos(hidden, output_c) +
    w cos(from_last, to_c)) / temperature + s a_c``, ``from`` read from the window's last event's item (the training
    objective's query), ``a_c`` the first of the candidate's bias columns; evaluation's candidates and query
    (``next_item_candidates``) give the same scores. Controls: the same formula with the first event's item, or
    without the offsets, gives other scores."""
    from nestpipe.trainer.evaluate import next_item_candidates
    from nestpipe.trainer.models.common import ITEM_BIAS_COLUMNS

    ranker = Ranker.from_run(run)
    model, w, s = ranker.model, 0.5, 0.7
    assert model.transition == w and model.item_bias == s
    assert ranker.tables["item"].shape[1] == 4 * model.dim + ITEM_BIAS_COLUMNS
    rng = np.random.default_rng(9)
    events = ranker._events(_events(rng, 5))
    cands = list(range(0, 300, 5))
    rows = ranker._token_rows(events)
    hidden = model.encode(model.token_inputs(rows), torch.tensor([len(events)]),
                          torch.from_numpy(events.time.astype(np.int64)))[-1]
    table = ranker.tables["item"]
    d = model.dim
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)
    cand_rows = table[torch.tensor(cands)]

    def formula(frm_row, offsets=True):
        cos = unit(cand_rows[:, d:2 * d]) @ unit(hidden)
        score = (cos + w * unit(cand_rows[:, 3 * d:4 * d]) @ unit(frm_row[2 * d:3 * d])) / model.cfg.temperature
        return score + s * cand_rows[:, 4 * d] if offsets else score

    got = ranker.full_scores(events, cands)
    _close(got, formula(rows["item"][-1]).detach().numpy())
    with pytest.raises(AssertionError):
        _close(got, formula(rows["item"][0]).detach().numpy())
    with pytest.raises(AssertionError):
        _close(got, formula(rows["item"][-1], offsets=False).detach().numpy())
    query = unit(model.queries(hidden[None], rows["item"][-1:]))
    evaluated = next_item_candidates(model, cand_rows) @ torch.cat([query, query.new_ones(1, 1)], dim=1)[0]
    _close(got, evaluated.detach().numpy())


def test_eviction_recomputes_the_same_scores(run):
    rng = np.random.default_rng(2)
    ranker = Ranker.from_run(run, cache_mb=1.0)
    one = ranker.prefill(1, _events(rng, 5))
    entry = ranker.cache.get(1).nbytes
    ranker.cache.capacity = entry  # room for one user's prefix only
    cands = [3, 5, 8, 13]
    before, how = ranker.rank(1, [], cands)
    assert one["cache"] == "miss" and how == "hit"
    ranker.prefill(2, _events(rng, 5))  # evicts user 1
    assert ranker.cache.get(1) is None and ranker.cache.stats()["evictions"] == 1
    after, how = ranker.rank(1, [], cands)
    assert how == "miss"
    _close(after, before)


def test_requests_are_checked(run):
    ranker = Ranker.from_run(run)
    with pytest.raises(KeyError, match="send events"):
        ranker.rank(99, [], [1, 2])
    with pytest.raises(ValueError, match="missing 'action'"):
        ranker.prefill(3, [{"item_id": 1, "time_ms": 0}])
    with pytest.raises(ValueError, match="item_id must be an integer"):
        ranker.prefill(3, [{"item_id": "x", "action": 0, "time_ms": 0}])


def test_http_service_prefill_rank_and_errors(run):
    from fastapi.testclient import TestClient

    from nestpipe.serving.server import create_app

    ranker = Ranker.from_run(run)
    client = TestClient(create_app(ranker))
    rng = np.random.default_rng(3)
    first = _events(rng, 4)
    r = client.post("/v1/prefill", json={"user_id": 5, "events": first})
    assert r.status_code == 200 and r.json() == {"cache": "miss", "events": 4}
    new = _events(rng, 2)
    r = client.post("/v1/rank", json={"user_id": 5, "events": new, "candidates": [1, 2, 3]})
    assert r.status_code == 200 and r.json()["cache"] == "hit"
    _close(r.json()["scores"], ranker.full_scores(first + new, [1, 2, 3]))
    r = client.post("/v1/rank", json={"user_id": 6, "events": [], "candidates": [1]})
    assert r.status_code == 404 and "send events" in r.json()["detail"]
    r = client.post("/v1/rank", json={"user_id": 5, "events": [{"action": 1}], "candidates": [1]})
    assert r.status_code == 422 and "item_id" in r.text
    stats = client.get("/v1/stats").json()
    assert stats["requests"] == {"miss": 1, "hit": 1} and stats["cache"]["users"] == 1


def test_bad_requests_are_refused_naming_the_rule(run):
    from fastapi.testclient import TestClient

    from nestpipe.serving.server import MAX_CANDIDATES, create_app

    ranker = Ranker.from_run(run)
    client = TestClient(create_app(ranker))
    ok = {"item_id": 1, "action": 0, "time_ms": 10}
    cases = [
        ({"user_id": 1, "events": [ok], "candidates": [1], "extra": 1}, "extra"),
        ({"user_id": 1, "events": [dict(ok, item_id=1.5)], "candidates": [1]}, "item_id"),
        ({"user_id": "1", "events": [ok], "candidates": [1]}, "user_id"),
        ({"user_id": 1, "events": [ok], "candidates": []}, "candidates"),
        ({"user_id": 1, "events": [ok], "candidates": list(range(MAX_CANDIDATES + 1))}, "candidates"),
        ({"user_id": 1, "events": [dict(ok, action=-1)], "candidates": [1]}, "action"),
        ({"user_id": 1, "events": [ok, dict(ok, time_ms=5)], "candidates": [1]}, "out of time order"),
    ]
    for body, word in cases:
        r = client.post("/v1/rank", json=body)
        assert r.status_code == 422 and word in r.text, (body, r.status_code, r.text[:300])
    r = client.post("/v1/rank", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    # nothing of the refused requests was stored, and the service still answers
    assert ranker.history == {}
    r = client.post("/v1/rank", json={"user_id": 1, "events": [ok], "candidates": [1, 2]})
    assert r.status_code == 200 and len(r.json()["scores"]) == 2
    r = client.post("/v1/rank", json={"user_id": 1, "events": [dict(ok, time_ms=9)], "candidates": [1]})
    assert r.status_code == 422 and "before the previous event's 10" in r.text


def _post(url, body):
    import urllib.error

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.contextmanager
def _serving(run, *extra, timeout=120):
    """``nestpipe serve --run RUN --port FREE *extra`` as a subprocess: yields ``(process, base url)`` once it
    answers ``/healthz``; on leaving, SIGTERM and a clean exit (status 0) are required."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nestpipe", "serve", "--run", run, "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            try:
                urllib.request.urlopen(base + "/healthz", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError(f"server did not start: {proc.stderr.read()[-2000:]}")
                time.sleep(0.3)
        yield proc, base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, proc.stderr.read()[-2000:]


def test_serve_command_end_to_end(run):
    """`nestpipe serve` as a subprocess on a free port: prefill and rank over HTTP give the offline model's scores,
    the 4xx paths answer, and SIGTERM stops it cleanly."""
    with _serving(run) as (_, base):
        rng = np.random.default_rng(9)
        first, new = _events(rng, 5), _events(rng, 2)
        assert _post(base + "/v1/prefill", {"user_id": 3, "events": first}) == (200, {"cache": "miss", "events": 5})
        code, body = _post(base + "/v1/rank", {"user_id": 3, "events": new, "candidates": [4, 40, 140]})
        assert code == 200 and body["cache"] == "hit"
        _close(body["scores"], Ranker.from_run(run).full_scores(first + new, [4, 40, 140]))
        assert _post(base + "/v1/rank", {"user_id": 4, "events": [], "candidates": [1]})[0] == 404
        assert _post(base + "/v1/rank", {"user_id": 3, "events": [], "candidates": ["a"]})[0] == 422


def test_history_survives_a_restart(run, tmp_path):
    """With a history file, a new server process (here: a new Ranker) knows the user's events: its first request
    is a miss that rebuilds the window, with the scores of the first process."""
    rng = np.random.default_rng(4)
    path = str(tmp_path / "history.sqlite")
    first = Ranker.from_run(run, history=path)
    first.prefill(11, _events(rng, 3))
    before, _ = first.rank(11, _events(rng, 2), [5, 6, 7])
    again = Ranker.from_run(run, history=path)
    after, how = again.rank(11, [], [5, 6, 7])
    assert how == "miss"
    _close(after, before)
    assert len(again.window_events(11)) == 5
    # the control: without the file the restarted ranker knows nothing of the user
    with pytest.raises(KeyError, match="send events"):
        Ranker.from_run(run).rank(11, [], [5])


def test_metrics_endpoint_speaks_prometheus(run):
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from nestpipe.serving.server import create_app

    client = TestClient(create_app(Ranker.from_run(run)))
    rng = np.random.default_rng(5)
    client.post("/v1/prefill", json={"user_id": 1, "events": _events(rng, 3)})
    client.post("/v1/rank", json={"user_id": 1, "events": [], "candidates": [1]})
    text = client.get("/metrics").text
    fam = {f.name: f for f in text_string_to_metric_families(text)}
    req = {s.labels["cache"]: s.value for s in fam["nestpipe_rank_requests"].samples if s.name.endswith("_total")}
    assert req == {"hit": 1.0, "miss": 1.0, "rebase": 0.0}
    assert fam["nestpipe_cache_bytes"].samples[0].value > 0
    counts = {s.labels["endpoint"]: s.value for s in fam["nestpipe_request_seconds"].samples
              if s.name.endswith("_count")}
    assert counts["/v1/prefill"] == 1 and counts["/v1/rank"] == 1


def test_jump_hash_is_balanced_and_moves_few_users():
    from nestpipe.serving.front import jump_hash

    users = range(20000)
    four = np.array([jump_hash(u, 4) for u in users])
    assert set(four) == {0, 1, 2, 3} and np.bincount(four).min() > 4500
    five = np.array([jump_hash(u, 5) for u in users])
    moved = four != five
    assert (five[moved] == 4).all() and 0.15 < moved.mean() < 0.25  # only to the new replica, about 1/5 of users


def test_replicas_keep_users_on_one_cache_and_survive_a_replica_dying(run):
    """`nestpipe serve --replicas 2`: a user's second request is a hit (affinity); after its replica is killed the
    front's watcher restarts it, and the user's next request is a miss rebuilt from the history with the same
    scores; the replicas share one memory-mapped copy of the model."""
    from nestpipe.serving.front import jump_hash

    with _serving(run, "--replicas", "2") as (proc, base):
        rng = np.random.default_rng(12)
        users = [1, 2, 3, 4]
        assert {jump_hash(u, 2) for u in users} == {0, 1}  # both replicas serve someone
        first = {}
        for u in users:
            assert _post(base + "/v1/prefill", {"user_id": u, "events": _events(rng, 4)})[1]["cache"] == "miss"
            code, body = _post(base + "/v1/rank", {"user_id": u, "events": [], "candidates": [3, 4, 5]})
            assert code == 200 and body["cache"] == "hit", body
            first[u] = body["scores"]
        stats = json.loads(urllib.request.urlopen(base + "/v1/stats").read())
        n = [sum(jump_hash(u, 2) == i for u in users) for i in range(2)]
        assert [s["requests"] for s in stats["replicas"]] == [{"miss": k, "hit": k} for k in n]
        shared = [d for d in os.listdir(os.path.join(run, "serving")) if d.startswith("shared-step-")]
        assert len(shared) == 1
        # kill the replica of user 1: the watcher restarts it; the user's history is in its file
        os.kill(_replica_pid(jump_hash(1, 2), _children(proc.pid)), signal.SIGKILL)
        code, body = _post(base + "/v1/rank", {"user_id": 1, "events": [], "candidates": [3, 4, 5]})
        assert code == 200 and body["cache"] == "miss", body
        _close(body["scores"], first[1])
        stats = json.loads(urllib.request.urlopen(base + "/v1/stats").read())
        assert stats["restarts"] == 1


def _children(pid):
    """``(pid, command line)`` of the processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid == pid:
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        out.append((int(d), f.read().replace(b"\0", b" ").decode()))
            except OSError:
                continue
    return out


def _replica_pid(index, children):
    """The pid of replica ``index``: the child whose --history names history-INDEX.sqlite."""
    for pid, args in children:
        if f"history-{index}.sqlite" in args:
            return pid
    raise AssertionError(f"no replica {index} among {children}")


def test_budgets_hold_under_a_stream_of_new_users_and_the_spill_tier_serves_hits(run, tmp_path):
    """A tiny DRAM budget and a spill tier: after every request the DRAM bytes stay within the budget and the spill
    bytes within theirs; a user whose prefix was spilled gets a hit (read back, nothing recomputed) with the scores
    of a full recompute. Control: without the spill tier the same request is a miss."""
    rng = np.random.default_rng(6)
    spill = str(tmp_path / "spill")
    ranker = Ranker.from_run(run, cache_mb=1.0, spill_dir=spill, spill_mb=1.0)
    ranker.prefill(0, _events(rng, 6))
    one = ranker.cache.get(0).nbytes
    ranker.cache.capacity = 2 * one  # two users' prefixes in DRAM
    ranker.cache.spill.capacity = 5 * one  # five more on disk
    for u in range(1, 40):
        ranker.prefill(u, _events(rng, 6))
        st = ranker.cache.stats()
        assert st["bytes"] <= st["capacity_bytes"] and st["spilled_bytes"] <= st["spill_capacity_bytes"], st
    assert st["spill_evictions"] > 0 and len(os.listdir(spill)) == 2 * st["spilled_users"]
    spilled = next(iter(ranker.cache.spill.items))  # the oldest user still on disk
    cands = [1, 2, 3, 9]
    scores, how = ranker.rank(spilled, _events(rng, 1), cands)
    assert how == "hit" and ranker.cache.stats()["spill_reads"] == 1
    _close(scores, ranker.full_scores(ranker.window_events(spilled), cands))
    plain = Ranker.from_run(run, cache_mb=1.0)
    plain.history[spilled] = ranker.history[spilled]
    assert plain.rank(spilled, [], cands)[1] == "miss"


def test_an_overloaded_server_refuses_at_once_with_503_and_a_reason():
    """serving/admission.py, on a real uvicorn server: with --max-in-flight 1 a second request while one is in
    service gets 503, the reason and Retry-After at once (it is not queued); GET endpoints are never refused.
    Control: with a limit of 2 both are served."""
    import asyncio
    import threading

    import uvicorn
    from fastapi import FastAPI

    from nestpipe.serving.admission import Admission

    def serve(limit):
        app, gate = FastAPI(), threading.Event()
        adm = Admission(limit)
        adm.install(app)

        @app.post("/v1/rank")
        async def rank():
            while not gate.is_set():
                await asyncio.sleep(0.01)
            return {"ok": True}

        @app.get("/healthz")
        def health():
            return {"ok": True}

        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.01)
        return f"http://127.0.0.1:{port}", gate, adm, server

    for limit in (1, 2):
        base, gate, adm, server = serve(limit)
        got = {}
        first = threading.Thread(target=lambda: got.update(first=_post(base + "/v1/rank", {})))
        first.start()
        while adm.in_flight < 1:
            time.sleep(0.01)
        second = threading.Thread(target=lambda: got.update(second=_post(base + "/v1/rank", {})))
        second.start()
        if limit == 1:
            second.join(timeout=5)  # answered while the first is still held
            assert not second.is_alive() and adm.in_flight == 1
        else:
            while adm.in_flight < 2:
                time.sleep(0.01)
        assert json.loads(urllib.request.urlopen(base + "/healthz", timeout=5).read()) == {"ok": True}
        gate.set()
        first.join()
        second.join()
        server.should_exit = True
        assert got["first"][0] == 200
        if limit == 1:
            code, body = got["second"]
            assert code == 503 and "overloaded" in body["detail"] and "--max-in-flight" in body["detail"]
            assert adm.refused == 1
        else:
            assert got["second"][0] == 200 and adm.refused == 0
    with pytest.raises(ValueError, match="--max-in-flight must be >= 1"):
        Admission(0)


def test_the_front_retries_only_what_was_not_sent_and_answers_503_with_a_reason():
    """front._forward against replicas that fail in each way: refused connections (restarting) and connections
    dropped before any answer are retried until the replica answers (or 503 once retry_s is spent); an answer cut
    short and a replica that never answers are not sent again (the replica had the request) but answered with 503
    and the reason. Before, the cut answer escaped as a 500 without a reason."""
    import socket
    import threading

    from fastapi import HTTPException

    from nestpipe.serving.front import _forward

    def read_request(conn):
        """The whole request (headers, then Content-Length bytes of body): answering before it is all read makes
        the client's send fail instead, which is the not-sent case."""
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        n = int(next(x.split(b":")[1] for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")))
        while len(body) < n:
            body += conn.recv(65536)

    def replica(behaviour):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        seen = []

        def loop():
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                read_request(conn)
                seen.append(1)
                if behaviour == "cut":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
                elif behaviour == "ok":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                elif behaviour == "silent":
                    time.sleep(1.5)
                conn.close()

        threading.Thread(target=loop, daemon=True).start()
        return f"http://127.0.0.1:{srv.getsockname()[1]}/v1/rank", srv, seen

    for behaviour, words in (("cut", "IncompleteRead"), ("silent", "timed out")):
        url, srv, seen = replica(behaviour)
        with pytest.raises(HTTPException) as e:
            _forward(url, b"{}", timeout=0.5, retry_s=5)
        srv.close()
        assert e.value.status_code == 503 and words in e.value.detail and "may have been applied" in e.value.detail
        assert len(seen) == 1, behaviour  # sent once, not again
    url, srv, seen = replica("drop")  # closed without a byte of answer: sent again until retry_s is spent
    with pytest.raises(HTTPException) as e:
        _forward(url, b"{}", timeout=0.5, retry_s=0.6)
    srv.close()
    assert e.value.status_code == 503 and "unavailable" in e.value.detail and len(seen) >= 2
    # nothing listening yet: retried until the replica is up, then answered
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/rank"
    later = threading.Timer(0.5, lambda: started.append(replica_on(port)))
    started = []

    def replica_on(p):
        srv = socket.socket()
        srv.bind(("127.0.0.1", p))
        srv.listen(8)

        def one():
            conn, _ = srv.accept()
            read_request(conn)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            conn.close()
            srv.close()
        threading.Thread(target=one, daemon=True).start()
        return srv

    later.start()
    r = _forward(url, b"{}", timeout=5, retry_s=10)
    assert r.status_code == 200 and r.body == b"{}"
    with pytest.raises(HTTPException) as e:  # and never up: 503 once retry_s is spent
        _forward(f"http://127.0.0.1:{free_port()}/v1/rank", b"{}", timeout=1, retry_s=0.5)
    assert e.value.status_code == 503 and "unavailable" in e.value.detail
