"""The gateway over fake upstreams: pass-through, failover, the router's own errors, start-up checks."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from kvserve.errors import ConfigError
from kvserve.router.replicas import ReplicaPool
from kvserve.serving_config import RouterConfig
from tests.router.conftest import MODEL, BackgroundGateway, FakeReplica, gateway_over, stream_chunks


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def router_metric(base_url: str, name: str, labels: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(f"kvserve_router:{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def raw_stream(base_url: str, body: dict) -> list[bytes]:
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(response.iter_raw())


def test_a_stream_arrives_chunk_for_chunk_as_the_replica_sent_it(replicas: list[FakeReplica]) -> None:
    gateway = gateway_over(replicas[:1], policy="round_robin")
    try:
        chunks = raw_stream(gateway.base_url, {"model": MODEL, "prompt": "hi", "stream": True})
        assert chunks == stream_chunks("a", replicas[0].num_chunks)
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
        texts = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="hi", stream=True)
                 if c.choices]
        assert texts == [f"a-{i} " for i in range(replicas[0].num_chunks)]
        whole = client.completions.create(model=MODEL, prompt="hi")
        assert whole.choices[0].text == "a" and whole.usage.prompt_tokens_details.cached_tokens == 2
        assert len(replicas[0].received) == 3
        assert router_metric(gateway.base_url, "cached_tokens_total", f'replica="{replicas[0].url}"') == 2
        assert router_metric(gateway.base_url, "completion_tokens_total", f'replica="{replicas[0].url}"') == 11
    finally:
        gateway.stop()


def test_a_replica_answering_503_is_taken_out_and_the_request_retried_once_elsewhere(
        replicas: list[FakeReplica]) -> None:
    a, b = replicas
    a.mode = "error_503"
    a.healthy = False  # its health check fails too: it stays out
    gateway = gateway_over(replicas, policy="round_robin")
    try:
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
        texts = [client.completions.create(model=MODEL, prompt=f"p{i}").choices[0].text for i in range(4)]
        assert texts == ["b"] * 4
        assert len(a.received) <= 1 and len(b.received) == 4  # each request reached b exactly once
        assert router_metric(gateway.base_url, "replica_healthy", f'replica="{a.url}"') == 0
    finally:
        gateway.stop()


def test_a_500_is_tried_elsewhere_takes_no_replica_out_and_comes_back_as_it_is_when_every_replica_fails(
        replicas: list[FakeReplica]) -> None:
    a, b = replicas
    a.mode = "error_500"  # its /health passes: a fault of the request, not of the replica
    gateway = gateway_over(replicas, policy="round_robin")
    try:
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
        texts = [client.completions.create(model=MODEL, prompt=f"p{i}").choices[0].text for i in range(4)]
        assert texts == ["b"] * 4 and len(b.received) == 4
        assert 1 <= len(a.received) <= 4  # tried on it, never twice for one request
        for replica in replicas:
            assert router_metric(gateway.base_url, "replica_healthy", f'replica="{replica.url}"') == 1
        b.mode = "error_500"  # a request every replica fails on: its answer, and the pool stays whole
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="poison")
        assert info.value.body == {"message": "boom", "type": "internal_error"}
        assert [r.received[-1]["prompt"] for r in replicas] == ["poison", "poison"]
        a.mode = b.mode = "ok"
        assert client.completions.create(model=MODEL, prompt="after").choices[0].text in ("a", "b")
    finally:
        gateway.stop()


def test_a_health_check_begun_before_a_failure_does_not_put_the_replica_back(replicas: list[FakeReplica]) -> None:
    a, _ = replicas
    async def run() -> None:
        async with httpx.AsyncClient() as client:
            await check_once(ReplicaPool((a.url,), client, health_interval_s=1.0, headers={}))

    async def check_once(pool: ReplicaPool) -> None:
        await pool.check_all(timeout_s=5)
        replica = pool.replicas[0]
        assert replica.healthy
        read_load = pool._read_load

        async def failing_meanwhile(r):  # a request fails on the replica while the check reads its load
            pool.mark_down(r, "a request failed")
            return await read_load(r)

        pool._read_load = failing_meanwhile  # type: ignore[method-assign]
        await pool.check(replica)
        assert not replica.healthy
        pool._read_load = read_load  # type: ignore[method-assign]
        await pool.check(replica)  # a check begun after the failure puts it back
        assert replica.healthy

    asyncio.run(run())


def test_a_replica_that_fails_while_coming_back_stays_out(replicas: list[FakeReplica]) -> None:
    """Out already, a replica whose request fails while a health check reads its model list is not put back by
    that check; nor is one that answers /health but not /v1/models."""
    a, _ = replicas

    async def run() -> None:
        async with httpx.AsyncClient() as client:
            pool = ReplicaPool((a.url,), client, health_interval_s=1.0, headers={})
            await pool.check_all(timeout_s=5)
            replica = pool.replicas[0]
            pool.mark_down(replica, "a 503")
            refresh = pool.refresh_models

            async def failing_meanwhile(r, read_info=False):  # a stream on it breaks during the read
                pool.mark_down(r, "a stream was cut")
                return await refresh(r, read_info)

            pool.refresh_models = failing_meanwhile  # type: ignore[method-assign]
            await pool.check(replica)
            assert not replica.healthy
            pool.refresh_models = refresh  # type: ignore[method-assign]
            a.models_status = 500
            await pool.check(replica)
            assert not replica.healthy  # /health answers, /v1/models does not
            a.models_status = 200
            await pool.check(replica)
            assert replica.healthy

    asyncio.run(run())


def test_a_dead_replica_is_routed_around_and_used_again_when_it_comes_back(replicas: list[FakeReplica]) -> None:
    a, b = replicas
    gateway = gateway_over(replicas, policy="round_robin")
    try:
        a.stop()
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
        for i in range(3):
            chunks = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=f"{i}", stream=True)
                      if c.choices]
            assert chunks[0] == "b-0 "
        a.start()
        wait_until(lambda: router_metric(gateway.base_url, "replica_healthy", f'replica="{a.url}"') == 1)
        texts = {client.completions.create(model=MODEL, prompt=f"q{i}").choices[0].text for i in range(2)}
        assert texts == {"a", "b"}
    finally:
        gateway.stop()


def test_a_stream_cut_after_its_first_chunk_ends_with_an_error_event_and_is_not_replayed(
        replicas: list[FakeReplica]) -> None:
    a, b = replicas
    a.mode = "cut_stream"
    gateway = gateway_over(replicas, policy="round_robin")
    try:
        chunks = raw_stream(gateway.base_url, {"model": MODEL, "prompt": "hi", "stream": True})
        events = [line for chunk in chunks for line in chunk.decode().split("\n\n") if line]
        assert events[0] == stream_chunks("a", 1)[0].decode().strip()
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert error["code"] == "stream_cut" and "not retried" in error["message"]
        assert "data: [DONE]" not in events
        assert len(a.received) == 1 and len(b.received) == 0
        assert router_metric(gateway.base_url, "stream_failures_total", f'replica="{a.url}"') == 1
    finally:
        gateway.stop()


@pytest.mark.parametrize("mode,stream", [("not_json", False), ("not_sse", True)])
def test_a_malformed_upstream_answer_is_a_502_with_an_openai_body(
        replicas: list[FakeReplica], mode: str, stream: bool) -> None:
    replicas[0].mode = mode
    gateway = gateway_over(replicas[:1])
    try:
        response = httpx.post(f"{gateway.base_url}/v1/completions",
                              json={"model": MODEL, "prompt": "hi", "stream": stream})
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == "bad_upstream_response" and replicas[0].url in error["message"]
    finally:
        gateway.stop()


def test_the_routers_own_errors(replicas: list[FakeReplica]) -> None:
    gateway = gateway_over(replicas, max_request_body_bytes=1000)
    try:
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError) as not_found:
            client.completions.create(model="no-such-model", prompt="hi")
        assert not_found.value.body["code"] == "model_not_found" and not_found.value.body["param"] == "model"
        assert client.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("no-such-model")
        with pytest.raises(openai.APIStatusError) as too_large:
            client.completions.create(model=MODEL, prompt="x" * 2000)
        assert too_large.value.status_code == 413 and too_large.value.body["code"] == "request_too_large"
        chunked = httpx.post(f"{gateway.base_url}/v1/completions", content=iter([b"{" + b" " * 600, b" " * 600]))
        assert chunked.status_code == 413
        for path in ("/v1/completions", "/detokenize"):
            bad_json = httpx.post(f"{gateway.base_url}{path}", content=b"{not json")
            assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
        assert sum(len(r.received) for r in replicas) == 0

        for replica in replicas:
            replica.healthy = False
        wait_until(lambda: httpx.get(f"{gateway.base_url}/health").status_code == 503)
        for path in ("/v1/completions", "/tokenize"):
            response = httpx.post(f"{gateway.base_url}{path}", json={"model": MODEL, "prompt": "hi"})
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "no_healthy_replica"
    finally:
        gateway.stop()


def test_a_client_that_leaves_mid_stream_closes_the_upstream_stream(replicas: list[FakeReplica]) -> None:
    replicas[0].mode = "slow"
    gateway = gateway_over(replicas[:1])
    try:
        with httpx.stream("POST", f"{gateway.base_url}/v1/completions",
                          json={"model": MODEL, "prompt": "hi", "stream": True}, timeout=10) as response:
            next(response.iter_raw())
        wait_until(lambda: replicas[0].abandoned == 1)
        wait_until(lambda: router_metric(gateway.base_url, "replica_in_flight", f'replica="{replicas[0].url}"') == 0)
    finally:
        gateway.stop()


def test_a_replica_url_that_is_not_an_openai_server_is_refused_at_start(replicas: list[FakeReplica]) -> None:
    with pytest.raises(ConfigError, match="not an OpenAI-compatible server"):
        BackgroundGateway(RouterConfig(replicas=(f"{replicas[0].url}/v1/models/x",), startup_timeout_s=2))
    with pytest.raises(ConfigError, match="did not answer"):
        BackgroundGateway(RouterConfig(replicas=("http://127.0.0.1:9",), startup_timeout_s=0.5))
    with pytest.raises(ConfigError, match="base URL"):
        RouterConfig(replicas=("localhost:8000",))


def test_a_replicas_load_is_the_routers_count_plus_the_others_its_report_held(replicas: list[FakeReplica]) -> None:
    async def read_report() -> ReplicaPool:
        async with httpx.AsyncClient() as client:
            pool = ReplicaPool((replicas[0].url,), client, health_interval_s=1.0, headers={})
            pool.replicas[0].in_flight = 1
            await pool._read_load(pool.replicas[0])
            return pool

    replicas[0].reported_running = 3  # this router's one request and two of another client's
    replica = asyncio.run(read_report()).replicas[0]
    assert replica.load == 3
    replica.in_flight = 0  # this router's request ended; the report, not read again, still holds it
    assert replica.load == 2


def test_a_relayed_stream_is_ended_when_the_client_leaves_before_its_body_starts() -> None:
    from kvserve.router.gateway import _RelayedStream

    ended: list[str] = []

    async def body():
        try:
            yield b"data: {}\n\n"
        finally:
            ended.append("generator")

    async def end() -> None:
        ended.append("response")

    async def gone() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(0)

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}  # Starlette listens for the disconnect itself
    asyncio.run(_RelayedStream(body(), end)(scope, gone, send))
    assert "response" in ended  # whether or not the body's generator ever ran


def test_the_model_list_asks_for_the_key_the_replicas_ask_for(replicas: list[FakeReplica]) -> None:
    """The gateway answers GET /v1/models itself: where its replicas require a key, a client without it (or
    with another) gets their 401, as on the routes it forwards."""
    replicas[0].api_key = "k"
    try:
        open_gateway = gateway_over(replicas[1:], policy="round_robin")
        try:
            assert httpx.get(f"{open_gateway.base_url}/v1/models").status_code == 200
        finally:
            open_gateway.stop()
        gateway = gateway_over(replicas[:1], policy="round_robin", replica_api_key="k")
        try:
            for path in ("/v1/models", f"/v1/models/{MODEL}"):
                assert httpx.get(f"{gateway.base_url}{path}").status_code == 401
                wrong = httpx.get(f"{gateway.base_url}{path}", headers={"Authorization": "Bearer x"})
                assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
                right = httpx.get(f"{gateway.base_url}{path}", headers={"Authorization": "Bearer k"})
                assert right.status_code == 200
            assert right.json()["id"] == MODEL
        finally:
            gateway.stop()
        # A replica that cannot judge the key (a 500) passes the question on; where none can, a 503, never the list.
        replicas[1].api_key = "k"
        gateway = gateway_over(replicas, policy="round_robin", replica_api_key="k")
        try:
            replicas[0].models_status = 500
            assert httpx.get(f"{gateway.base_url}/v1/models").status_code == 401
            assert httpx.get(f"{gateway.base_url}/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
            replicas[1].models_status = 500
            assert httpx.get(f"{gateway.base_url}/v1/models").status_code == 503
        finally:
            gateway.stop()
    finally:
        for replica in replicas:
            replica.api_key, replica.models_status = None, 200


def test_a_responses_request_goes_to_a_replica_of_its_model_as_it_came(replicas: list[FakeReplica]) -> None:
    """Whole and streamed, the replica's answer comes back as it was sent, and its usage (the Responses API's
    input and output tokens) is counted as chat's is."""
    gateway = gateway_over(replicas, policy="cache_aware")
    try:
        body = {"model": MODEL, "input": [{"role": "user", "content": "hi"}], "instructions": "Be brief."}
        whole = httpx.post(f"{gateway.base_url}/v1/responses", json=body, timeout=10)
        assert whole.status_code == 200 and whole.json()["object"] == "response"
        with httpx.stream("POST", f"{gateway.base_url}/v1/responses", json={**body, "stream": True}) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-1].removeprefix("data: "))["type"] == "response.completed"
        assert [r for replica in replicas for r in replica.received] == [body, {**body, "stream": True}]
        assert sum(router_metric(gateway.base_url, "prompt_tokens_total", f'replica="{r.url}"') for r in replicas) == 6
        assert sum(router_metric(gateway.base_url, "cached_tokens_total", f'replica="{r.url}"') for r in replicas) == 2
    finally:
        gateway.stop()


