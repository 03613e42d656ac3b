"""``kvserve route`` over real ``kvserve serve`` processes, driven by the official openai client: streams
pass through unchanged, a replica killed with SIGKILL mid-run loses no request that had not streamed, and a
replica that comes back is used again; ``kvserve serve --replicas 2`` is one command."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import headless_chromium
from tests.server.conftest import ServerProcess, chat
from tests.support.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", "1024", "--num-threads", "1",
               "--served-model-name", "smol"]
ROUTER_ARGS = ["--policy", "round_robin", "--health-interval", "0.5", "--startup-timeout", "120"]
LONG = {"max_tokens": 120, "temperature": 0, "extra_body": {"ignore_eos": True}}


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def router_metric(router: ServerProcess, name: str, labels: str) -> float:
    for line in httpx.get(f"{router.base_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"kvserve_router:{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def deltas(stream) -> list[str]:
    return [c.choices[0].delta.content or "" for c in stream if c.choices]


def wait_until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def check_gateway_dashboard(browser, url: str, a_url: str, b_url: str, request_id: str) -> None:
    """The gateway's dashboard in headless Chromium: both replicas and the cluster, the routing decisions,
    a replica's own panels, and a routed request's trip from the replica that served it."""
    page = browser.new_page(viewport={"width": 1280, "height": 1500})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{url}/dashboard")
    page.wait_for_function(
        "() => parseInt(document.querySelector('#replicas tr[data-replica=all]')?.cells[3].textContent) === 4",
        timeout=10_000)
    assert page.locator("#replicas tbody tr").count() == 3 and page.locator("#decisions tbody tr").count() >= 1
    assert a_url in page.inner_text("#model")
    page.locator(f"#replicas tr[data-replica='{b_url}']").click()
    page.wait_for_function(f"() => document.getElementById('model').textContent.includes('{b_url}')",
                           timeout=5_000)
    page.fill("#trip-id", request_id)
    page.click("#trip-form button")
    page.wait_for_selector("#timeline g.stage[data-stage=prefill] rect", timeout=10_000)
    assert "trip of" in page.inner_text("#timeline h2") and (a_url in page.inner_text("#timeline h2")
                                                              or b_url in page.inner_text("#timeline h2"))
    assert errors == [], errors
    page.close()


@pytest.fixture
def fleet(tmp_path: Path):
    replicas = [ServerProcess(ENGINE_ARGS, tmp_path / f"replica{i}.log") for i in range(2)]
    router = ServerProcess([*ROUTER_ARGS, *(a for r in replicas for a in ("--replica", r.base_url))],
                           tmp_path / "router.log", command="route")
    started = [*replicas, router]
    try:
        for server in started:
            server.wait_ready()
        yield replicas, router, started
    finally:
        for server in started:
            server.stop()
    assert "Traceback" not in router.log_tail(10**7), router.log_tail()


def test_streams_through_the_router_are_the_replicas_own_and_a_killed_replica_loses_no_unstreamed_request(
        fleet, tmp_path: Path) -> None:
    (a, b), router, started = fleet
    gateway = client_of(router)
    messages = chat("Write a short poem about the sea.")
    direct = deltas(client_of(a).chat.completions.create(model="smol", messages=messages, max_tokens=24,
                                                         temperature=0, stream=True))
    routed = [deltas(gateway.chat.completions.create(model="smol", messages=messages, max_tokens=24, temperature=0,
                                                     stream=True)) for _ in range(2)]  # one on each replica
    assert routed == [direct, direct]

    # What the gateway's dashboard polls: each replica's own stats and the routing counters; and a routed
    # request's trip, found on the replica that served it.
    reply = gateway.chat.completions.create(model="smol", messages=messages, max_tokens=2, temperature=0)
    stats = httpx.get(f"{router.base_url}/kvserve/stats", timeout=10).json()
    assert stats["gateway"] is True and stats["policy"] == "round_robin"
    assert [r["url"] for r in stats["replicas"]] == [a.base_url, b.base_url]
    assert sum(r["stats"]["requests"]["finished"] for r in stats["replicas"]) == 4  # `direct` went to a
    assert stats["routing"]["decisions"] and sum(stats["routing"]["decisions"].values()) == 3
    trip = httpx.get(f"{router.base_url}/kvserve/stats/requests/{reply.id}", timeout=10).json()
    assert trip["id"] == f"{reply.id}-0" and trip["replica"] in (a.base_url, b.base_url)
    with headless_chromium() as browser:
        if browser is not None:
            check_gateway_dashboard(browser, router.base_url, a.base_url, b.base_url, reply.id)

    # Two long streams, one per replica, both past their first chunk.
    outcomes: dict[str, object] = {}

    def long_stream(name: str) -> None:
        try:
            stream = gateway.chat.completions.create(model="smol", messages=chat(f"Story {name}."), stream=True, **LONG)
            first = next(stream)
            outcomes[f"{name}.first"] = first
            outcomes[name] = len(deltas(stream))
        except openai.APIError as exc:
            outcomes[name] = exc

    streams = [threading.Thread(target=long_stream, args=(name,)) for name in ("s0", "s1")]
    for thread in streams:
        thread.start()
    wait_until(lambda: "s0.first" in outcomes and "s1.first" in outcomes, 60)

    # Replica a freezes: requests routed to it now wait for an answer that never comes; then it is killed.
    os.kill(a.proc.pid, signal.SIGSTOP)
    pending: dict[int, object] = {}

    def short_request(i: int) -> None:
        try:
            pending[i] = gateway.chat.completions.create(model="smol", messages=chat(f"Say {i}."), max_tokens=4,
                                                         temperature=0).choices[0].finish_reason
        except openai.APIError as exc:
            pending[i] = exc

    requests = [threading.Thread(target=short_request, args=(i,)) for i in range(4)]
    for thread in requests:
        thread.start()
    time.sleep(1.0)
    os.kill(a.proc.pid, signal.SIGKILL)
    a.proc.wait(timeout=10)
    for thread in [*streams, *requests]:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a request through the router hung"

    assert all(reason in ("length", "stop") for reason in pending.values()), pending  # none lost
    cut = [outcomes[name] for name in ("s0", "s1") if isinstance(outcomes[name], openai.APIError)]
    done = [outcomes[name] for name in ("s0", "s1") if isinstance(outcomes[name], int)]
    assert len(cut) == 1 and "not retried" in str(cut[0]), outcomes  # the stream on a ends with a clear error
    assert len(done) == 1 and done[0] >= LONG["max_tokens"] - 1, outcomes  # the one on b finished
    assert router_metric(router, "retries_total", 'reason="cut"') + router_metric(
        router, "retries_total", 'reason="unreachable"') >= 1
    assert router_metric(router, "replica_healthy", f'replica="{a.base_url}"') == 0

    served_by_b = router_metric(router, "requests_total", f'replica="{b.base_url}",status="200"')
    for i in range(3):
        gateway.chat.completions.create(model="smol", messages=chat(f"Again {i}."), max_tokens=2)
    assert router_metric(router, "requests_total", f'replica="{b.base_url}",status="200"') == served_by_b + 3

    back = ServerProcess(ENGINE_ARGS, tmp_path / "replica0-back.log", port=a.port)
    started.append(back)
    back.wait_ready()
    wait_until(lambda: router_metric(router, "replica_healthy", f'replica="{a.base_url}"') == 1, 30)
    served_by_a = router_metric(router, "requests_total", f'replica="{a.base_url}",status="200"')
    for i in range(4):
        gateway.chat.completions.create(model="smol", messages=chat(f"Back {i}."), max_tokens=2)
    assert router_metric(router, "requests_total", f'replica="{a.base_url}",status="200"') >= served_by_a + 1


def test_serve_with_replicas_is_one_command_that_stops_its_replicas(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path, "llama")
    fleet = ServerProcess(["--model", str(model), "--replicas", "2", "--num-threads", "2", "--served-model-name",
                           "tiny"], tmp_path / "fleet.log")
    try:
        fleet.wait_ready(timeout=120)
        health = httpx.get(f"{fleet.base_url}/health", timeout=5).json()
        assert health == {"status": "ok", "healthy_replicas": 2, "replicas": 2}
        answer = client_of(fleet).completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
        assert answer.usage.completion_tokens == 3
        children = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(fleet.proc.pid)], capture_output=True,
                                  text=True).stdout.splitlines()
        assert len(children) == 2 and all("--num-threads 1" in c for c in children), children
    finally:
        fleet.stop()
    assert fleet.proc.returncode == 0, fleet.log_tail()
    for line in children:
        pid = int(line.split()[0])
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid


@pytest.mark.heavy  # CI routes the auto model over fake replicas of two models (tests/router/test_model_routing.py)
def test_the_auto_model_over_real_replicas_of_two_models(tmp_path: Path) -> None:
    """Two tiny models behind a real gateway: the cascade reads the replica's real logprobs (an answer it
    accepts and one it escalates, streamed with both usages), and the probe the replica's real hidden states."""
    from kvserve.router.model_policies import LogisticProbe

    args = ["--dtype", "float32", "--num-kv-blocks", "64", "--num-threads", "1"]
    small = ServerProcess([*args, "--model", str(make_tiny_model(tmp_path, "llama", seed=1)), "--served-model-name",
                           "small"], tmp_path / "small.log")
    large = ServerProcess([*args, "--model", str(make_tiny_model(tmp_path, "llama", seed=2)), "--served-model-name",
                           "large"], tmp_path / "large.log")
    probe = tmp_path / "probe.json"
    LogisticProbe("small", (0.0,) * 64, (1.0,) * 64, (0.0,) * 64, 5.0, 1.0).save(str(probe))  # always "fails"
    common = ["--replica", small.base_url, "--replica", large.base_url, "--small-model", "small", "--large-model",
              "large", "--startup-timeout", "120"]
    gateways = {name: ServerProcess([*common, *policy], tmp_path / f"{name}.log", command="route")
                for name, policy in (("accept", ["--model-policy", "cascade", "--route-threshold", "-1000"]),
                                     ("escalate", ["--model-policy", "cascade", "--route-threshold", "1"]),
                                     ("probe", ["--model-policy", "probe", "--probe", str(probe)]))}
    started = [small, large, *gateways.values()]
    try:
        for server in started:
            server.wait_ready()
        messages = chat("Name a colour.")
        accepted = client_of(gateways["accept"]).chat.completions.with_raw_response.create(
            model="auto", messages=messages, max_tokens=6, temperature=0)
        assert accepted.headers["x-kvserve-route"] == "cascade:confident" and accepted.parse().model == "small"
        assert accepted.parse().choices[0].logprobs is None
        direct = client_of(small).chat.completions.create(model="small", messages=messages, max_tokens=6,
                                                          temperature=0)
        assert accepted.parse().choices[0].message.content == direct.choices[0].message.content

        stream = client_of(gateways["escalate"]).chat.completions.create(
            model="auto", messages=messages, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        from_large = client_of(large).chat.completions.create(model="large", messages=messages, max_tokens=6,
                                                              temperature=0, extra_body={"ignore_eos": True})
        assert "".join(deltas(chunks)) == from_large.choices[0].message.content
        usage = chunks[-1].usage
        assert usage.completion_tokens == 12 and set(usage.model_extra["models"]) == {"small", "large"}

        routed = client_of(gateways["probe"]).completions.with_raw_response.create(
            model="auto", prompt="def add(a, b):", max_tokens=4, temperature=0)
        assert (routed.headers["x-kvserve-model"], routed.headers["x-kvserve-route"]) == ("large", "probe:probe")

        # The tokenizer routes go to a replica of the model named, answered as it answers them.
        gateway = gateways["probe"].base_url
        for model, server in (("small", small), ("large", large)):
            body = {"model": model, "messages": messages, "return_token_strs": True}
            through = httpx.post(f"{gateway}/tokenize", json=body, timeout=30)
            assert through.status_code == 200 and through.json() == httpx.post(
                f"{server.base_url}/tokenize", json=body, timeout=30).json()
            tokens = {"model": model, "tokens": through.json()["tokens"]}
            assert httpx.post(f"{gateway}/detokenize", json=tokens, timeout=30).json() == httpx.post(
                f"{server.base_url}/detokenize", json=tokens, timeout=30).json()
        for model, status in (("auto", 400), ("nothing", 404)):
            refused = httpx.post(f"{gateway}/tokenize", json={"model": model, "prompt": "hi"}, timeout=30)
            assert refused.status_code == status and refused.json()["error"]["param"] == "model"
    finally:
        for server in started:
            server.stop()
    for name in gateways:
        assert "Traceback" not in gateways[name].log_tail(10**7), gateways[name].log_tail()
