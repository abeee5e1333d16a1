"""The HTTP service of ``nestpipe serve``: a FastAPI application around one :class:`~nestpipe.serving.Ranker`.

FastAPI (on Starlette and pydantic) validates the JSON bodies against typed models and answers malformed requests
with 422 and the field at fault, and uvicorn serves it (HTTP/1.1, keep-alive, graceful shutdown): both widely used
and maintained, so the service needs no HTTP code of its own. Endpoints:

- ``POST /v1/prefill`` ``{"user_id", "events": [{"item_id", "action", "time_ms"}, ...]}`` -> ``{"cache", "events"}``
- ``POST /v1/rank`` ``{"user_id", "events": [...new events, may be empty...], "candidates": [item ids]}`` ->
  ``{"scores": [...], "cache": "hit" | "miss"}``; 404 for a user with no stored history and no events
- ``GET /v1/stats``: users, hits and misses, the cache's bytes and evictions; ``GET /healthz``.
"""

from __future__ import annotations

from typing import List, Optional

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field, StrictInt

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


def create_app(ranker: Ranker) -> FastAPI:
    app = FastAPI(title="NestPipe ranking", description="HSTU scores with each user's prefix K/V kept resident")

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
        return ranker.stats()

    @app.get("/healthz")
    def health():
        return {"ok": True}

    return app
