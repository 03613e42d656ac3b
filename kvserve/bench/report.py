"""Benchmark metrics from raw per-request records, with vLLM ``benchmark_serving``'s definitions.

- duration: from the first send to the end of the last request; throughputs divide by it.
- request/s = successful requests / duration; output tok/s = Σ output tokens / duration; total tok/s =
  (Σ prompt tokens + Σ output tokens) / duration (successful requests only).
- TTFT per request; TPOT per request = (e2e − TTFT) / (output tokens − 1), requests with more than one
  output token; ITL = every gap between consecutive token chunks, pooled over requests; e2e latency.
  Each as mean, p50, p90, p99 in milliseconds (``numpy.percentile``, linear interpolation, as vLLM).
- goodput = requests meeting every given SLO / duration; a request with one output token has TPOT 0.
- cache hit rate = Σ cached_tokens / Σ prompt_tokens over successful requests whose usage reports both.
- output tokens come from ``usage.completion_tokens`` when the server sends it, else counted chunks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.bench.client import RequestRecord
from kvserve.errors import InvalidRequest

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objectives in milliseconds; None means no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.success:
            return False
        tpot = record.tpot_s or 0.0  # vLLM: one output token counts as TPOT 0
        checks = ((self.ttft_ms, record.ttft_s), (self.tpot_ms, tpot), (self.e2e_ms, record.e2e_s))
        return all(limit is None or value * 1e3 <= limit for limit, value in checks)

    def to_json(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms}


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*$")


def parse_slo(text: str | None) -> SLO:
    """``"ttft=500ms,tpot=50ms,e2e=2s"`` → SLO(500, 50, 2000). A bare number is milliseconds."""
    if not text:
        return SLO()
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, raw = part.partition("=")
        key = key.strip().lower().replace("e2el", "e2e")
        match = _DURATION.match(raw)
        if key not in ("ttft", "tpot", "e2e") or match is None:
            raise InvalidRequest(f"bad SLO {part!r}; expected e.g. ttft=500ms,tpot=50ms,e2e=2s", "slo")
        scale = {"s": 1e3, "ms": 1.0, "us": 1e-3, None: 1.0}[match.group(2)]
        values[f"{key}_ms"] = float(match.group(1)) * scale
    return SLO(**values)


def latency_stats(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (and std) of ``values_s`` in milliseconds; None for an empty list."""
    if len(values_s) == 0:
        return {"mean": None, "std": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(ms.mean()), "std": float(ms.std()),
            **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def summarize(records: Iterable[RequestRecord], duration_s: float, slo: SLO | None = None) -> dict[str, Any]:
    """The report's numbers, computed from the raw records only."""
    records = list(records)
    ok = [r for r in records if r.success]
    with_usage = [r for r in ok if r.prompt_tokens is not None]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    with_cache = [r for r in ok if r.prompt_tokens is not None and r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in with_cache)
    cache_prompt = sum(r.prompt_tokens or 0 for r in with_cache)
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    dur = duration_s if duration_s > 0 else math.nan

    summary: dict[str, Any] = {
        "num_requests": len(records),
        "successful_requests": len(ok),
        "failed_requests": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": cached,
        "requests_with_usage": len(with_usage),
        "output_tokens_from_usage": sum(r.output_tokens_from_usage for r in ok),
        "request_throughput": len(ok) / dur,
        "output_throughput": output_tokens / dur,
        "total_token_throughput": (input_tokens + output_tokens) / dur,
        "cache_hit_rate": cached / cache_prompt if cache_prompt else None,
        "ttft_ms": latency_stats([r.ttft_s for r in ok]),
        "tpot_ms": latency_stats(tpots),
        "itl_ms": latency_stats(itls),
        "e2e_ms": latency_stats([r.e2e_s for r in ok]),
    }
    if slo is not None and not slo.empty:
        good = sum(slo.met_by(r) for r in records)
        summary["slo"] = slo.to_json()
        summary["good_requests"] = good
        summary["request_goodput"] = good / dur
    errors: dict[str, int] = {}
    for r in records:
        if not r.success:
            key = r.error.split(":", 1)[0] or "unknown"
            errors[key] = errors.get(key, 0) + 1
    summary["errors"] = errors
    return summary


# --------------------------------------------------------------------------------------------------
# The terminal table
# --------------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def format_table(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    width = 52
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{label:<36}{_fmt(value, digits):>16}")

    def section(label: str) -> None:
        lines.append(f"{label:-^{width}}")

    row("Successful requests:", summary["successful_requests"])
    row("Failed requests:", summary["failed_requests"])
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if "request_goodput" in summary:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    hit = summary["cache_hit_rate"]
    row("Prefix cache hit rate (%):", None if hit is None else 100.0 * hit)
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                      ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        section(name)
        short = key.split("_")[0].upper()
        stats = summary[key]
        row(f"Mean {short} (ms):", stats["mean"])
        for p in PERCENTILES:
            row(f"P{p} {short} (ms):", stats[f"p{p}"])
    compute = summary.get("compute")
    if compute:
        section("Compute (cost model)")
        row("Prefill TFLOP:", compute["prefill_flops"] / 1e12, 3)
        row("Decode TFLOP:", compute["decode_flops"] / 1e12, 3)
        row("Decode GB moved:", compute["decode_bytes"] / 1e9, 3)
        row("Engine busy (s):", compute["busy_s"])
        row("Achieved TFLOP/s:", compute["flops_per_s"] / 1e12, 4)
        row("Achieved GB/s:", compute["bytes_per_s"] / 1e9, 2)
        if compute.get("mfu") is not None:
            row("MFU (%):", 100 * compute["mfu"], 3)
            row("  of which prefill (%):", 100 * compute["mfu_prefill"], 3)
            row("  of which decode (%):", 100 * compute["mfu_decode"], 3)
            row("MBU (%):", 100 * compute["mbu"], 3)
            row("  of which prefill (%):", 100 * compute["mbu_prefill"], 3)
            row("  of which decode (%):", 100 * compute["mbu_decode"], 3)
            lines.append(f"  peak: {compute['hardware']}")
    if summary.get("errors"):
        section("Errors")
        for name, count in summary["errors"].items():
            row(f"{name[:34]}:", count)
    lines.append("=" * width)
    return "\n".join(lines)


def format_sweep(results: Sequence[dict[str, Any]]) -> str:
    """One line per sweep point: load, req/s, output tok/s, p50/p99 TTFT, p99 TPOT, hit rate."""
    head = f"{'load':>10} {'req/s':>8} {'out tok/s':>10} {'p50 TTFT':>10} {'p99 TTFT':>10} {'p99 TPOT':>10} {'hit %':>6}"
    lines = [head]
    for result in results:
        s = result["summary"]
        hit = s["cache_hit_rate"]
        lines.append(f"{result['load']['label']:>10} {_fmt(s['request_throughput']):>8} "
                     f"{_fmt(s['output_throughput'], 1):>10} {_fmt(s['ttft_ms']['p50'], 1):>10} "
                     f"{_fmt(s['ttft_ms']['p99'], 1):>10} {_fmt(s['tpot_ms']['p99'], 1):>10} "
                     f"{_fmt(None if hit is None else 100 * hit, 1):>6}")
    return "\n".join(lines)
