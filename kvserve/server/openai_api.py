"""The OpenAI-compatible HTTP server, and the names its callers use: ``build_app``, ``serve``,
``BackgroundServer``.

One HTTP request becomes one engine request per (prompt, sample)::

    POST /v1/chat/completions ── gate (middleware.py: API key, shutdown, body size)
        ── validate (pydantic, SamplingParams) ── chat template ── tokenize            (app.py)
        ── AsyncEngine.prepare (context check) ── RequestRun (request_run.py): one AsyncEngine.generate per
           prompt × n
        ── wait for every engine request's first output (admission errors become 4xx/5xx, not a
           broken stream) ── SSE chunks as outputs arrive, or one JSON body at the end  (responses.py)

A client that disconnects (mid-stream or while waiting for a JSON body) cancels its RequestRun, which
closes its generators, which aborts its engine requests: their KV blocks are freed at the next step.
Errors become OpenAI error bodies in middleware.py; serving.py runs uvicorn and drains on shutdown.
"""

from __future__ import annotations

from kvserve.server.app import build_app
from kvserve.server.serving import BackgroundServer, serve

__all__ = ["BackgroundServer", "build_app", "serve"]
