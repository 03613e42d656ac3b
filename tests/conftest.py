"""Fixtures shared by every test directory: a real redis-server on a free loopback port, a spy on the sockets
to one port (how often a client reaches the network, and with which timeout), and the default model with
transformers' own load of it (one per session: the loader tests and the end-to-end tests share it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis


@dataclass(slots=True)
class SocketCall:
    op: str  # "connect", "send" or "recv"
    timeout: float | None  # the socket's timeout when the call began (None: it could block forever)
    timed_out: bool = False


class SocketSpy:
    """Every connect, send and read this process makes to one loopback port, with the socket's timeout.

    Tests assert on these instead of timing a call: a client that retries shows a second connect or a
    second timed-out read; a call that short-circuits adds nothing. A call on a socket without a timeout
    (one that could block forever) fails the test at once instead of hanging it.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.calls: list[SocketCall] = []

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch, port: int) -> SocketSpy:
        spy = cls(port)
        for name, op in (("connect", "connect"), ("sendall", "send"), ("send", "send"), ("recv", "recv"),
                         ("recv_into", "recv")):
            monkeypatch.setattr(socket.socket, name, spy._wrap(getattr(socket.socket, name), op))
        return spy

    def _watches(self, sock: socket.socket, op: str, args: tuple[object, ...]) -> bool:
        if op == "connect":
            address = args[0]
            return isinstance(address, tuple) and address[1] == self.port
        try:
            return sock.getpeername()[1] == self.port
        except (OSError, IndexError, TypeError):
            return False

    def _wrap(self, real: Callable[..., object], op: str) -> Callable[..., object]:
        def spied(sock: socket.socket, *args: object, **kwargs: object) -> object:
            if not self._watches(sock, op, args):
                return real(sock, *args, **kwargs)
            call = SocketCall(op, sock.gettimeout())
            self.calls.append(call)
            if call.timeout is None:
                raise AssertionError(f"{op} to port {self.port} on a socket without a timeout")
            try:
                return real(sock, *args, **kwargs)
            except TimeoutError:
                call.timed_out = True
                raise

        return spied

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def connects(self, since: int = 0) -> list[float | None]:
        """The timeout of each connect attempt (from call number ``since`` on)."""
        return [c.timeout for c in self.calls[since:] if c.op == "connect"]

    def num_timed_out(self, since: int = 0) -> int:
        return sum(c.timed_out for c in self.calls[since:])

    def bounded_by(self, timeout_s: float, since: int = 0) -> bool:
        """Whether every call (from ``since`` on) could wait at most ``timeout_s``."""
        return all(c.timeout is not None and c.timeout <= timeout_s for c in self.calls[since:])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process on 127.0.0.1; ``kill()`` then ``start()`` restarts it on the same port."""

    def __init__(self, binary: str, port: int, workdir: Path) -> None:
        self.binary = binary
        self.port = port
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        with open(self.workdir / "redis.log", "ab") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.workdir), "--daemonize", "no"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {(self.workdir / 'redis.log').read_text()[-2000:]}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout_s} s")
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL by PID: the server vanishes mid-run without a clean shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found (install it: apt-get install -y redis-server)")
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(binary, free_port(), workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from kvserve.model.loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def hf_reference(default_model_path: Path):
    """transformers' own GGUF loader (independent dequantisation and Q/K un-permutation), float32."""
    from tests.support.transformers_gguf import hf_from_gguf

    return hf_from_gguf(default_model_path)
