"""The load generator against a fake OpenAI-compatible server (httpx.MockTransport, no sockets)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvserve.bench.client import RequestOptions
from kvserve.bench.report import SLO
from kvserve.bench.runner import BenchConfig, ComputeOptions, run_bench_async
from kvserve.bench.trace import render_timeline, timeline_stages
from kvserve.bench.workloads import WorkloadConfig
from tests.storage.conftest import FakeClock


class FakeServer:
    """Streams ``max_tokens`` one-word chunks after a role chunk; usage counts words; cached = common prefix."""

    def __init__(self, *, fail_every: int = 0, kvserve: bool = False, delay_s: float = 0.0,
                 clock: FakeClock | None = None, token_s: float = 0.0) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.fail_every = fail_every
        self.kvserve = kvserve
        self.delay_s = delay_s
        self.clock = clock  # moved on by ``token_s`` per streamed token, when given
        self.token_s = token_s
        self.previous: list[list[str]] = []
        self.counters = {"prompt_tokens_total": 0, "engine_steps_total": 0, "engine_busy_seconds_total": 0.0}

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model", "root": None}]})
        if request.url.path == "/metrics":
            if not self.kvserve:
                return httpx.Response(404)
            text = "".join(f"# TYPE kvserve:{k[:-6]} counter\nkvserve:{k} {v}\n" for k, v in self.counters.items())
            return httpx.Response(200, text=text)
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        text = " ".join(m["content"] for m in body["messages"]) if "messages" in body else body["prompt"]
        words = text.split()
        cached = max((_common(words, p) for p in self.previous), default=0)
        self.previous.append(words)
        n = body["max_tokens"]
        self.counters["prompt_tokens_total"] += len(words)
        self.counters["engine_steps_total"] += n
        self.counters["engine_busy_seconds_total"] += 0.5
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self._stream(body, n, len(words), cached))

    async def _stream(self, body: dict[str, Any], n: int, prompt: int, cached: int) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        # the client stops reading at [DONE]: the request counts as done just before it
        chat = "messages" in body
        if chat:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(n):
            await asyncio.sleep(self.delay_s)
            if self.clock is not None:
                self.clock.advance(self.token_s)
            piece = f" w{i}" if i else f"w{i}"
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            yield _sse({"choices": [choice]})
        yield _sse({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                                             "prompt_tokens_details": {"cached_tokens": cached}},
                    **({"timings": {"queued_ms": 1.0}} if body.get("return_timings") else {})})
        self.in_flight -= 1
        yield b"data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run(server: FakeServer, **kwargs: Any) -> dict[str, Any]:
    kwargs.setdefault("progress", False)
    config = BenchConfig(base_url="http://fake", **kwargs)
    return asyncio.run(run_bench_async(config, transport=server.transport()))


def test_agentic_closed_loop_resends_the_conversation_with_replies() -> None:
    server = FakeServer(delay_s=0.002)
    workload = WorkloadConfig(name="agentic", turns=3, input_len=10, output_len=4)
    result = run(server, workload=workload, concurrency=2, num_requests=9)
    s = result["summary"]
    assert s["successful_requests"] == 9 and s["failed_requests"] == 0
    assert server.max_in_flight == 2
    by_session: dict[str, list[dict[str, Any]]] = {}
    for body in server.bodies:
        assert body["model"] == "fake-model" and body["stream"] and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"] == 4
        assert "return_timings" not in body  # not a kvserve server
        by_session.setdefault(body["messages"][1]["content"], []).append(body)
    for bodies in by_session.values():
        for earlier, later in zip(bodies, bodies[1:], strict=False):
            assert later["messages"][:len(earlier["messages"])] == earlier["messages"]
            assert later["messages"][len(earlier["messages"])] == {"role": "assistant", "content": "w0 w1 w2 w3"}
    # the shared system prompt and the growing conversations give a high hit rate
    assert s["cache_hit_rate"] > 0.8
    records = result["requests"]
    assert [r["request_id"] for r in records] == list(range(9))
    for r in records:
        assert r["num_chunks"] == 4 and len(r["itl_s"]) == 3 and r["output_tokens_from_usage"]
        assert 0 < r["ttft_s"] <= r["e2e_s"]


def test_open_loop_completions_without_ignore_eos() -> None:
    server = FakeServer()
    result = run(server, workload=WorkloadConfig(name="chat", input_len=8, output_len=3, seed=5),
                 request_rate=50.0, num_requests=10,
                 options=RequestOptions(endpoint="completions", ignore_eos=False))
    assert result["summary"]["successful_requests"] == 10
    assert all("prompt" in b and "ignore_eos" not in b and "min_tokens" not in b for b in server.bodies)
    starts = [r["start_s"] for r in result["requests"]]
    assert starts == sorted(starts) and starts[-1] > 0.02  # spread by the arrivals, not all at once
    assert result["summary"]["cache_hit_rate"] < 0.2


def test_failures_are_counted_and_end_their_session() -> None:
    server = FakeServer(fail_every=3)
    workload = WorkloadConfig(name="agentic", turns=4, input_len=5, output_len=2)
    result = run(server, workload=workload, concurrency=1, num_requests=8, slo=SLO(ttft_ms=10_000))
    s = result["summary"]
    failed = [r for r in result["requests"] if not r["success"]]
    assert s["failed_requests"] == len(failed) > 0
    assert all(r["error"].startswith("HTTP 500") for r in failed)
    assert s["good_requests"] == s["successful_requests"]
    # after a failure the next request starts a new session at turn 0
    records = result["requests"]
    for prev, nxt in zip(records, records[1:], strict=False):
        if not prev["success"]:
            assert nxt["turn"] == 0 and nxt["session_id"] == prev["session_id"] + 1


def test_duration_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # The runner's clock moves only as the server streams (10 ms a token), so the deadline falls at a known
    # point of the run, whatever the machine's load.
    clock = FakeClock(start=0.0)
    monkeypatch.setattr(time, "perf_counter", clock)
    server = FakeServer(clock=clock, token_s=0.01)
    result = run(server, workload=WorkloadConfig(name="chat", output_len=5), concurrency=2, duration_s=0.3)
    starts = [r["start_s"] for r in result["requests"]]
    assert starts and max(starts) < 0.3
    assert result["summary"]["successful_requests"] == len(starts)
    assert clock() >= 0.3  # the run stopped because its time was up, not for want of requests


def test_kvserve_server_gets_timings_and_a_compute_section() -> None:
    server = FakeServer(kvserve=True)
    result = run(server, workload=WorkloadConfig(name="chat", input_len=20, output_len=4), concurrency=2,
                 num_requests=4, compute=ComputeOptions(model_config="smollm2-135m", peak_tflops=1.0,
                                                         peak_bandwidth_gbs=10.0))
    assert all(b["return_timings"] for b in server.bodies)
    assert all(r["timings"] == {"queued_ms": 1.0} for r in result["requests"])
    assert result["server"]["metrics_delta"]["kvserve:engine_steps_total"] == 16
    compute = result["summary"]["compute"]
    assert compute["busy_s"] == pytest.approx(2.0) and compute["busy_from_metrics"]
    assert compute["mfu"] == pytest.approx((compute["prefill_flops"] + compute["decode_flops"]) / 2.0 / 1e12)
    assert compute["mfu"] == pytest.approx(compute["mfu_prefill"] + compute["mfu_decode"])


def test_trace_timeline_is_proportional() -> None:
    timings = {"received_to_queued_ms": 10.0, "queued_ms": 30.0,
               "cache_lookup": {"prompt_tokens": 100, "cached_tokens": 64, "cached_tokens_by_tier": {}},
               "prefill": {"tokens_computed": 36, "chunks": 2, "ms": 60.0}, "first_token_ms": 90.0,
               "decode": {"steps": 9, "tokens": 9, "ms": 100.0}, "finished_ms": 190.0, "finish_reason": "length"}
    stages = {label: (start, length) for label, start, length, _ in timeline_stages(timings, client_e2e_ms=210.0)}
    assert stages["queue"] == (10.0, 30.0) and stages["prefill"] == (40.0, 60.0)
    assert stages["decode"] == (100.0, 100.0) and stages["client"] == (200.0, 10.0)
    text = render_timeline(timings, 105.0, 210.0, width=42)
    lines = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert "64/100 prompt tokens found" in text and "36 tokens in 2 chunk(s)" in text and "9 steps" in text
    assert lines["decode"].count("█") == 20 and lines["prefill"].count("█") == 12  # 42 chars per 210 ms
