"""A real ``kvserve serve`` process on a free loopback port, shared by the server tests of a session."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.sampling_params import SamplingParams
from kvserve.server.serving import build_server
from kvserve.serving_config import ServerConfig
from tests.support.tiny_models import make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]

# The engine options of the shared server; the offline LLM of the comparison test uses the same ones.
ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "512",
               "--max-num-batched-tokens", "1024", "--max-num-seqs", "64"]
# The shared server also speculates (n-gram drafts); the offline LLM does not. Speculation is exact, so every
# server test holds either way, and the comparison test checks that it changes no output (float32: no
# bf16 rounding for the batch shape to move).
SPECULATIVE_ARGS = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "adaptive": false}']
LLM_KWARGS = {"dtype": "float32", "num_kv_blocks": 256, "max_model_len": 512, "max_num_batched_tokens": 1024,
              "max_num_seqs": 64}
MAX_MODEL_LEN = 512
BLOCK_SIZE = 16

QUESTIONS = [
    "What is 17 times 23?",
    "Write a haiku about autumn leaves.",
    "Name three prime numbers.",
    "What colour is the sky?",
    "Say hello in French.",
    "What is the capital of Italy?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
    "The three primary colours are",
    "import numpy as np\n",
    "The quick brown fox",
    "Water boils at",
    "My favourite programming language is",
]
MAX_TOKENS = 10


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m kvserve.cli serve`` (or another serving ``command``: ``route``) in a subprocess; stopped by
    PID (SIGTERM, then SIGKILL)."""

    def __init__(self, extra_args: list[str], log_path: Path, port: int | None = None,
                 command: str = "serve") -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        args = [sys.executable, "-m", "kvserve.cli", command, "--host", "127.0.0.1", "--port", str(self.port),
                "--uvicorn-log-level", "warning", *extra_args]
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self._log.close()


@pytest.fixture(scope="session")
def server_process(tmp_path_factory: pytest.TempPathFactory):
    """Started, not yet waited for: fixtures that load models in-process overlap with its start-up."""
    server = ServerProcess(ENGINE_ARGS + SPECULATIVE_ARGS, tmp_path_factory.mktemp("server") / "server.log")
    yield server
    server.stop()
    assert "Traceback" not in server.log_tail(10**7), server.log_tail()


@pytest.fixture(scope="session")
def offline_texts(server_process: ServerProcess) -> tuple[list[str], list[str]]:
    """Greedy outputs of the offline LLM with the server's engine options, for the comparison test.

    Computed while the server process loads its model (both are mostly single-threaded start-up work).
    """
    from kvserve.offline import LLM

    llm = LLM(**LLM_KWARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chats = [o.outputs[0].text for o in llm.chat([chat(q) for q in QUESTIONS], params)]
    completions = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    return chats, completions


@pytest.fixture(scope="session")
def server(server_process: ServerProcess, offline_texts: tuple[list[str], list[str]]) -> ServerProcess:
    server_process.wait_ready()
    return server_process


@pytest.fixture(scope="session")
def base_url(server: ServerProcess) -> str:
    return server.base_url


def metric_value(base_url: str, name: str, labels: str = "") -> float:
    """One sample of /metrics, e.g. metric_value(url, "kvserve:request_success_total", 'finished_reason="abort"')."""
    text = httpx.get(f"{base_url}/metrics", timeout=5.0).text
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{wanted} not in /metrics")


@pytest.fixture(scope="session")
def tiny_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The OpenAI app over a tiny random model, to call in-process (tests/support/app_calls.py), with the
    priority scheduling policy."""
    model = make_tiny_model(tmp_path_factory.mktemp("tiny_app"), "llama")
    config = EngineConfig(model=ModelConfig(model=str(model), dtype="float32", show_progress=False, max_model_len=256),
                          cache=CacheConfig(num_kv_blocks=32),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, policy="priority"))
    engine, async_engine, app = build_server(config, ServerConfig(served_model_name="tiny"))
    yield app
    async_engine.shutdown()
    engine.close()