def test_follow_ups_and_stored_responses_reach_the_replica_that_stored_them(replicas: list[FakeReplica]) -> None:
    """Each replica keeps its own responses: a follow-up (``previous_response_id``), a retrieval and a deletion
    go to the one that stored the response, whatever the policy would pick; a gateway that never saw it finds it."""
    gateway = gateway_over(replicas, policy="round_robin")  # alone, it alternates between the two
    url = f"{gateway.base_url}/v1/responses"
    try:
        first = httpx.post(url, json={"model": MODEL, "input": "hi"}, timeout=10).json()
        with httpx.stream("POST", url, json={"model": MODEL, "input": "hi", "stream": True}) as streamed:
            events = [json.loads(line.removeprefix("data: ")) for line in streamed.iter_lines()
                      if line.startswith("data: ")]
        second = events[-1]["response"]
        holders = {first["id"]: first["output"][0]["content"][0]["text"],
                   second["id"]: second["output"][0]["content"][0]["text"]}
        assert set(holders.values()) == {"a", "b"}
        for response_id, holder in [(i, h) for i, h in holders.items() for _ in range(2)]:  # each twice running
            follow_up = httpx.post(url, json={"input": "more", "previous_response_id": response_id}, timeout=10)
            assert follow_up.status_code == 200, follow_up.text
            assert follow_up.json()["output"][0]["content"][0]["text"] == holder
        assert sum(r.looked_up for r in replicas) == 0  # learnt from the answers (whole, and a stream's first event)
        assert router_metric(gateway.base_url, "routing_decisions_total",
                             'policy="round_robin",reason="stored_response"') == 4
        for response_id in holders:
            fetched = httpx.get(f"{url}/{response_id}", timeout=10)
            assert fetched.status_code == 200 and fetched.json()["id"] == response_id
        unknown = httpx.post(url, json={"input": "more", "previous_response_id": "resp_nowhere"}, timeout=10)
        assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "previous_response_not_found"
        assert httpx.get(f"{url}/resp_nowhere", timeout=10).status_code == 404
    finally:
        gateway.stop()
    fresh = gateway_over(replicas, policy="round_robin")  # knows no response: asks the replicas
    url = f"{fresh.base_url}/v1/responses"
    try:
        for response_id, holder in [(i, h) for i, h in holders.items() for _ in range(2)]:
            follow_up = httpx.post(url, json={"input": "more", "previous_response_id": response_id}, timeout=10)
            assert follow_up.json()["output"][0]["content"][0]["text"] == holder
        response_id = next(iter(holders))
        assert httpx.delete(f"{url}/{response_id}", timeout=10).json()["deleted"] is True
        looked_up = sum(r.looked_up for r in replicas)
        gone = httpx.post(url, json={"input": "more", "previous_response_id": response_id}, timeout=10)
        assert gone.status_code == 400 and gone.json()["error"]["param"] == "previous_response_id"
        assert sum(r.looked_up for r in replicas) == looked_up + 2  # forgotten: both replicas asked again
        assert httpx.get(f"{url}/{response_id}", timeout=10).status_code == 404
        # A replica out of the pool may hold what is asked for: "retry later", not "not found".
        kept = next(i for i in holders if i != response_id)
        holder = next(r for r in replicas if r.name == holders[kept])
        holder.healthy = False
        wait_until(lambda: router_metric(fresh.base_url, "replica_healthy", f'replica="{holder.url}"') == 0)
        for asked in (kept, "resp_nowhere"):
            follow_up = httpx.post(url, json={"input": "more", "previous_response_id": asked}, timeout=10)
            assert follow_up.status_code == 503 and follow_up.headers["retry-after"], follow_up.text
        assert httpx.get(f"{url}/{kept}", timeout=10).status_code == 503
    finally:
        fresh.stop()


