"""Priority scheduling under a backlog: what an urgent request waits for behind background work, with
``--scheduling-policy priority`` against the same traffic under ``fcfs``. Loopback only; stops by itself.

    python benchmarks/priority_scheduling.py [--background 48] [--urgent 8] [--max-seqs 4] [--output FILE]

For each policy, one ``kvserve serve`` (the default model, --max-num-seqs slots): --background requests sent
at once (priority 1), then --urgent requests (priority -1) one every --urgent-every s while the backlog drains.
Under fcfs the priorities are sent as 0 (the policy refuses others) and the client tells the classes apart.
Each request: a distinct ~120-token prompt, 32 tokens streamed back, greedy. Reported per policy and class:
time to first token and to the last (p50, p90), and the run's output tokens/s. Every answer must be a 200
(exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overload import MODEL_NAME, OUTPUT_TOKENS, Sent, one, quantile  # noqa: E402
from soak import Server, emit  # noqa: E402


@dataclass
class ClassFigures:
    requests: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None


@dataclass
class PolicyRun:
    policy: str
    duration_s: float
    output_tok_s: float
    urgent: ClassFigures
    background: ClassFigures


@dataclass
class Report:
    background: int
    urgent: int
    urgent_every_s: float
    max_seqs: int
    runs: list[PolicyRun] = field(default_factory=list)
    urgent_ttft_p50_fcfs_over_priority: float | None = None
    failures: list[str] = field(default_factory=list)


async def traffic(url: str, args: argparse.Namespace, send_priorities: bool) -> tuple[list[Sent], list[Sent], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=128)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.monotonic()
        background = [asyncio.create_task(one(client, i, priority=1 if send_priorities else 0))
                      for i in range(args.background)]
        urgent = []
        for k in range(args.urgent):
            await asyncio.sleep(args.urgent_every)
            urgent.append(asyncio.create_task(one(client, 10**6 + k, priority=-1 if send_priorities else 0)))
        done_urgent = await asyncio.gather(*urgent)
        done_background = await asyncio.gather(*background)
        return list(done_urgent), list(done_background), time.monotonic() - start


def figures(sent: list[Sent]) -> ClassFigures:
    ttfts = [s.ttft_s for s in sent if s.ttft_s is not None]
    e2es = [s.e2e_s for s in sent if s.e2e_s is not None]
    return ClassFigures(len(sent), quantile(ttfts, 0.5), quantile(ttfts, 0.9), quantile(e2es, 0.5),
                        quantile(e2es, 0.9))


def run_policy(policy: str, args: argparse.Namespace, workdir: Path, report: Report) -> PolicyRun:
    server = Server(["--served-model-name", MODEL_NAME, "--max-num-seqs", str(args.max_seqs),
                     "--max-waiting-requests", "1024", "--max-model-len", "512", "--scheduling-policy", policy],
                    workdir / f"server-{policy}.log")
    try:
        server.wait_ready()
        asyncio.run(traffic(server.url, argparse.Namespace(background=2, urgent=0, urgent_every=0), False))  # warm
        urgent, background, duration = asyncio.run(traffic(server.url, args, send_priorities=policy == "priority"))
    finally:
        server.proc.terminate()
        server.wait(timeout_s=30)
    statuses = [s.status for s in urgent + background]
    if any(status != 200 for status in statuses):
        report.failures.append(f"{policy}: answers other than 200: {sorted(set(statuses) - {200})}")
    ok = sum(status == 200 for status in statuses)
    run = PolicyRun(policy, duration, ok * OUTPUT_TOKENS / duration, figures(urgent), figures(background))
    print(f"{policy:8} urgent TTFT p50 {run.urgent.ttft_p50_s or 0:.2f} s, p90 {run.urgent.ttft_p90_s or 0:.2f} s; "
          f"background TTFT p50 {run.background.ttft_p50_s or 0:.2f} s; {run.output_tok_s:.1f} output tok/s",
          file=sys.stderr, flush=True)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--background", type=int, default=48, help="background requests, sent at once")
    parser.add_argument("--urgent", type=int, default=8, help="urgent requests, sent one by one behind them")
    parser.add_argument("--urgent-every", type=float, default=0.5, help="seconds between urgent requests")
    parser.add_argument("--max-seqs", type=int, default=4, help="the server's --max-num-seqs")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.background < 1 or args.urgent < 1 or args.max_seqs < 1 or not args.urgent_every > 0:
        parser.error("--background, --urgent and --max-seqs must be at least 1, --urgent-every above 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the server is stopped
    report = Report(args.background, args.urgent, args.urgent_every, args.max_seqs)
    workdir = Path(tempfile.mkdtemp(prefix="kvserve-priority-"))
    for policy in ("fcfs", "priority"):
        report.runs.append(run_policy(policy, args, workdir, report))
    fcfs, priority = (run.urgent.ttft_p50_s for run in report.runs)
    if fcfs and priority:
        report.urgent_ttft_p50_fcfs_over_priority = fcfs / priority
    return emit(report, args.output)


if __name__ == "__main__":
    sys.exit(main())
