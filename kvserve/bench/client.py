"""An asyncio client for OpenAI-compatible servers: one streamed request → one ``RequestRecord``.

Timing follows vLLM's ``benchmark_serving`` so numbers compare, with one difference made explicit: the
first token is the first chunk that carries text (a chunk with only ``role`` is not a token; some
servers send it before any token exists). ITL is every gap between consecutive text-bearing chunks;
end-to-end latency runs from the send to the end of the stream.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestRecord:
    """What one request did, as the client saw it. Times are seconds; ``start_s`` is from the run's start."""

    request_id: int
    session_id: int = 0
    turn: int = 0
    kind: str = ""
    start_s: float = 0.0
    success: bool = False
    error: str = ""
    status_code: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0  # text-bearing chunks
    prompt_tokens: int | None = None
    output_tokens: int = 0
    output_tokens_from_usage: bool = False
    cached_tokens: int | None = None
    max_tokens: int = 0
    text: str = ""
    timings: dict[str, Any] | None = None

    @property
    def tpot_s(self) -> float | None:
        """(e2e − ttft) / (output_tokens − 1): time per output token after the first; None for ≤ 1 token."""
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How to phrase requests for a given server."""

    model: str | None = None
    endpoint: str = "chat"  # "chat" → /v1/chat/completions, "completions" → /v1/completions
    ignore_eos: bool = True  # also sends min_tokens = max_tokens, so output lengths are fixed where honoured
    return_timings: bool = False  # kvserve's per-request pipeline timings
    temperature: float = 0.0
    api_key: str | None = None
    extra_body: tuple[tuple[str, Any], ...] = ()

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


def build_payload(options: RequestOptions, *, messages: list[dict[str, str]] | None = None,
                  prompt: str | None = None, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.model:
        body["model"] = options.model
    if options.endpoint == "chat":
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    if options.ignore_eos:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
    if options.return_timings:
        body["return_timings"] = True
    body.update(dict(options.extra_body))
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, options: RequestOptions, payload: dict[str, Any],
                       record: RequestRecord, run_start: float) -> RequestRecord:
    """Send one streamed request and fill ``record``; never raises for a server or network failure."""
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    start = time.perf_counter()
    record.start_s = start - run_start
    record.max_tokens = int(payload.get("max_tokens") or 0)
    last = start
    text: list[str] = []
    try:
        async with client.stream("POST", options.path, json=payload, headers=headers) as response:
            record.status_code = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:500]}"
                record.e2e_s = time.perf_counter() - start
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    record.e2e_s = now - start
                    return record
                for choice in chunk.get("choices") or []:
                    piece = _chunk_text(choice)
                    if not piece:
                        continue
                    if record.num_chunks == 0:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    record.num_chunks += 1
                    text.append(piece)
                _read_usage(chunk, record)
                if chunk.get("timings"):
                    record.timings = chunk["timings"]
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        record.e2e_s = time.perf_counter() - start
        return record
    record.e2e_s = time.perf_counter() - start
    record.text = "".join(text)
    if not record.output_tokens_from_usage:
        record.output_tokens = record.num_chunks
    if record.num_chunks == 0 and record.output_tokens == 0:
        record.error = "no tokens in the response"
        return record
    if record.num_chunks == 0:
        # Every token came in chunks without text (e.g. all special tokens): no first-token time.
        record.ttft_s = record.e2e_s
    record.success = True
    return record


def _read_usage(chunk: dict[str, Any], record: RequestRecord) -> None:
    usage = chunk.get("usage")
    if not isinstance(usage, dict):
        return
    if usage.get("prompt_tokens") is not None:
        record.prompt_tokens = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        record.output_tokens = int(usage["completion_tokens"])
        record.output_tokens_from_usage = True
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        record.cached_tokens = int(details["cached_tokens"])


# --------------------------------------------------------------------------------------------------
# Server introspection: /metrics and /v1/models
# --------------------------------------------------------------------------------------------------


def parse_prometheus(text: str, include_gauges: bool = False) -> dict[str, float]:
    """Sample name → value summed over label sets (``kvserve:prompt_tokens_total`` → 1234.0).

    Gauges are left out unless asked for: a benchmark diffs counters and histograms before and after.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "gauge" and not include_gauges:
            continue
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


async def fetch_metrics(client: httpx.AsyncClient) -> dict[str, float] | None:
    try:
        response = await client.get("/metrics")
        if response.status_code != 200:
            return None
        return parse_prometheus(response.text)
    except (httpx.HTTPError, ValueError) as exc:
        logger.info("no /metrics: %s", exc)
        return None


async def fetch_models(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    try:
        response = await client.get("/v1/models")
        if response.status_code != 200:
            return []
        data = response.json().get("data")
        return data if isinstance(data, list) else []
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        logger.info("no /v1/models: %s", exc)
        return []
