"""Admission control of the ranking service (``nestpipe serve``, its replicas and the front): a bound on the requests
in service, beyond which a request is refused at once with 503, its reason and ``Retry-After``."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

MAX_IN_FLIGHT = 64  # ranking requests in service at once, per replica (--max-in-flight)


class Admission:
    """At most ``limit`` POST ``/v1/*`` requests in service at once (one event loop: no lock); the next ones get 503
    with the reason and ``Retry-After: 1``. ``refused`` counts them (``/v1/stats``)."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"--max-in-flight must be >= 1, got {limit}")
        self.limit, self.in_flight, self.refused = limit, 0, 0

    def install(self, app: FastAPI) -> None:
        @app.middleware("http")
        async def admit(request, call_next):
            if request.method != "POST" or not request.url.path.startswith("/v1/"):
                return await call_next(request)
            if self.in_flight >= self.limit:
                self.refused += 1
                return JSONResponse({"detail": f"overloaded: {self.in_flight} requests in service, the limit is "
                                               f"{self.limit} (--max-in-flight); retry later"},
                                    status_code=503, headers={"Retry-After": "1"})
            self.in_flight += 1
            try:
                return await call_next(request)
            finally:
                self.in_flight -= 1
