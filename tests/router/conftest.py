"""Fake OpenAI upstreams and an in-process gateway, each a real uvicorn server on a free loopback port.

A ``FakeReplica`` answers the OpenAI routes the way a replica does, or misbehaves as its ``mode`` says: 500s,
bodies that are not JSON, streams cut after their first chunk. It counts what it received and what its
clients abandoned, so a test can see that the gateway neither lost nor duplicated a request.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.router.gateway import Gateway, build_router_app
from kvserve.serving_config import RouterConfig
from tests.conftest import free_port

MODEL = "fake-model"
CHUNK_DELAY_S = 0.03


def stream_chunks(replica_name: str, num_chunks: int) -> list[bytes]:
    """The events a FakeReplica streams: one chunk per event, then [DONE]."""
    events = [{"id": "cmpl-1", "object": "text_completion", "model": MODEL,
               "choices": [{"index": 0, "text": f"{replica_name}-{i} ", "finish_reason": None}]}
              for i in range(num_chunks)]
    events.append({"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [],
                   "usage": {"prompt_tokens": 3, "completion_tokens": num_chunks, "total_tokens": 3 + num_chunks}})
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


class FakeReplica:
    """modes: ok, error_500, error_503 (an engine that died), error_429 (a full queue), text_401 (a plain-text
    refusal), not_json, not_sse, cut_stream (one chunk, then the connection drops), slow (each chunk after
    0.5 s), hang (3 s before answering)."""

    def __init__(self, name: str, num_chunks: int = 5) -> None:
        self.name = name
        self.mode = "ok"
        self.healthy = True
        self.num_chunks = num_chunks
        self.received: list[dict] = []
        self.stored: dict[str, dict] = {}  # its Responses API responses by id
        self.looked_up = 0  # GET / DELETE /v1/responses/{id} calls
        self.abandoned = 0  # streams whose client left before the end
        self.reported_running = 0  # what its /metrics says is running
        self.api_key: str | None = None  # required on /v1/models when set
        self.models_status = 200  # what /v1/models answers with (another: an error body)
        self.base_model = MODEL  # the model it serves
        self.adapters: set[str] = set()  # LoRA adapters loaded at run time: served as models of their own
        self.refuse_loads = False  # /v1/load_lora_adapter answers 400 (a path it cannot read)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.start()

    def start(self) -> None:
        self._server = uvicorn.Server(uvicorn.Config(self._app(), host="127.0.0.1", port=self.port,
                                                     log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "fake replica did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        """Closes the listening socket and every open connection, like a process that died."""
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._server.force_exit = True
        self._thread.join(timeout=10)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models(http: Request) -> Response:
            if self.models_status != 200:
                return JSONResponse({"error": {"message": "boom", "type": "internal_error"}},
                                    status_code=self.models_status)
            if self.api_key is not None and http.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse({"error": {"message": "invalid API key", "type": "authentication_error",
                                               "param": None, "code": "invalid_api_key"}}, status_code=401)
            return JSONResponse({"object": "list", "data": [{"id": m, "object": "model"}
                                                            for m in (self.base_model, *sorted(self.adapters))]})

        @app.post("/v1/load_lora_adapter")
        async def load_adapter(http: Request) -> Response:
            name = (await http.json())["lora_name"]
            if self.refuse_loads or name in self.adapters:
                return JSONResponse({"error": {"message": f"cannot load {name} on {self.name}",
                                               "type": "invalid_request_error", "param": "lora_path",
                                               "code": None}}, status_code=400)
            self.adapters.add(name)
            return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_adapter(http: Request) -> Response:
            name = (await http.json())["lora_name"]
            if name not in self.adapters:
                return JSONResponse({"error": {"message": f"the LoRA adapter '{name}' cannot be found",
                                               "type": "invalid_request_error", "param": "lora_name",
                                               "code": "model_not_found"}}, status_code=404)
            self.adapters.discard(name)
            return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

        @app.post("/tokenize")
        async def tokenize(http: Request) -> Response:
            return JSONResponse({"tokens": [1, 2], "count": 2, "max_model_len": 2048})

        @app.get("/health")
        async def health() -> Response:
            return JSONResponse({"status": "ok"}, status_code=200 if self.healthy else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(f"fake:num_requests_running {self.reported_running}\nfake:num_requests_waiting 0\n")

        @app.post("/v1/responses")
        async def respond(http: Request) -> Response:
            body = await http.json()
            self.received.append(body)
            if body.get("previous_response_id") is not None and body["previous_response_id"] not in self.stored:
                return JSONResponse({"error": {"message": "not found", "type": "invalid_request_error",
                                               "param": "previous_response_id",
                                               "code": "previous_response_not_found"}}, status_code=400)
            usage = {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 1}, "output_tokens": 2,
                     "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 5}
            answer = {"id": f"resp_{self.name}_{len(self.received)}", "object": "response", "status": "completed",
                      "model": MODEL, "usage": usage, "store": body.get("store") is not False,
                      "output": [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                                  "content": [{"type": "output_text", "text": self.name, "annotations": []}]}]}
            self.stored[answer["id"]] = answer
            if not body.get("stream"):
                return JSONResponse(answer)
            events = [{"type": "response.created", "response": {**answer, "status": "in_progress", "output": []}},
                      {"type": "response.output_text.delta", "delta": self.name},
                      {"type": "response.completed", "response": answer}]
            return StreamingResponse(iter([f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events]),
                                     media_type="text/event-stream")

        @app.get("/v1/responses/{response_id}")
        @app.delete("/v1/responses/{response_id}")
        async def stored(response_id: str, http: Request) -> Response:
            self.looked_up += 1
            if response_id not in self.stored:
                return JSONResponse({"error": {"message": "no such response", "type": "invalid_request_error"}},
                                    status_code=404)
            if http.method == "DELETE":
                del self.stored[response_id]
                return JSONResponse({"id": response_id, "object": "response", "deleted": True})
            return JSONResponse(self.stored[response_id])

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def generate(http: Request) -> Response:
            body = await http.json()
            self.received.append(body)
            if self.mode == "error_500":
                return JSONResponse({"error": {"message": "boom", "type": "internal_error"}}, status_code=500)
            if self.mode == "error_503":
                return JSONResponse({"error": {"message": "the engine died", "type": "service_unavailable",
                                               "code": "engine_dead"}}, status_code=503)
            if self.mode == "not_json":
                return Response("<html>hello</html>", media_type="text/html")
            if self.mode == "error_429":  # a full queue: refused before it ran
                return JSONResponse({"error": {"message": "queue full", "type": "rate_limit_error",
                                               "code": "too_many_requests"}}, status_code=429,
                                    headers={"retry-after": "1"})
            if self.mode == "text_401":  # a proxy in front of the replica refusing in plain text
                return Response("unauthorized", status_code=401, media_type="text/plain")
            if self.mode == "hang":  # slower than the gateway's request timeout
                await asyncio.sleep(3.0)
            if body.get("model") not in (None, MODEL, *self.adapters):
                return JSONResponse({"error": {"message": "no such model", "type": "invalid_request_error",
                                               "param": "model", "code": "model_not_found"}}, status_code=404)
            if not body.get("stream"):
                return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                                     "choices": [{"index": 0, "text": self.name, "finish_reason": "stop"}],
                                     "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                                               "prompt_tokens_details": {"cached_tokens": 2}}})
            if self.mode == "not_sse":
                return StreamingResponse(_once(b"this is not an event stream"), media_type="text/event-stream")
            return StreamingResponse(self._stream(), media_type="text/event-stream")

        return app

    async def _stream(self) -> AsyncIterator[bytes]:
        chunks = stream_chunks(self.name, self.num_chunks)
        finished = False
        try:
            for i, chunk in enumerate(chunks):
                if self.mode == "cut_stream" and i == 1:
                    raise ConnectionAbortedError("the replica died mid-stream")
                yield chunk
                await asyncio.sleep(0.5 if self.mode == "slow" else CHUNK_DELAY_S)
            finished = True
        finally:
            if not finished:
                self.abandoned += 1


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


class BackgroundGateway:
    """A Gateway and its app under uvicorn in a thread of this process."""

    def __init__(self, config: RouterConfig) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.config = RouterConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__},
                                      "port": self.port})
        self.gateway: Gateway | None = None
        self._server: uvicorn.Server | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        self._ready.wait(timeout=30)
        if self._error is not None:
            raise self._error
        assert self._server is not None, "gateway did not start"
        while not self._server.started:
            time.sleep(0.01)

    async def _main(self) -> None:
        self.gateway = Gateway(self.config)
        try:
            await self.gateway.start()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self._error = exc
            await self.gateway.stop()
            self._ready.set()
            return
        self._server = uvicorn.Server(uvicorn.Config(build_router_app(self.gateway), host="127.0.0.1",
                                                     port=self.port, log_level="warning", lifespan="off"))
        self._ready.set()
        try:
            await self._server.serve()
        finally:
            await self.gateway.stop()

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=10)


@pytest.fixture
def replicas() -> Iterator[list[FakeReplica]]:
    fakes = [FakeReplica("a"), FakeReplica("b")]
    yield fakes
    for fake in fakes:
        fake.stop()


def gateway_over(replicas: list[FakeReplica], **options: object) -> BackgroundGateway:
    settings = {"health_interval_s": 0.1, "startup_timeout_s": 5, "uvicorn_log_level": "warning", **options}
    config = RouterConfig(replicas=tuple(r.url for r in replicas), **settings)  # type: ignore[arg-type]
    return BackgroundGateway(config)
