"""A server with an API key, one batch slot and one waiting slot: 401, 429, then SIGTERM (503, drain, exit 0).

The tests run in file order on one server process; the last one shuts it down.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time

import httpx
import openai
import pytest

from tests.server.conftest import ServerProcess, metric_value

pytestmark = pytest.mark.slow

API_KEY = "sk-kvserve-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRACE_S = 2.0
LONG = {"prompt": "Tell me a very long story about a dragon.", "max_tokens": 900, "ignore_eos": True,
        "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory):
    server = ServerProcess(
        ["--dtype", "float32", "--num-kv-blocks", "128", "--api-key", API_KEY, "--max-num-seqs", "1",
         "--max-waiting-requests", "1", "--shutdown-grace-period", str(GRACE_S), "--served-model-name", "tiny"],
        tmp_path_factory.mktemp("limited") / "server.log",
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert "Traceback" not in server.log_tail(10**7), server.log_tail()


def test_api_key_required_on_v1_and_tokenizer_routes(limited) -> None:
    url = limited.base_url
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        resp = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert resp.status_code == 401
        error = resp.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    for route, route_body in (("tokenize", {"prompt": "Hi"}), ("detokenize", {"tokens": [1]})):
        assert httpx.post(f"{url}/{route}", json=route_body).status_code == 401
        keyed = httpx.post(f"{url}/{route}", json=route_body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert keyed.status_code == 200, keyed.text
    assert httpx.get(f"{url}/health").status_code == 200  # probes and scrapers need no key
    assert httpx.get(f"{url}/metrics").status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    assert client.models.list().data[0].id == "tiny"
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_full_waiting_queue_is_429_with_retry_after(limited) -> None:
    url = limited.base_url

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as c:
            running_started = asyncio.Event()

            async def running() -> None:  # takes the only batch slot
                async with c.stream("POST", "/v1/completions", json=LONG) as r:
                    async for _ in r.aiter_lines():
                        running_started.set()

            async def waiting() -> None:  # takes the only waiting slot (no first token while the other runs)
                await c.post("/v1/completions", json={**LONG, "stream": False})

            tasks = [asyncio.create_task(running())]
            await asyncio.wait_for(running_started.wait(), 60)
            tasks.append(asyncio.create_task(waiting()))
            deadline = time.monotonic() + 30
            while metric_value(url, "kvserve:num_requests_waiting") < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            rejected = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            for task in tasks:  # both clients leave; their requests are aborted
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return rejected

    rejected = asyncio.run(run())
    assert rejected.status_code == 429
    assert rejected.headers["Retry-After"] == "1"
    error = rejected.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_requests"
    deadline = time.monotonic() + 20
    while metric_value(url, "kvserve:kv_blocks_used") or metric_value(url, "kvserve:num_requests_waiting"):
        assert time.monotonic() < deadline, "aborted requests still hold blocks"
        time.sleep(0.1)


def test_sigterm_refuses_new_requests_drains_and_exits_0(limited) -> None:
    url = limited.base_url

    async def run() -> tuple[list[str], httpx.Response, httpx.Response, float]:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as c:
            lines: list[str] = []
            first_chunk = asyncio.Event()

            async def in_flight() -> None:
                async with c.stream("POST", "/v1/completions", json=LONG) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line[len("data: "):])
                            first_chunk.set()

            task = asyncio.create_task(in_flight())
            await asyncio.wait_for(first_chunk.wait(), 60)
            os.kill(limited.proc.pid, signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=10) as fresh:  # a new connection
                refused = await fresh.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                health = await fresh.get("/health")
            await asyncio.wait_for(task, 30)
            return lines, refused, health, time.monotonic() - signalled

    lines, refused, health, drained_after = asyncio.run(run())
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert health.status_code == 503 and health.json()["status"] == "draining"
    # The in-flight stream outlived the signal by the grace period, then was aborted and ended properly.
    assert lines[-1] == "[DONE]"
    assert '"finish_reason":"abort"' in lines[-2]
    assert GRACE_S - 0.5 <= drained_after <= GRACE_S + 5
    assert limited.proc.wait(timeout=20) == 0, limited.log_tail()


def test_an_address_in_use_is_refused_before_the_model_loads(monkeypatch, capsys) -> None:
    """The socket is bound first (vLLM does the same): a port in use was found only once the weights had
    loaded, minutes later for a large model."""
    from kvserve import engine
    from kvserve.cli import main

    def no_loading(*args, **kwargs):
        raise AssertionError("the model began to load")

    monkeypatch.setattr(engine.Engine, "__init__", no_loading)
    monkeypatch.setattr(sys, "setswitchinterval", lambda interval: None)  # serve's, for this process's GIL
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--host", "127.0.0.1", "--port", str(taken.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err
