"""What the live dashboard reads: a JSON snapshot of the engine and the server (``GET /kvserve/stats``) and
the trips of recent requests (``GET /kvserve/stats/requests/{id}``).

Counters in the snapshot are cumulative since start-up: the page turns two snapshots into rates. Latency
percentiles are over the requests that finished in the last ``window_s`` seconds. Reading a snapshot
costs the engine nothing: its stats are the copy the engine thread took after its last step.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvserve import costs
from kvserve.arch import ArchConfig
from kvserve.engine import Engine, EngineStats
from kvserve.server.request_run import EngineRequest, request_timings


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One engine request's end, as the dashboard lists it and draws its trip."""

    request_id: str
    finished_at: float  # wall clock (time.time)
    ended: float  # the server's monotonic clock, for the latency window
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    itls_s: tuple[float, ...]
    trip: dict[str, Any]

    def summary(self) -> dict[str, Any]:
        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1e3, 2)

        return {"id": self.request_id, "finished_at": self.finished_at, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "output_tokens": self.output_tokens, "ttft_ms": ms(self.ttft_s), "e2e_ms": ms(self.e2e_s)}


def request_trip(child: EngineRequest, received_at: float) -> dict[str, Any]:
    """``request_timings`` plus when each prefill chunk, decode step and preemption happened, in ms after
    the HTTP request was received (the trip's time axis)."""
    assert child.last is not None
    m = child.last.metrics

    def offset(t: float) -> float:
        return round((t - received_at) * 1e3, 3)

    trip = request_timings(child, received_at)
    trip["id"] = child.request_id
    trip["prefill_chunks"] = [{"end_ms": offset(t), "tokens": n} for t, n in m.prefill_chunk_ends]
    trip["decode_steps_ms"] = [offset(t) for t in m.token_times[1:]]
    trip["preemptions_ms"] = [offset(t) for t in m.preemption_times]
    return trip


def finished_request(child: EngineRequest, received_at: float, finish_reason: str,
                     clock: Callable[[], float] = time.monotonic) -> FinishedRequest:
    assert child.last is not None
    m = child.last.metrics
    num_output = len(child.last.outputs[0].token_ids)
    lat = m.latencies(num_output)
    trip = request_trip(child, received_at)
    trip["finish_reason"] = finish_reason
    return FinishedRequest(child.request_id, time.time(), clock(), finish_reason, len(child.prompt_token_ids),
                           m.num_cached_tokens, num_output, lat.ttft_s, lat.tpot_s, lat.e2e_s, lat.itls_s, trip)


