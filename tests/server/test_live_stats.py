"""GET /kvserve/stats and /kvserve/stats/requests/{id} (what the dashboard polls), and the page's assets."""

from __future__ import annotations

import re

import httpx
from openai import OpenAI

from kvserve.server.dashboard import ASSETS, STATIC
from kvserve.server.live_stats import percentiles


def test_stats_count_a_request_and_keep_its_trip(base_url: str) -> None:
    before = httpx.get(f"{base_url}/kvserve/stats").json()
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model=None, prompt="The history of paged memory is", max_tokens=9,
                                      temperature=0, extra_body={"ignore_eos": True})
    after = httpx.get(f"{base_url}/kvserve/stats").json()
    assert after["requests"]["finished"] >= before["requests"]["finished"] + 1
    assert after["requests"]["output_tokens"] >= before["requests"]["output_tokens"] + 9
    assert after["engine"]["generated_tokens"] >= before["engine"]["generated_tokens"] + 9
    assert after["kv"]["device"]["total"] == 256 and after["alive"] is True
    assert after["latency"]["requests"] >= 1 and after["latency"]["ttft_ms"]["p50"] > 0
    assert set(after["queue"]) == {"waiting", "running", "prefilling", "decoding"}
    # The cost model's FLOPs and KV bytes of the finished requests; no peaks without --hardware.
    assert after["requests"]["flops"] > before["requests"]["flops"] and after["requests"]["kv_bytes"] > 0
    assert after["compute"]["weight_bytes_per_step"] > 50e6 and after["compute"]["peak_flops"] is None

    # The trip, by the response's id (its first choice's engine request).
    trip = httpx.get(f"{base_url}/kvserve/stats/requests/{reply.id}").json()
    assert trip["id"] == f"{reply.id}-0" and trip["finish_reason"] == "length"
    assert trip["decode"]["tokens"] == 8 and len(trip["decode_steps_ms"]) == trip["decode"]["steps"] >= 1
    assert len(trip["prefill_chunks"]) == trip["prefill"]["chunks"] >= 1
    assert sum(c["tokens"] for c in trip["prefill_chunks"]) == trip["prefill"]["tokens_computed"]
    first_token = trip["received_to_queued_ms"] + trip["first_token_ms"]
    assert abs(trip["prefill_chunks"][-1]["end_ms"] - first_token) < 1e-2  # the last chunk sampled the first token
    assert trip["decode_steps_ms"] == sorted(trip["decode_steps_ms"]) and trip["decode_steps_ms"][0] > first_token
    assert any(r["id"] == f"{reply.id}-0" for r in after["recent"])


def test_unknown_trip_and_asset_are_404_in_openai_shape(base_url: str) -> None:
    for path in ("/kvserve/stats/requests/cmpl-nope", "/dashboard/../app.py", "/dashboard/nope.js"):
        response = httpx.get(f"{base_url}{path}")
        assert response.status_code == 404, path
        assert response.json()["error"]["type"] == "not_found_error"


def test_the_page_and_its_assets_are_served_and_fetch_nothing_elsewhere(base_url: str) -> None:
    page = httpx.get(f"{base_url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for src in re.findall(r'(?:src|href)="([^"]+)"', page.text):
        assert not src.startswith(("http:", "https:", "//")), src
    for name, media_type in ASSETS.items():
        response = httpx.get(f"{base_url}/dashboard/{name}")
        assert response.status_code == 200 and response.headers["content-type"].startswith(media_type)
    # No address outside the server in the page's own code (the SVG namespace is a name, not a fetch).
    own = (STATIC / "dashboard.js").read_text() + (STATIC / "dashboard.html").read_text()
    assert set(re.findall(r"https?://[^\s\"'`)]+", own)) <= {"http://www.w3.org/2000/svg"}


def test_percentiles_are_nearest_rank() -> None:
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert percentiles([0.004, 0.001, 0.003, 0.002], scale=1e3) == {"p50": 2.0, "p90": 4.0, "p99": 4.0}
    assert percentiles([float(i) for i in range(1, 101)], scale=1) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}


def test_compute_model_names_its_hardware_and_counts_like_the_cost_model() -> None:
    from types import SimpleNamespace

    import pytest
    import torch

    from kvserve import costs
    from kvserve.bench.model_presets import load_arch
    from kvserve.errors import InvalidRequest
    from kvserve.server.live_stats import compute_model

    shape = load_arch("smollm2-135m")
    engine = SimpleNamespace(arch=shape, model=SimpleNamespace(weight_nbytes=lambda: 1234), dtype=torch.bfloat16)
    model = compute_model(engine, "h100")  # type: ignore[arg-type]
    assert model.describe() == {"weight_bytes_per_step": 1234, "hardware": "H100 SXM", "peak_flops": 989e12,
                                "peak_bandwidth": 3.35e12}
    flops, kv = model.request(300, 100, 20)
    assert flops == sum(costs.request_flops(shape, 300, 100, 20))
    assert kv == sum(costs.request_kv_bytes(shape, 300, 100, 20, 2))
    assert compute_model(engine, None).hardware is None  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="unknown hardware"):
        compute_model(engine, "tpu-v9")  # type: ignore[arg-type]


def test_request_latencies_from_the_stage_timestamps() -> None:
    from kvserve.request import RequestMetrics

    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, last_token_time=12.0,
                       finished_time=12.25, token_times=[11.0, 11.25, 11.75, 12.0])
    lat = m.latencies(num_output_tokens=5)  # four steps: the last one accepted a draft
    assert (lat.queue_s, lat.ttft_s, lat.prefill_s, lat.decode_s, lat.e2e_s) == (0.5, 1.0, 0.5, 1.0, 2.25)
    assert lat.tpot_s == 0.25 and lat.itls_s == (0.25, 0.5, 0.25)
    queued_only = RequestMetrics(arrival_time=1.0, first_scheduled_time=3.0).latencies(0)
    assert queued_only.queue_s == 2.0 and queued_only.ttft_s is None and queued_only.itls_s == ()
