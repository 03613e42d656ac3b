"""Running the gateway: ``run_router`` (``kvserve route``: checks the replicas, then serves until a signal)
and ``ReplicaProcesses`` (``kvserve serve --replicas N``: N engine processes on loopback behind it).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import uvicorn

from kvserve.errors import ConfigError
from kvserve.router.gateway import Gateway, build_router_app
from kvserve.serving_config import RouterConfig

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def run_router(config: RouterConfig) -> int:
    """Check every replica (ConfigError if one is not an OpenAI server or never answers), then serve."""
    return asyncio.run(_serve(config))


async def _serve(config: RouterConfig) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # else a line per health check and request
    gateway = Gateway(config)
    try:
        await gateway.start()
        app = build_router_app(gateway)
        server = _Server(uvicorn.Config(app, host=config.host, port=config.port, lifespan="off",
                                        log_level=config.uvicorn_log_level,
                                        timeout_graceful_shutdown=config.shutdown_grace_period_s))
        logger.info("routing on http://%s:%d to %s (%s)", config.host, config.port, ", ".join(config.replicas),
                    config.policy)
        await server.serve()
        return 0 if server.started else 1
    finally:
        await gateway.stop()


class _Server(uvicorn.Server):
    """uvicorn, exiting with status 0 on SIGTERM/SIGINT: the signal is not recorded for uvicorn to raise again
    after shutdown (the process would die by it, before stopping its replicas). A second signal stops at once."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


class ReplicaProcesses:
    """``kvserve serve`` processes on free loopback ports, each with its share of the CPU threads; stopped
    by PID (SIGTERM, then SIGKILL)."""

    def __init__(self, serve_args: Sequence[str], num_replicas: int, threads_each: int) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        for i in range(num_replicas):
            port = free_port()
            args = [sys.executable, "-m", "kvserve.cli", "serve", *disk_dir_of_replica(serve_args, i), "--host",
                    "127.0.0.1", "--port", str(port), "--num-threads", str(threads_each)]
            self.procs.append(subprocess.Popen(args, preexec_fn=die_with_parent))
            self.urls.append(f"http://127.0.0.1:{port}")

    def wait_until_listening(self, poll_s: float = 0.25) -> None:
        """Return once every replica accepts connections (a server listens once its model is loaded, however
        long that takes); ConfigError as soon as one has exited instead (its own error is on stderr above)."""
        waiting = dict(enumerate(self.urls))
        while waiting:
            for index, url in list(waiting.items()):
                code = self.procs[index].poll()
                if code is not None:
                    raise ConfigError(f"replica {index} ({url}) exited with status {code} before serving; its "
                                      f"error is above", "replicas")
                host, port = url.removeprefix("http://").rsplit(":", 1)
                try:
                    socket.create_connection((host, int(port)), timeout=1.0).close()
                    del waiting[index]
                except OSError:
                    pass
            if waiting:
                time.sleep(poll_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def run_on_ray(address: str, serve_args: Sequence[str], num_replicas: int, threads_each: int,
               config: RouterConfig) -> int:
    """``kvserve ray``: deploy on the Ray cluster at ``address`` (kvserve/ray_app.py, run as a driver process of
    its own), wait for SIGTERM or SIGINT, then delete the application. 2 when a driver fails."""
    stop = threading.Event()

    def on_signal(sig: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    arguments = {"address": address, "serve_args": list(serve_args), "num_replicas": num_replicas,
                 "threads_each": threads_each, "router": policy_settings(config)}
    try:
        if _ray_driver("deploy", arguments) != 0:
            return 2
        logger.warning("kvserve on Ray Serve: http://%s:%d (%d replicas)", config.host, config.port, num_replicas)
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        _ray_driver("teardown", {"address": address})
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def policy_settings(config: RouterConfig) -> dict[str, Any]:
    """Every RouterConfig field but the replicas (which Ray Serve knows itself), as JSON-able keywords."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "replicas"}


def _ray_driver(command: str, arguments: dict[str, object]) -> int:
    return subprocess.run([sys.executable, "-m", "kvserve.ray_app", command, json.dumps(arguments)]).returncode


def die_with_parent() -> None:
    """In a replica, before it runs: on Linux, SIGTERM when the gateway's process ends, however it ends (a
    SIGKILL leaves it no time to stop its replicas)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def threads_per_replica(num_replicas: int, num_threads: int | None) -> int:
    """The machine's cores (or ``--num-threads``) shared evenly, at least one each."""
    total = num_threads or len(os.sched_getaffinity(0))
    return max(1, total // num_replicas)


def disk_dir_of_replica(argv: Sequence[str], index: int) -> list[str]:
    """``argv`` with its ``--kv-disk-dir DIR`` made ``DIR/replica-<index>``: a disk tier's directory has one
    owner (its index lives in that process; each would evict the other's files and count its own capacity
    only), and a replica restarted with the same index finds its entries again."""
    out = list(argv)
    for k, arg in enumerate(out):
        if arg == "--kv-disk-dir" and k + 1 < len(out):
            out[k + 1] = os.path.join(out[k + 1], f"replica-{index}")
        elif arg.startswith("--kv-disk-dir="):
            out[k] = "--kv-disk-dir=" + os.path.join(arg.split("=", 1)[1], f"replica-{index}")
    return out


def without_options(argv: Sequence[str], names: Sequence[str]) -> list[str]:
    """``argv`` less each ``--name value`` / ``--name=value`` of ``names``."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in names:
            skip = "=" not in arg
            continue
        kept.append(arg)
    return kept


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
