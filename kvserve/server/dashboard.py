"""The live dashboard's routes: ``GET /dashboard`` (one page, no build step, no fetch beyond this server),
its assets, and the JSON it polls (``/kvserve/stats``, ``/kvserve/stats/requests/{id}``).

The page and its pinned chart library (uPlot, vendored under static/vendor with its licence) are read
once, at start-up, from the package; only those names are served.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from kvserve.server import protocol as p

STATIC = Path(__file__).with_name("static")
ASSETS = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "vendor/uPlot-1.6.32.iife.min.js": "text/javascript",
    "vendor/uPlot-1.6.32.min.css": "text/css",
}


def add_dashboard_routes(app: FastAPI, snapshot: Callable[[], Awaitable[dict[str, Any]]],
                         trip: Callable[[str], Awaitable[dict[str, Any] | None]]) -> None:
    """``await snapshot()`` is the body of /kvserve/stats (a server's or a gateway's); ``await trip(id)``
    a recent request's trip, or None."""
    page = (STATIC / "dashboard.html").read_bytes()
    assets = {name: ((STATIC / name).read_bytes(), media_type) for name, media_type in ASSETS.items()}

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(page, media_type="text/html", headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/{name:path}", include_in_schema=False)
    async def dashboard_asset(name: str) -> Response:
        if name not in assets:
            return JSONResponse(p.error_body(f"no dashboard asset '{name}'", "not_found_error"), status_code=404)
        content, media_type = assets[name]
        return Response(content, media_type=media_type, headers={"Cache-Control": "max-age=3600"})

    @app.get("/kvserve/stats")
    async def stats() -> Response:
        """The engine and server (or the gateway and its replicas) as the dashboard draws them."""
        return JSONResponse(await snapshot(), headers={"Cache-Control": "no-store"})

    @app.get("/kvserve/stats/requests/{request_id}")
    async def request_trip(request_id: str) -> Response:
        """One recent request's trip through the pipeline: stages, prefill chunks, decode steps, preemptions."""
        found = await trip(request_id)
        if found is None:
            return JSONResponse(p.error_body(f"no recent request '{request_id}' (only the last ones are kept)",
                                             "not_found_error"), status_code=404)
        return JSONResponse(found)
