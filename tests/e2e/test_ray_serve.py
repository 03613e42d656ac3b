"""``kvserve ray`` on a real local Ray cluster (started here on loopback, dashboard off, stopped after): the
OpenAI routes answer through Ray Serve, streams arrive whole, and kvserve's cache-aware policy, as Ray Serve's
request router, sends a repeated prompt where its prefix is cached."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.server.conftest import ServerProcess
from tests.support.tiny_models import make_tiny_model

pytest.importorskip("ray.serve", reason="Ray Serve is an optional extra: pip install -e '.[ray]'")
pytestmark = pytest.mark.heavy  # a Ray cluster and two engines: minutes on two cores


@pytest.fixture
def ray_cluster():
    ray = shutil.which("ray")
    assert ray is not None
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's Unix socket paths must fit 107 bytes
    started = subprocess.run([ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                              "--include-dashboard", "false", "--num-cpus", "4", "--disable-usage-stats",
                              "--temp-dir", temp_dir], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        for log in sorted(Path(temp_dir).glob("session_latest/logs/serve/*.log")):  # shown if the test failed
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_kvserve_on_ray_serve_routes_a_repeated_prompt_to_its_cache(ray_cluster: str, tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path, "llama")
    server = ServerProcess(["--address", ray_cluster, "--replicas", "2", "--model", str(model), "--dtype", "float32",
                            "--served-model-name", "tiny", "--block-size", "4"], tmp_path / "ray.log", command="ray")
    try:
        server.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        prompts = [[100 + 37 * k + i for i in range(41)] for k in range(6)]
        for prompt in prompts:
            first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
            assert first.usage.prompt_tokens_details.cached_tokens == 0
        for prompt in reversed(prompts):  # each again, in another order: it goes where it was, 10 blocks cached
            again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
            assert again.usage.prompt_tokens_details.cached_tokens == 40
        # At once: each still goes where its prefix is (within the load bound of 4, whatever the placement).
        with ThreadPoolExecutor(max_workers=4) as pool:
            together = list(pool.map(lambda prompt: client.completions.create(
                model="tiny", prompt=prompt, max_tokens=2, temperature=0), prompts[:4]))
        assert [a.usage.prompt_tokens_details.cached_tokens for a in together] == [40] * 4
        streamed = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=5, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        assert sum(1 for chunk in streamed if chunk.choices and chunk.choices[0].text) >= 1
        counted = httpx.post(f"{server.base_url}/tokenize", json={"model": "tiny", "prompt": "hello there"},
                             timeout=30).json()
        typed = client.completions.create(model="tiny", prompt="hello there", max_tokens=1, temperature=0)
        assert counted["count"] == typed.usage.prompt_tokens == len(counted["tokens"])
        text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": counted["tokens"]}, timeout=30).json()
        assert text["prompt"].endswith("hello there")
        bad = httpx.post(f"{server.base_url}/v1/completions", content=b"[1, 2]", timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    finally:
        server.stop()
        time.sleep(1)
    assert server.proc.returncode == 0, server.log_tail()