def percentiles(values: Sequence[float], scale: float = 1e3) -> dict[str, float | None]:
    """Nearest-rank p50 / p90 / p99 of ``values`` times ``scale`` (None when there are none)."""
    ordered = sorted(values)

    def rank(q: float) -> float | None:
        if not ordered:
            return None
        return round(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * scale, 3)
    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99)}


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """What the cost model (kvserve.costs) needs to turn requests into FLOPs and bytes, as ``kvserve bench``
    does: the model's shape, the bytes its weights take as held (read once per engine step), the bytes of
    one KV element, and the peaks of the hardware when the operator named it (``--hardware``)."""

    shape: ArchConfig
    weight_bytes: int
    kv_element_bytes: int
    hardware: costs.Hardware | None = None

    def request(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> tuple[float, float]:
        """(FLOPs, KV bytes) of one whole request."""
        prefill, decode = costs.request_flops(self.shape, prompt_tokens, cached_tokens, output_tokens)
        prefill_bytes, decode_bytes = costs.request_kv_bytes(self.shape, prompt_tokens, cached_tokens,
                                                             output_tokens, self.kv_element_bytes)
        return prefill + decode, prefill_bytes + decode_bytes

    def describe(self) -> dict[str, Any]:
        hw = self.hardware
        return {"weight_bytes_per_step": self.weight_bytes, "hardware": hw.name if hw else None,
                "peak_flops": hw.peak_flops() if hw else None, "peak_bandwidth": hw.memory_bandwidth if hw else None}


def compute_model(engine: Engine, hardware: str | None) -> ComputeModel:
    """The compute model of a loaded engine; ``hardware``: a known accelerator's name, or "measure" (this
    machine's matmul and copy rates, measured now for a second)."""
    peaks = None
    if hardware == "measure":
        peaks = costs.measure_peak(1.0)
    elif hardware:
        peaks = costs.get_hardware(hardware)
    return ComputeModel(engine.arch, engine.model.weight_nbytes(), engine.dtype.itemsize, peaks)


class RecentRequests:
    """The last ``capacity`` finished engine requests, and totals over every one since start-up (with a
    ``compute`` model, also their FLOPs and KV bytes)."""

    def __init__(self, capacity: int = 256, window_s: float = 60.0, compute: ComputeModel | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.window_s = window_s
        self.compute = compute
        self.clock = clock
        self._by_id: OrderedDict[str, FinishedRequest] = OrderedDict()
        self.totals: dict[str, float] = {"finished": 0, "aborted": 0, "prompt_tokens": 0,
                                         "cached_prompt_tokens": 0, "output_tokens": 0, "flops": 0.0,
                                         "kv_bytes": 0.0}

    def record(self, child: EngineRequest, received_at: float, finish_reason: str) -> None:
        """An engine request ended (``RequestRun`` calls this once per child that reached the engine)."""
        if child.last is None:
            return
        done = finished_request(child, received_at, finish_reason, self.clock)
        t = self.totals
        t["aborted" if finish_reason == "abort" else "finished"] += 1
        t["prompt_tokens"] += done.prompt_tokens
        t["cached_prompt_tokens"] += done.cached_tokens
        t["output_tokens"] += done.output_tokens
        if self.compute is not None:
            flops, kv_bytes = self.compute.request(done.prompt_tokens, done.cached_tokens, done.output_tokens)
            t["flops"] += flops
            t["kv_bytes"] += kv_bytes
        self._by_id[done.request_id] = done
        while len(self._by_id) > self.capacity:
            self._by_id.popitem(last=False)

    def trip(self, request_id: str) -> dict[str, Any] | None:
        """A recent request's trip; ``request_id`` may be an HTTP response's id (its first choice)."""
        done = self._by_id.get(request_id) or self._by_id.get(f"{request_id}-0")
        return None if done is None else done.trip

    def latest(self, n: int) -> list[dict[str, Any]]:
        return [done.summary() for done in list(self._by_id.values())[-n:][::-1]]

    def latency(self) -> dict[str, Any]:
        """Percentiles (ms) over the requests that finished within the window, aborted ones left out."""
        since = self.clock() - self.window_s
        window = [d for d in self._by_id.values() if d.ended >= since and d.finish_reason != "abort"]
        return {
            "window_s": self.window_s,
            "requests": len(window),
            "ttft_ms": percentiles([d.ttft_s for d in window if d.ttft_s is not None]),
            "tpot_ms": percentiles([d.tpot_s for d in window if d.tpot_s is not None]),
            "itl_ms": percentiles([itl for d in window for itl in d.itls_s]),
            "e2e_ms": percentiles([d.e2e_s for d in window if d.e2e_s is not None]),
        }


def stats_snapshot(stats: EngineStats, alive: bool, recent: RecentRequests, model: str, started_at: float,
                   num_recent: int = 20) -> dict[str, Any]:
    """The body of ``GET /kvserve/stats`` (documented in docs/dashboard.md)."""
    s = stats
    return {
        "model": model,
        "time": time.time(),
        "uptime_s": round(time.time() - started_at, 3),
        "alive": alive,
        "queue": {"waiting": s.num_waiting, "running": s.num_running, "prefilling": s.num_prefilling,
                  "decoding": s.num_running - s.num_prefilling},
        "requests": dict(recent.totals),
        "engine": {"steps": s.num_steps, "busy_time_s": round(s.busy_time_s, 6),
                   "prompt_tokens_computed": s.num_prompt_tokens_computed,
                   "generated_tokens": s.num_generated_tokens, "preemptions": s.num_preemptions},
        "kv": {
            "device": {"total": s.num_kv_blocks, "used": s.num_used_blocks, "cached": s.num_cached_blocks,
                       "free": s.num_free_blocks, "evicted": s.num_evicted_blocks},
            "prefix_cache": {"queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits},
            "cached_tokens_by_tier": dict(s.cached_tokens_by_tier),
            "tiers": {name: {**tier.as_dict(), "healthy": s.tiers_healthy.get(name, True)}
                      for name, tier in s.tiers.items()},
        },
        "speculative": {"method": s.spec_method, "draft_steps": s.num_draft_steps, "draft_tokens": s.num_draft_tokens,
                        "accepted_tokens": s.num_accepted_draft_tokens},
        "structured": {"constrained_tokens": s.num_constrained_tokens, "grammar": asdict(s.grammar)},
        "compute": recent.compute.describe() if recent.compute else None,
        "latency": recent.latency(),
        "recent": recent.latest(num_recent),
    }
