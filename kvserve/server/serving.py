"""Running the server: ``serve`` (uvicorn in this process until a signal) and ``BackgroundServer`` (a
thread on a free loopback port).

Shutdown (SIGTERM or SIGINT): new requests get 503 at once, in-flight ones get ``shutdown_grace_period_s`` to
finish and are then aborted (they end with finish_reason "abort"), and the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from dataclasses import replace
from types import FrameType

import uvicorn
from fastapi import FastAPI

from kvserve.async_engine import AsyncEngine
from kvserve.config import EngineConfig
from kvserve.engine import Engine
from kvserve.errors import ConfigError
from kvserve.server.app import AppState, build_app
from kvserve.server.live_stats import compute_model
from kvserve.serving_config import ServerConfig

logger = logging.getLogger(__name__)

# The engine thread takes the GIL back after every kernel (hundreds of times a step) while the HTTP thread
# writes the streams; a waiting thread only asks the holder to let go after the switch interval (5 ms by
# default), so a short one keeps steps from waiting on it (benchmarks/server_step_profile.py times the
# server's steps); an engine process of its own would remove the wait altogether.
SERVE_GIL_SWITCH_INTERVAL_S = 0.0001


class _GracefulServer(uvicorn.Server):
    """uvicorn, with a drain before the shutdown: the first SIGTERM/SIGINT refuses new requests and
    waits (up to the grace period) for in-flight ones; a second one stops at once."""

    def __init__(self, config: uvicorn.Config, state: AppState, grace_s: float) -> None:
        super().__init__(config)
        self._state = state
        self._grace_s = grace_s
        self._drain_requested = False
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn re-raises those after shutdown, and the process would
        # then die by the signal (status 143) instead of exiting cleanly with 0.
        if self._drain_requested:
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        logger.warning("signal %d: draining (grace period %.1fs)", sig, self._grace_s)
        self._drain_requested = True
        self._state.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        await self._state.drain(self._grace_s)
        self.should_exit = True


def served_names(engine: Engine, server_config: ServerConfig) -> tuple[str, ...]:
    """The model names clients may send, the one responses carry first: --served-model-name, else what --model
    said (a path or a known name)."""
    return server_config.served_model_name or (engine.config.model.model or engine.model_path.stem,)


def build_server(engine_config: EngineConfig, server_config: ServerConfig) -> tuple[Engine, AsyncEngine, FastAPI]:
    """The model loaded, its engine thread started, and the OpenAI app over it: what every way of serving
    shares (``serve``, ``BackgroundServer``, a Ray Serve replica). The caller shuts the engine down."""
    engine = Engine(engine_config)
    async_engine = AsyncEngine(engine, max_waiting_requests=server_config.max_waiting_requests)
    try:
        app = build_app(async_engine, server_config, engine.tokenizer, model_names=served_names(engine, server_config),
                        max_model_len=engine.max_model_len, model_root=str(engine.model_path),
                        compute=compute_model(engine, server_config.hardware))
    except BaseException:  # a configuration the app refuses: the engine thread does not outlive it
        engine.close(persist=async_engine.shutdown())
        raise
    return engine, async_engine, app


def bound_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening: connections are refused until the server runs), so
    that an address in use is found before the model loads, not minutes later."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", "port") from None
    return sock


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Load the model, start the engine thread and serve until SIGTERM/SIGINT. Returns the exit status."""
    sock = bound_socket(server_config.host, server_config.port)
    try:
        engine, async_engine, app = build_server(engine_config, server_config)
    except BaseException:
        sock.close()
        raise
    uv_config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                               log_level=server_config.uvicorn_log_level,
                               lifespan="off", timeout_graceful_shutdown=2)
    server = _GracefulServer(uv_config, app.state.kvserve, server_config.shutdown_grace_period_s)
    logger.info("serving %s on http://%s:%d", ", ".join(served_names(engine, server_config)), server_config.host,
                server_config.port)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        engine.close(persist=async_engine.shutdown())
    return 0 if server.started else 1


class BackgroundServer:
    """The server on a free loopback port in a thread of this process (``kvserve trace --in-process``)."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig | None = None) -> None:
        config = server_config or ServerConfig()
        if config.port == 0 or server_config is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                config = replace(config, host="127.0.0.1", port=s.getsockname()[1])
        self.engine, self.async_engine, app = build_server(engine_config, config)
        self._server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, name="kvserve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        self.base_url = f"http://{config.host}:{config.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.engine.close(persist=self.async_engine.shutdown())
