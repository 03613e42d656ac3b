"""Overload: open-loop arrivals well past what one ``kvserve serve`` can do, then a load it can carry again.
Loopback only; stops by itself.

    python benchmarks/overload.py [--max-waiting 16] [--max-seqs 8] [--overload 4] [--duration 60]
                                  [--output FILE]

1. capacity: --max-seqs closed-loop clients for --duration / 4 s; requests finished per second.
2. overload: Poisson arrivals at --overload x capacity for --duration s. The server must shed what it cannot
   queue with 429 and ``Retry-After`` (its queue is --max-waiting requests), and the requests it admits must
   get their first token within the stated bound: the capacity phase's TTFT p99 plus the time the queue takes
   to drain, --max-waiting / capacity, with 50% margin.
3. recovery: arrivals at half the capacity for --duration / 2 s: no 429, TTFT p99 back within twice the
   capacity phase's.
Resident memory is sampled every second: it must not grow by more than --rss-growth-mb over the run.
Each request: a distinct ~120-token prompt, 32 tokens streamed back, greedy. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import Server, emit  # noqa: E402

MODEL_NAME = "overload"
OUTPUT_TOKENS = 32


@dataclass
class Sent:
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    retry_after: bool = False


@dataclass
class Phase:
    name: str
    rate_per_s: float
    duration_s: float
    sent: int = 0
    ok: int = 0
    shed_429: int = 0
    shed_429_without_retry_after: int = 0
    other: dict[str, int] = field(default_factory=dict)
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    finished_per_s: float = 0.0


@dataclass
class Report:
    max_waiting: int
    max_seqs: int
    phases: list[Phase] = field(default_factory=list)
    capacity_per_s: float = 0.0
    ttft_bound_s: float = 0.0
    rss_mb_start: float = 0.0
    rss_mb_max: float = 0.0
    failures: list[str] = field(default_factory=list)


def prompt(i: int) -> str:
    return f"Request {i}. " + " ".join(f"Item {i}-{k}: a short note about caching and batching." for k in range(12))


async def one(client: httpx.AsyncClient, i: int, **fields: object) -> Sent:
    """Request ``i`` (OUTPUT_TOKENS streamed, greedy; ``fields`` added to its body), timed to its first token
    and to its end."""
    body = {"model": MODEL_NAME, "prompt": prompt(i), "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True, **fields}
    sent, start = Sent(), time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            sent.status = response.status_code
            sent.retry_after = "retry-after" in response.headers
            if response.status_code != 200:
                await response.aread()
                return sent
            async for line in response.aiter_lines():
                if line.startswith("data: ") and sent.ttft_s is None and line != "data: [DONE]":
                    sent.ttft_s = time.monotonic() - start
        sent.e2e_s = time.monotonic() - start
    except httpx.TransportError:
        sent.status = -1
    return sent


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(phase: Phase, results: list[Sent]) -> Phase:
    phase.sent = len(results)
    phase.ok = sum(r.status == 200 for r in results)
    phase.shed_429 = sum(r.status == 429 for r in results)
    phase.shed_429_without_retry_after = sum(r.status == 429 and not r.retry_after for r in results)
    for r in results:
        if r.status not in (200, 429):
            phase.other[str(r.status)] = phase.other.get(str(r.status), 0) + 1
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    phase.ttft_p50_s, phase.ttft_p99_s = quantile(ttfts, 0.5), quantile(ttfts, 0.99)
    phase.finished_per_s = phase.ok / phase.duration_s
    return phase


async def closed_loop(url: str, clients: int, duration_s: float) -> Phase:
    results: list[Sent] = []
    stop_at = time.monotonic() + duration_s
    counter = iter(range(10**9))

    async def worker() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            while time.monotonic() < stop_at:
                results.append(await one(client, next(counter)))

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return summarise(Phase("capacity", 0.0, time.monotonic() - start), results)


async def open_loop(url: str, name: str, rate: float, duration_s: float, first_id: int, seed: int) -> Phase:
    rng = random.Random(seed)
    tasks: list[asyncio.Task[Sent]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        start = time.monotonic()
        next_at = start
        i = first_id
        while next_at < start + duration_s:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.create_task(one(client, i)))
            i += 1
            next_at += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
    return summarise(Phase(name, rate, duration_s), list(results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-waiting", type=int, default=16, help="the server's --max-waiting-requests")
    parser.add_argument("--max-seqs", type=int, default=8, help="the server's --max-num-seqs")
    parser.add_argument("--overload", type=float, default=4.0, help="arrival rate as a multiple of capacity")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--rss-growth-mb", type=float, default=64.0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the server is stopped

    report = Report(args.max_waiting, args.max_seqs)
    workdir = Path(tempfile.mkdtemp(prefix="kvserve-overload-"))
    server = Server(["--served-model-name", MODEL_NAME, "--max-num-seqs", str(args.max_seqs),
                     "--max-waiting-requests", str(args.max_waiting), "--max-model-len", "512"],
                    workdir / "server.log")
    stop = threading.Event()
    rss: list[float] = []
    try:
        server.wait_ready()
        capacity = asyncio.run(closed_loop(server.url, args.max_seqs, args.duration / 4))
        report.phases.append(capacity)
        report.capacity_per_s = capacity.finished_per_s
        report.rss_mb_start = server.resources()[0]

        def sample() -> None:
            while not stop.wait(1.0):
                rss.append(server.resources()[0])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        report.ttft_bound_s = 1.5 * ((capacity.ttft_p99_s or 0.0) + args.max_waiting / report.capacity_per_s)
        overload = asyncio.run(open_loop(server.url, "overload", args.overload * report.capacity_per_s,
                                         args.duration, 10**6, 1))
        recovery = asyncio.run(open_loop(server.url, "recovery", 0.5 * report.capacity_per_s, args.duration / 2,
                                         2 * 10**6, 2))
        report.phases += [overload, recovery]
        stop.set()
        sampler.join()
        report.rss_mb_max = max(rss, default=report.rss_mb_start)
    finally:
        stop.set()
        server.proc.terminate()
        server.wait(timeout_s=30)

    fail = report.failures.append
    for phase in report.phases:
        if phase.other:
            fail(f"{phase.name}: answers other than 200 and 429: {phase.other}")
        if phase.shed_429_without_retry_after:
            fail(f"{phase.name}: {phase.shed_429_without_retry_after} 429s without Retry-After")
    overload, recovery = report.phases[1], report.phases[2]
    if overload.shed_429 == 0:
        fail("overload: nothing was shed")
    if overload.ttft_p99_s is None or overload.ttft_p99_s > report.ttft_bound_s:
        fail(f"overload: admitted TTFT p99 {overload.ttft_p99_s} s over the bound {report.ttft_bound_s:.2f} s")
    capacity_p99 = report.phases[0].ttft_p99_s or 0.0
    if recovery.shed_429 or recovery.ttft_p99_s is None or recovery.ttft_p99_s > 2 * capacity_p99:
        fail(f"recovery: {recovery.shed_429} shed, TTFT p99 {recovery.ttft_p99_s} s (capacity phase {capacity_p99} s)")
    if report.rss_mb_max > report.rss_mb_start + args.rss_growth_mb:
        fail(f"resident memory grew from {report.rss_mb_start:.0f} to {report.rss_mb_max:.0f} MiB")
    return emit(report, args.output)


if __name__ == "__main__":
    sys.exit(main())
