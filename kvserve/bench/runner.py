"""The load generator: sessions from a workload, sent to a server in a closed or open loop.

- Closed loop (``concurrency=C``): C workers; each takes the next session and sends its turns one after
  another, each turn when the previous reply has arrived (C sessions in flight).
- Open loop (``request_rate=R``): sessions start at Poisson arrival times of rate R / mean turns per
  session, so requests are offered at about R per second; a session's later turns still wait for the
  earlier replies. ``max_concurrency`` optionally caps the requests in flight. A replay trace without a
  rate or concurrency starts each request at its own timestamp.
- Bounds: ``num_requests`` and/or ``duration_s`` (no request starts after it; those in flight finish).

One process, one event loop, one HTTP connection pool: the client stays light on a small machine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlparse

import httpx

from kvserve import costs
from kvserve.bench import compute
from kvserve.bench.client import (
    RequestOptions,
    RequestRecord,
    build_payload,
    fetch_metrics,
    fetch_models,
    send_request,
)
from kvserve.bench.model_presets import load_arch
from kvserve.bench.report import SLO, summarize
from kvserve.bench.workloads import (
    Conversation,
    Session,
    Workload,
    WorkloadConfig,
    poisson_arrivals,
    render_plain,
)
from kvserve.errors import InvalidRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ComputeOptions:
    """How to turn a run into MFU / MBU (kvserve servers only: needs /metrics)."""

    model_config: str | None = None  # preset name or GGUF / HF path; else /v1/models "root" if readable here
    hardware: str | None = None  # a name from costs.HARDWARE, or "measure"
    peak_tflops: float | None = None
    peak_bandwidth_gbs: float | None = None
    weight_bytes: float = 2
    kv_bytes: float = 2


@dataclass(frozen=True, slots=True)
class BenchConfig:
    base_url: str
    workload: WorkloadConfig
    options: RequestOptions = field(default_factory=RequestOptions)
    concurrency: int | None = None
    request_rate: float | None = None
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    slo: SLO = field(default_factory=SLO)
    timeout_s: float = 600.0
    progress: bool = True
    return_timings: bool | None = None  # None: on when the server is kvserve
    compute: ComputeOptions = field(default_factory=ComputeOptions)

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.request_rate is not None:
            raise InvalidRequest("give --concurrency or --request-rate, not both", "concurrency")
        if self.concurrency is not None and self.concurrency < 1:
            raise InvalidRequest(f"concurrency must be >= 1, got {self.concurrency}", "concurrency")
        if self.request_rate is not None and not (math.isfinite(self.request_rate) and self.request_rate > 0):
            raise InvalidRequest(f"request rate must be > 0, got {self.request_rate}", "request_rate")
        if self.num_requests is not None and self.num_requests < 1:
            raise InvalidRequest(f"num_requests must be >= 1, got {self.num_requests}", "num_requests")
        if self.duration_s is not None and not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise InvalidRequest(f"duration must be a finite number of seconds > 0, got {self.duration_s}", "duration")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidRequest(f"max concurrency must be >= 1, got {self.max_concurrency}", "max_concurrency")

    @property
    def load_label(self) -> dict[str, Any]:
        if self.concurrency is not None:
            return {"kind": "concurrency", "value": self.concurrency, "label": f"c={self.concurrency}"}
        if self.request_rate is not None:
            return {"kind": "request_rate", "value": self.request_rate, "label": f"r={self.request_rate:g}/s"}
        return {"kind": "trace", "value": self.workload.time_scale, "label": f"trace x{self.workload.time_scale:g}"}


class _Budget:
    """Hands out request ids until the request count or the time limit is reached."""

    def __init__(self, num_requests: int | None, deadline: float | None, bar: Any) -> None:
        self.num_requests = num_requests
        self.deadline = deadline
        self.next_id = 0
        self.records: list[RequestRecord] = []
        self.bar = bar

    def take(self) -> int | None:
        if self.num_requests is not None and self.next_id >= self.num_requests:
            return None
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return None
        self.next_id += 1
        return self.next_id - 1

    @property
    def exhausted(self) -> bool:
        return (self.num_requests is not None and self.next_id >= self.num_requests) or (
            self.deadline is not None and time.perf_counter() >= self.deadline)

    def done(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self.bar is not None:
            self.bar.update(1)


async def _run_session(client: httpx.AsyncClient, options: RequestOptions, session: Session, budget: _Budget,
                       run_start: float, limiter: asyncio.Semaphore | None, first_id: int | None = None) -> None:
    conversation = Conversation(session.system)
    for turn_index, turn in enumerate(session.turns):
        request_id = first_id if turn_index == 0 and first_id is not None else budget.take()
        if request_id is None:
            return
        messages = conversation.with_turn(turn.message)
        if options.endpoint == "chat":
            payload = build_payload(options, messages=messages, max_tokens=turn.max_tokens)
        else:
            payload = build_payload(options, prompt=render_plain(messages), max_tokens=turn.max_tokens)
        record = RequestRecord(request_id, session.session_id, turn_index, session.kind)
        if limiter is None:
            await send_request(client, options, payload, record, run_start)
        else:
            async with limiter:
                await send_request(client, options, payload, record, run_start)
        budget.done(record)
        if not record.success:
            logger.debug("request %d failed: %s", request_id, record.error)
            return  # the conversation cannot go on without the reply
        conversation.append(turn.message, record.text)


async def _closed_loop(client: httpx.AsyncClient, options: RequestOptions, sessions: Iterator[Session],
                       concurrency: int, budget: _Budget, run_start: float) -> None:
    async def worker() -> None:
        while not budget.exhausted:
            session = next(sessions, None)
            if session is None:
                return
            await _run_session(client, options, session, budget, run_start, None)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _open_loop(client: httpx.AsyncClient, options: RequestOptions, sessions: Iterator[Session],
                     arrivals: Iterator[float] | None, budget: _Budget, run_start: float,
                     limiter: asyncio.Semaphore | None) -> None:
    tasks: list[asyncio.Task[None]] = []
    for session in sessions:
        at = next(arrivals) if arrivals is not None else (session.arrival_s or 0.0)
        delay = run_start + at - time.perf_counter()
        if budget.deadline is not None and run_start + at >= budget.deadline:
            break
        if delay > 0:
            await asyncio.sleep(delay)
        first_id = budget.take()  # taken here, so the loop stops as soon as the budget is spent
        if first_id is None:
            break
        tasks.append(asyncio.create_task(
            _run_session(client, options, session, budget, run_start, limiter, first_id)))
        # Let finished tasks go; keep the list short on long runs.
        if len(tasks) > 1024:
            tasks = [t for t in tasks if not t.done()]
    await asyncio.gather(*tasks)


async def run_bench_async(config: BenchConfig, transport: httpx.AsyncBaseTransport | None = None) -> dict[str, Any]:
    """Run one benchmark and return its result: config, summary, server deltas and raw records.

    ``transport`` replaces the network (tests pass an ``httpx.MockTransport`` or an ASGI app's).
    """
    workload = Workload(config.workload)
    num_requests = config.num_requests
    if num_requests is None and config.duration_s is None:
        num_requests = workload.finite_size or 64
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=config.base_url.rstrip("/"), timeout=timeout, limits=limits,
                                 transport=transport) as client:
        models = await fetch_models(client)
        before = await fetch_metrics(client)
        is_kvserve = before is not None and any(name.startswith("kvserve:") for name in before)
        options = config.options
        if options.model is None and models:
            options = replace(options, model=str(models[0].get("id")))
        timings = config.return_timings if config.return_timings is not None else is_kvserve
        options = replace(options, return_timings=timings)

        bar = _progress_bar(num_requests, config.progress)
        run_start = time.perf_counter()
        deadline = run_start + config.duration_s if config.duration_s is not None else None
        budget = _Budget(num_requests, deadline, bar)
        sessions = workload.sessions()
        limiter = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        try:
            if config.concurrency is not None:
                await _closed_loop(client, options, sessions, config.concurrency, budget, run_start)
            else:
                arrivals = None
                if config.request_rate is not None:
                    arrivals = poisson_arrivals(config.request_rate / workload.mean_turns(), config.workload.seed)
                elif config.workload.name != "replay":
                    arrivals = poisson_arrivals(math.inf, 0)  # no rate: everything at once, as vLLM's rate=inf
                await _open_loop(client, options, sessions, arrivals, budget, run_start, limiter)
        finally:
            if bar is not None:
                bar.close()
        duration = time.perf_counter() - run_start
        after = await fetch_metrics(client) if is_kvserve else None

    records = sorted(budget.records, key=lambda r: r.request_id)
    summary = summarize(records, duration, config.slo)
    delta = compute.metrics_delta(before, after)
    result: dict[str, Any] = {
        "config": _config_json(config, options, num_requests),
        "load": config.load_label,
        "summary": summary,
        "server": {"kvserve": is_kvserve, "models": models, "metrics_delta": delta},
        "requests": [r.to_json() for r in records],
    }
    if is_kvserve:
        result["summary"]["compute"] = _compute_section(config, models, records, delta, duration)
    return result


def _compute_section(config: BenchConfig, models: list[dict[str, Any]], records: list[RequestRecord],
                     delta: dict[str, float], duration: float) -> dict[str, Any] | None:
    opts = config.compute
    shape = None
    source = opts.model_config
    if source is None:
        root = next((m.get("root") for m in models if m.get("root")), None)
        if root and _is_local(config.base_url):
            source = str(root)
    if source is None:
        logger.warning("no model shape for MFU/MBU: pass --model-config (a preset, GGUF or HF directory)")
        return None
    try:
        shape = load_arch(source)
    except InvalidRequest as exc:
        logger.warning("cannot read the model shape from %s: %s", source, exc)
        return None
    return compute.run_compute(shape, records, delta, duration, resolve_hardware(opts),
                               weight_bytes=opts.weight_bytes, kv_bytes=opts.kv_bytes)


def resolve_hardware(opts: ComputeOptions) -> costs.Hardware | None:
    if opts.peak_tflops is not None and opts.peak_bandwidth_gbs is not None:
        return costs.Hardware("given peak", opts.peak_tflops * 1e12, None, opts.peak_bandwidth_gbs * 1e9,
                              source="--peak-tflops/--peak-bandwidth-gbs")
    if opts.hardware is None:
        return None
    if opts.hardware == "measure":
        return costs.measure_peak()
    return costs.get_hardware(opts.hardware)


def _is_local(url: str) -> bool:
    return (urlparse(url).hostname or "") in ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def _progress_bar(total: int | None, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, desc="bench", dynamic_ncols=True)


def _config_json(config: BenchConfig, options: RequestOptions, num_requests: int | None) -> dict[str, Any]:
    w = config.workload
    return {
        "base_url": config.base_url, "model": options.model, "endpoint": options.endpoint,
        "ignore_eos": options.ignore_eos, "return_timings": options.return_timings,
        "workload": {"name": w.name, "seed": w.seed, "input_len": w.input_len, "output_len": w.output_len,
                     "turns": w.turns, "num_docs": w.num_docs, "doc_len": w.doc_len,
                     "questions_per_doc": w.questions_per_doc, "mix": dict(w.mix), "trace": w.trace,
                     "time_scale": w.time_scale},
        "concurrency": config.concurrency, "request_rate": config.request_rate,
        "max_concurrency": config.max_concurrency, "num_requests": num_requests, "duration_s": config.duration_s,
        "slo": config.slo.to_json(),
    }


def run_bench(config: BenchConfig) -> dict[str, Any]:
    return asyncio.run(run_bench_async(config))


def run_sweep(config: BenchConfig, values: list[float]) -> list[dict[str, Any]]:
    """One run per load value (concurrencies in closed-loop mode, rates in open-loop mode).

    Each point uses seed + its index, so a point's conversations are not exact repeats of the previous
    point's (which the server would have cached); the agentic system prompt is shared by all points.
    """
    points = []  # every point's configuration checked before the first runs
    for index, value in enumerate(values):
        workload = replace(config.workload, seed=config.workload.seed + index)
        if config.request_rate is not None:
            points.append(replace(config, workload=workload, request_rate=float(value)))
        elif not float(value).is_integer():
            raise InvalidRequest(f"a concurrency sweep takes whole numbers, got {value}", "sweep")
        else:
            points.append(replace(config, workload=workload, concurrency=int(value)))
    return [run_bench(point) for point in points]
