"""The HTTP service of ``nestpipe serve``: a FastAPI application around one :class:`~nestpipe.serving.Ranker`.

FastAPI (on Starlette and pydantic) validates the JSON bodies against typed models and answers malformed requests
with 422 and the field at fault, and uvicorn serves it (HTTP/1.1, keep-alive, graceful shutdown): both widely used
and maintained, so the service needs no HTTP code of its own. Endpoints:

- ``POST /v1/prefill`` ``{"user_id", "events": [{"item_id", "action", "time_ms"}, ...]}`` -> ``{"cache", "events"}``
- ``POST /v1/rank`` ``{"user_id", "events": [...new events, may be empty...], "candidates": [item ids]}`` ->
  ``{"scores": [...], "cache": "hit" | "miss"}``; 404 for a user with no stored history and no events
- ``GET /v1/stats``: users, hits and misses, the cache's bytes and evictions; ``GET /healthz``;
- ``GET /metrics``: the same in Prometheus text format (prometheus_client), with latency histograms per endpoint.

Admission (:class:`Admission`): at most ``--max-in-flight`` ranking requests are in service at once; the next one is
answered at once with 503, a reason and ``Retry-After``, so an overloaded server keeps the latency of what it admits
bounded instead of queueing everything until nobody is answered in time.
"""

from __future__ import annotations

from typing import List, Optional

import time

from fastapi import FastAPI, HTTPException
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from nestpipe.serving.admission import MAX_IN_FLIGHT, Admission
from nestpipe.serving.ranker import Ranker

MAX_CANDIDATES = 10_000  # per request: a larger list is a 422 (score it in several requests)
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 422 that names it


class Event(_Strict):
    item_id: StrictInt
    action: StrictInt = Field(ge=0)
    time_ms: StrictInt
    author_id: Optional[StrictInt] = None


class PrefillRequest(_Strict):
    user_id: StrictInt
    events: List[Event] = Field(default_factory=list)


class RankRequest(_Strict):
    user_id: StrictInt
    events: List[Event] = Field(default_factory=list)
    candidates: List[StrictInt] = Field(min_length=1, max_length=MAX_CANDIDATES)


class _RankerCollector:
    """The ranker's counters and the cache's gauges, read at every scrape."""

    def __init__(self, ranker: Ranker):
        self.ranker = ranker

    def collect(self):
        st = self.ranker.stats()
        req = CounterMetricFamily("nestpipe_rank_requests", "prefill and rank requests by cache outcome",
                                  labels=["cache"])
        for outcome in ("hit", "miss", "rebase"):
            req.add_metric([outcome], st["requests"].get(outcome, 0))
        yield req
        c = st["cache"]
        yield CounterMetricFamily("nestpipe_cache_evictions", "prefixes evicted from the cache", value=c["evictions"])
        yield GaugeMetricFamily("nestpipe_cache_bytes", "bytes of prefix K/V resident", value=c["bytes"])
        yield GaugeMetricFamily("nestpipe_cache_capacity_bytes", "the cache's budget", value=c["capacity_bytes"])
        yield GaugeMetricFamily("nestpipe_cache_users", "users with a resident prefix", value=c["users"])
        if "spilled_bytes" in c:
            yield GaugeMetricFamily("nestpipe_spill_bytes", "bytes of prefixes in the spill tier",
                                    value=c["spilled_bytes"])
            yield GaugeMetricFamily("nestpipe_spill_capacity_bytes", "the spill tier's budget",
                                    value=c["spill_capacity_bytes"])
            yield CounterMetricFamily("nestpipe_spill_evictions", "prefixes dropped from the spill tier",
                                      value=c["spill_evictions"])
            yield CounterMetricFamily("nestpipe_spill_reads", "prefixes read back from the spill tier",
                                      value=c["spill_reads"])
        yield GaugeMetricFamily("nestpipe_users", "users with a stored history seen by this process",
                                value=st["users"])


def create_app(ranker: Ranker, max_in_flight: int = MAX_IN_FLIGHT) -> FastAPI:
    app = FastAPI(title="NestPipe ranking", description="HSTU scores with each user's prefix K/V kept resident")
    admission = Admission(max_in_flight)
    registry = CollectorRegistry()
    latency = Histogram("nestpipe_request_seconds", "request latency by endpoint", ["endpoint"], registry=registry,
                        buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
    registry.register(_RankerCollector(ranker))

    @app.middleware("http")
    async def timed(request, call_next):
        t = time.perf_counter()
        response = await call_next(request)
        latency.labels(request.url.path).observe(time.perf_counter() - t)
        return response

    admission.install(app)  # the outer middleware: a refused request is not timed as served

    @app.get("/metrics")
    def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def events(req) -> list:
        return [e.model_dump() for e in req.events]

    @app.post("/v1/prefill")
    def prefill(req: PrefillRequest):
        try:
            return ranker.prefill(req.user_id, events(req))
        except KeyError as e:
            raise HTTPException(404, str(e.args[0]))
        except ValueError as e:
            raise HTTPException(422, str(e))

    @app.post("/v1/rank")
    def rank(req: RankRequest):
        try:
            scores, how = ranker.rank(req.user_id, events(req), req.candidates)
        except KeyError as e:
            raise HTTPException(404, str(e.args[0]))
        except ValueError as e:
            raise HTTPException(422, str(e))
        return {"scores": [float(s) for s in scores], "cache": how}

    @app.get("/v1/stats")
    def stats():
        return {**ranker.stats(), "admission": {"limit": admission.limit, "in_flight": admission.in_flight,
                                                "refused": admission.refused}}

    @app.get("/healthz")
    def health():
        return {"ok": True}

    return app
