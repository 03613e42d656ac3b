"""``kvserve trace``: one request's trip through a kvserve server, drawn as a plain-text timeline.

The request asks for ``return_timings``; the server answers with milliseconds between its pipeline
stages (see ``request_timings`` in ``kvserve/server/request_run.py``). Stages, on the server's clock
from the moment the HTTP request was received:

    tokenize     received → queued (validation, chat template, tokenizing, hand-off to the engine)
    queue        queued → first scheduled
    cache lookup at scheduling: prompt tokens found in the prefix cache (a marker, no duration)
    prefill      first scheduled → first token, in N chunks
    first token  a marker
    decode       first token → last token, in N steps
    detokenize   last token → finished (final detokenize, stop checks)
    client       what the client saw beyond the server's own stages (network, SSE, the client's parsing)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import httpx

from kvserve.bench.client import RequestOptions, RequestRecord, build_payload, fetch_models, send_request
from kvserve.errors import KVServeError

BAR_WIDTH = 48


class TraceError(KVServeError):
    """The traced request failed or the server returned no timings."""


async def trace_request_async(base_url: str, prompt: str, options: RequestOptions, max_tokens: int,
                              timeout_s: float = 300.0) -> RequestRecord:
    options = replace(options, return_timings=True)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s) as client:
        if options.model is None:
            models = await fetch_models(client)
            if models:
                options = replace(options, model=str(models[0].get("id")))
        if options.endpoint == "chat":
            payload = build_payload(options, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)
        else:
            payload = build_payload(options, prompt=prompt, max_tokens=max_tokens)
        record = RequestRecord(0, kind="trace")
        await send_request(client, options, payload, record, time.perf_counter())
    if not record.success:
        raise TraceError(f"the request failed: {record.error}")
    if not record.timings:
        raise TraceError("the server returned no timings (is it a kvserve server? it must honour return_timings)")
    return record


def trace_request(base_url: str, prompt: str, options: RequestOptions, max_tokens: int) -> RequestRecord:
    return asyncio.run(trace_request_async(base_url, prompt, options, max_tokens))


def timeline_stages(timings: dict[str, Any], client_e2e_ms: float | None = None) -> list[tuple[str, float, float, str]]:
    """(label, start ms, duration ms, detail) per stage; markers have duration 0."""

    def num(value: Any) -> float:
        return float(value) if value is not None else 0.0

    tokenize = num(timings.get("received_to_queued_ms"))
    queued = num(timings.get("queued_ms"))
    prefill = timings.get("prefill") or {}
    decode = timings.get("decode") or {}
    lookup = timings.get("cache_lookup") or {}
    prefill_ms, decode_ms = num(prefill.get("ms")), num(decode.get("ms"))
    first = tokenize + num(timings.get("first_token_ms"))
    finished = tokenize + num(timings.get("finished_ms"))
    scheduled = tokenize + queued
    last_token = first + decode_ms
    cached, prompt = lookup.get("cached_tokens", 0), lookup.get("prompt_tokens", 0)
    tiers = lookup.get("cached_tokens_by_tier") or {}
    tier_text = "" if not tiers else " (" + ", ".join(f"{k}: {v}" for k, v in tiers.items()) + ")"
    stages = [
        ("tokenize", 0.0, tokenize, "validate, template, tokenize"),
        ("queue", tokenize, queued, "waiting for a slot in the batch"),
        ("cache lookup", scheduled, 0.0, f"{cached}/{prompt} prompt tokens found{tier_text}"),
        ("prefill", scheduled, prefill_ms,
         f"{prefill.get('tokens_computed', 0)} tokens in {prefill.get('chunks', 0)} chunk(s)"),
        ("first token", first, 0.0, f"TTFT {first:.1f} ms (server)"),
        ("decode", first, decode_ms, f"{decode.get('tokens', 0)} tokens in {decode.get('steps', 0)} steps"),
        ("detokenize", last_token, max(finished - last_token, 0.0), f"finish: {timings.get('finish_reason')}"),
    ]
    if client_e2e_ms is not None:
        stages.append(("client", finished, max(client_e2e_ms - finished, 0.0), "network, SSE, client parsing"))
    return stages


def render_timeline(timings: dict[str, Any], client_ttft_ms: float | None = None,
                    client_e2e_ms: float | None = None, width: int = BAR_WIDTH) -> str:
    """The stages as proportional bars: each row's bar starts at its offset on a shared time axis."""
    stages = timeline_stages(timings, client_e2e_ms)
    total = max((start + length for _, start, length, _ in stages), default=0.0) or 1.0
    scale = width / total
    lines = [f"{'stage':<13}{'start ms':>10}{'ms':>10}  {'|' + ' ' * (width - 2) + '|'}"]
    for label, start, length, detail in stages:
        offset = min(int(round(start * scale)), width - 1)
        if length <= 0:
            bar = " " * offset + "◆"
        else:
            bar = " " * offset + "█" * max(1, min(int(round(length * scale)), width - offset))
        lines.append(f"{label:<13}{start:>10.1f}{length:>10.1f}  {bar:<{width}}  {detail}")
    lines.append(f"{'':<33}0{'':<{width - len(f'{total:.0f} ms') - 1}}{total:.0f} ms")
    if client_ttft_ms is not None and client_e2e_ms is not None:
        lines.append(f"client saw: TTFT {client_ttft_ms:.1f} ms, end-to-end {client_e2e_ms:.1f} ms; "
                     f"preemptions: {timings.get('preemptions', 0)}")
    return "\n".join(lines)
