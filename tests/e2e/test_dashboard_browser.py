"""The live dashboard in real headless Chromium (Debian's package, driven by Playwright) against a real
``kvserve serve``: agentic traffic moves its counters, a request's trip shows its stages, and the page says
so when the server goes away and recovers when it comes back. (The gateway's page is checked in
test_router_real.py, over its replicas.)

Screenshots (under load, and of a trip) are saved to ``$KVSERVE_TEST_ARTIFACTS`` (else the test's tmp_path).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import headless_chromium
from tests.server.conftest import ENGINE_ARGS, ServerProcess

pytestmark = pytest.mark.slow
SYSTEM = "You are a coding agent. Tools: read_file(path), run_tests(). Answer in one short sentence. " * 6


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with headless_chromium() as chromium:
        if chromium is None:
            pytest.skip("headless Chromium through Playwright is not installed")
        yield chromium


def number(text: str) -> float:
    """The first number in a counter's text ("1,234 / 256" -> 1234)."""
    match = re.search(r"-?[\d,]+(\.\d+)?", text)
    assert match, f"no number in {text!r}"
    return float(match.group(0).replace(",", ""))


def agent_turns(base_url: str, sessions: int, turns: int) -> None:
    """Conversations that resend their history each turn, as an agent does: from the second turn on, the
    prompt's start is in the prefix cache."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    histories = [[{"role": "system", "content": SYSTEM}] for _ in range(sessions)]
    for turn in range(turns):
        for i, messages in enumerate(histories):
            messages.append({"role": "user", "content": f"Session {i}, step {turn}: what next?"})
            reply = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})


def test_dashboard_follows_traffic_draws_a_trip_and_survives_a_restart(browser, tmp_path: Path) -> None:
    artifacts = Path(os.environ.get("KVSERVE_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    args = [*ENGINE_ARGS, "--served-model-name", "smol"]
    server = ServerProcess(args, tmp_path / "server.log")
    restarted = None
    try:
        server.wait_ready()
        page = browser.new_page(viewport={"width": 1280, "height": 1300})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("request", lambda request: None if request.url.startswith(server.base_url)
                else errors.append(f"fetched {request.url}"))
        page.goto(f"{server.base_url}/dashboard")
        page.wait_for_selector("#status.live", timeout=10_000)
        assert page.inner_text("#finished-total") == "0"

        # A long stream holds KV blocks while the agents run: the page must show them in use.
        from openai import OpenAI

        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        long_stream = threading.Thread(target=lambda: list(client.completions.create(
            model="smol", prompt="Write a long story about caches.", max_tokens=96, stream=True,
            extra_body={"ignore_eos": True})))
        long_stream.start()
        page.wait_for_function("() => parseInt(document.getElementById('kv-used').textContent) > 0",
                               timeout=30_000)
        agent_turns(server.base_url, sessions=2, turns=3)
        page.wait_for_function("() => document.getElementById('queue-decoding').textContent !== '–'")
        page.wait_for_timeout(1500)  # a poll or two after the last turn, with the stream still going
        page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
        long_stream.join(timeout=120)
        page.wait_for_function("() => parseInt(document.getElementById('finished-total').textContent) >= 7",
                               timeout=10_000)
        assert number(page.inner_text("#hit-rate")) > 0  # the second turns found their history cached
        assert number(page.inner_text("#kv-cached")) > 0
        assert page.locator("#tiers tr[data-tier=device]").count() == 1
        assert "GFLOP/s" in page.inner_text("#mfu") and "MFU and MBU with --hardware" in page.inner_text(
            "#compute-detail")
        # Every chart drew something: batch per step, latency, token rates, hit rates, compute.
        drawn = page.evaluate("""() => Object.fromEntries(Object.entries(charts).map(
            ([name, chart]) => [name, chart.data.slice(1).map(series => series.some(v => v > 0))]))""")
        assert drawn["batch"][:2] == [True, True] and drawn["tokens"] == [True, True], drawn
        assert drawn["latency"] == [True] * 4 and drawn["hits"][:2] == [True, True], drawn
        assert drawn["compute"] == [True, True], drawn

        # A request's trip: every stage of `kvserve trace`, with its prefill chunks and decode steps.
        page.locator("#recent tbody tr").first.click()
        page.wait_for_selector("#timeline g.stage[data-stage=decode] rect", timeout=10_000)
        stages = page.eval_on_selector_all("#timeline g.stage", "gs => gs.map(g => g.dataset.stage)")
        assert stages == ["tokenize", "queue", "cache lookup", "prefill", "first token", "decode", "finish"]
        assert page.locator("#timeline line.step").count() >= 5
        assert "prompt tokens found" in page.inner_text("#timeline")
        page.locator(".requests").screenshot(path=str(artifacts / "dashboard-trip.png"))
        page.fill("#trip-id", "chatcmpl-unknown")
        page.click("#trip-form button")
        page.wait_for_function("() => document.getElementById('timeline').textContent.includes('no recent request')")

        # The server goes away: the page says so; it comes back (same port): the page recovers.
        server.stop()
        page.wait_for_selector("#status.unreachable", timeout=10_000)
        restarted = ServerProcess(args, tmp_path / "server2.log", port=server.port)
        restarted.wait_ready()
        page.wait_for_selector("#status.live", timeout=10_000)
        page.wait_for_function("() => document.getElementById('finished-total').textContent === '0'")
        assert errors == [], errors
    finally:
        server.stop()
        if restarted is not None:
            restarted.stop()