def test_adapters_loaded_through_the_gateway_are_loaded_on_every_replica_and_routed_at_once(
        replicas: list[FakeReplica]) -> None:
    a, b = replicas
    gateway = gateway_over(replicas, policy="round_robin", health_interval_s=30.0)  # no health check meanwhile
    try:
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
        loaded = httpx.post(f"{gateway.base_url}/v1/load_lora_adapter",
                            json={"lora_name": "sql", "lora_path": "/adapters/sql"})
        assert loaded.status_code == 200 and "sql" in loaded.text and a.adapters == b.adapters == {"sql"}
        assert "sql" in [m.id for m in client.models.list().data]
        assert {client.completions.create(model="sql", prompt=f"{i}").choices[0].text for i in range(2)} == {"a", "b"}

        b.adapters.discard("sql")  # unloaded behind the gateway's back: unloading through it still succeeds
        unloaded = httpx.post(f"{gateway.base_url}/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert unloaded.status_code == 200 and not a.adapters
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="sql", prompt="x")
        gone = httpx.post(f"{gateway.base_url}/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    finally:
        gateway.stop()


def test_an_adapter_naming_its_base_model_is_loaded_on_that_models_replicas_only(
        replicas: list[FakeReplica]) -> None:
    """In a fleet of two models an adapter fits one of them: named, only its replicas are asked (the others
    would refuse it, and a partial load come back as a failure); a model no replica serves is a 404."""
    a, b = replicas
    b.base_model = "other-model"
    gateway = gateway_over(replicas, policy="round_robin", health_interval_s=30.0)
    try:
        loaded = httpx.post(f"{gateway.base_url}/v1/load_lora_adapter",
                            json={"lora_name": "sql", "lora_path": "/adapters/sql", "model": MODEL})
        assert loaded.status_code == 200 and a.adapters == {"sql"} and not b.adapters
        nobody = httpx.post(f"{gateway.base_url}/v1/load_lora_adapter",
                            json={"lora_name": "x", "lora_path": "/adapters/x", "model": "nobody-serves-this"})
        assert nobody.status_code == 404 and nobody.json()["error"]["param"] == "model"
        assert not b.adapters and a.adapters == {"sql"}
        unloaded = httpx.post(f"{gateway.base_url}/v1/unload_lora_adapter",
                              json={"lora_name": "sql", "model": MODEL})
        assert unloaded.status_code == 200 and not a.adapters
        everywhere = httpx.post(f"{gateway.base_url}/v1/load_lora_adapter",
                                json={"lora_name": "docs", "lora_path": "/adapters/docs"})  # no model: all
        assert everywhere.status_code == 200 and a.adapters == b.adapters == {"docs"}
    finally:
        gateway.stop()


def test_an_adapter_one_replica_loaded_on_its_own_is_routed_to_that_replica(replicas: list[FakeReplica]) -> None:
    a, b = replicas
    gateway = gateway_over(replicas, policy="round_robin", health_interval_s=30.0)
    try:
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
        b.refuse_loads = True
        refused = httpx.post(f"{gateway.base_url}/v1/load_lora_adapter",
                             json={"lora_name": "sql", "lora_path": "/adapters/sql"})
        assert refused.status_code == 400 and f"on {b.name}" in refused.json()["error"]["message"]
        assert {client.completions.create(model="sql", prompt=f"{i}").choices[0].text for i in range(3)} == {"a"}
        # loaded on a replica directly, after the gateway last read its list: read again on the first request
        b.adapters.add("docs")
        assert client.completions.create(model="docs", prompt="x").choices[0].text == "b"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nobody-serves-this", prompt="x")
    finally:
        gateway.stop()


def test_a_health_check_learns_what_a_replica_serves_now(replicas: list[FakeReplica]) -> None:
    a, _ = replicas
    gateway = gateway_over(replicas)
    try:
        a.adapters.add("sql")
        wait_until(lambda: "sql" in [m["id"] for m in httpx.get(f"{gateway.base_url}/v1/models").json()["data"]])
        a.adapters.clear()
        wait_until(lambda: "sql" not in [m["id"] for m in httpx.get(f"{gateway.base_url}/v1/models").json()["data"]])
    finally:
        gateway.stop()


def test_a_load_retried_after_a_partial_failure_succeeds_once_every_replica_serves_the_adapter(
        replicas: list[FakeReplica]) -> None:
    a, b = replicas
    gateway = gateway_over(replicas, policy="round_robin", health_interval_s=30.0)
    try:
        a.adapters.add("sql")  # loaded there before; b was down when it was
        body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
        assert httpx.post(f"{gateway.base_url}/v1/load_lora_adapter", json=body).status_code == 200
        assert a.adapters == b.adapters == {"sql"}
        again = httpx.post(f"{gateway.base_url}/v1/load_lora_adapter", json=body)  # both refuse: both serve it
        assert again.status_code == 200 and "sql" in again.text
    finally:
        gateway.stop()


def test_an_older_model_list_does_not_overwrite_a_newer_one() -> None:
    """A health check's read of /v1/models that answers after the read a LoRA load made is older news."""
    answers: list[asyncio.Future[httpx.Response]] = []

    async def main() -> tuple[tuple[str, ...], tuple[str, ...]]:
        loop = asyncio.get_running_loop()

        async def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path != "/v1/models":
                return httpx.Response(404)  # /kvserve/info: not a kvserve replica
            answer: asyncio.Future[httpx.Response] = loop.create_future()
            answers.append(answer)
            return await answer

        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        pool = ReplicaPool(("http://replica",), client, 1.0, {})
        replica = pool.replicas[0]
        replica.models = ("base",)
        health_read = asyncio.create_task(pool.refresh_models(replica))
        await asyncio.sleep(0.01)
        load_read = asyncio.create_task(pool.refresh_models(replica))
        await asyncio.sleep(0.01)
        listing = {"object": "list", "data": [{"id": "base"}, {"id": "sql"}]}
        answers[1].set_result(httpx.Response(200, json=listing))  # the later read answers first
        await load_read
        after_load = replica.models
        answers[0].set_result(httpx.Response(200, json={"object": "list", "data": [{"id": "base"}]}))
        await health_read
        await client.aclose()
        return after_load, replica.models

    after_load, after_health_read = asyncio.run(main())
    assert after_load == after_health_read == ("base", "sql")


def test_a_slow_replica_is_a_504_and_stays_in_and_refusals_pass_or_move_on(replicas: list[FakeReplica]) -> None:
    """Past the request timeout a replica is slow, not down: a 504, the request not sent to the other replica
    (where it would run twice), and the slow one still routed to. A 429 (a full queue: the request did not run)
    moves on to the other replica; a plain-text 4xx comes back as the replica gave it."""
    a, b = replicas
    gateway = gateway_over(replicas, policy="round_robin", request_timeout_s=1.0, health_interval_s=30.0)
    try:
        a.mode = "hang"
        answers = [httpx.post(f"{gateway.base_url}/v1/completions", json={"model": MODEL, "prompt": f"{i}"},
                              timeout=10) for i in range(2)]
        slow = next(r for r in answers if r.status_code != 200)
        assert slow.status_code == 504 and slow.json()["error"]["code"] == "upstream_timeout"
        assert [r.status_code for r in answers].count(200) == 1 and len(b.received) == 1  # never sent to b
        assert gateway.gateway is not None and all(r.healthy for r in gateway.gateway.pool.replicas)
        a.mode = "error_429"
        texts = {httpx.post(f"{gateway.base_url}/v1/completions", json={"model": MODEL, "prompt": f"x{i}"},
                            timeout=10).json()["choices"][0]["text"] for i in range(2)}
        assert texts == {"b"}  # a's refusal moved on to b, which took it
        b.mode = "error_429"
        both_full = httpx.post(f"{gateway.base_url}/v1/completions", json={"model": MODEL, "prompt": "y"}, timeout=10)
        assert both_full.status_code == 429 and both_full.headers["retry-after"] == "1"
        a.mode = b.mode = "text_401"
        refused = httpx.post(f"{gateway.base_url}/v1/completions", json={"model": MODEL, "prompt": "z"}, timeout=10)
        assert refused.status_code == 401 and refused.text == "unauthorized"
    finally:
        gateway.stop()


def test_tokenize_moves_on_from_a_replica_that_died_before_a_health_check_saw_it(
        replicas: list[FakeReplica]) -> None:
    a, _ = replicas
    gateway = gateway_over(replicas, policy="round_robin", health_interval_s=30.0)
    try:
        a.stop()
        for _ in range(2):
            answer = httpx.post(f"{gateway.base_url}/tokenize", json={"model": MODEL, "prompt": "hi"}, timeout=10)
            assert answer.status_code == 200
        assert gateway.gateway is not None and [r.healthy for r in gateway.gateway.pool.replicas] == [False, True]
    finally:
        gateway.stop()
