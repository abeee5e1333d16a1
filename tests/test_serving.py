"""Online ranking (nestpipe.serving): scores from the cached prefix equal a full recompute of the same window.

Tolerance: the cached path computes attention with dense einsums over the new queries, the reference with the
trainer's jagged kernel (blocked tiles / Numba loops): the same sums in another order, so float32 rounding differs
(observed ~1e-6 on scores of magnitude ~1-10); asserted at rtol = atol = 1e-4. Negative control: a cache whose
positions are off by one fails the same comparison.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nestpipe.measure.launcher import run_plan, write_run
from nestpipe.serving import Ranker
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
                                                       "relative_bias": True}, "pipe": {"gantt_steps": 0}})
    p = run_plan([{"run": out}], 1, str(base / "plan.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _events(rng, n):
    return events_from_rows(rng.integers(0, 300, n), rng.integers(0, 64, n), np.arange(n) * 1000)


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
    assert ranker.stats()["requests"] == {"miss": 2, "hit": 5}


def test_negative_control_a_cache_off_by_one_token_breaks_equality(run):
    ranker = Ranker.from_run(run)
    rng = np.random.default_rng(1)
    cands = list(range(300))
    ranker.prefill(1, _events(rng, 4))
    good = ranker.cache.get(1)
    # the prefix's K/V without its first token, still claimed for all 4 positions (an off-by-one in the cache)
    ranker.cache.put(1, CachedPrefix(good.start, good.length, [(k[1:], v[1:]) for k, v in good.kv],
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
