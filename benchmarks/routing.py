"""Routing policies side by side: kvserve replicas behind ``kvserve route``, an agentic workload of several
distinct agents, and device KV pools too small for every agent's prefix, so that placement decides the hit rate.

    python benchmarks/routing.py [--replicas 2] [--agents 8] [--system-tokens 1500] [--sessions 32] [--turns 4]
                                 [--concurrency 8] [--kv-blocks 320] [--policies round_robin,least_load,cache_aware,kv_events,ttft]
                                 [--no-cache-baseline] [--redis [--redis-policies round_robin,cache_aware]]
                                 [--ray POLICY [--ray-throughput-optimized] [--ray-default-niceness]]
                                 [--output FILE] [--plot FILE]

Each policy gets fresh replicas (``kvserve serve``, one thread each unless --threads says otherwise) and a fresh
``kvserve route`` in front of them, then runs the same workload: session k belongs to agent k mod --agents
(a system prompt of its own, --system-tokens long), and sends --turns turns one after another, each resending the
whole conversation (with the replica's actual replies) plus a new message; --concurrency sessions run at once.

Reported per policy: prompt-token hit rate (usage.prompt_tokens_details.cached_tokens over prompt tokens), TTFT
p50/p90 (client-side, from sending to the first text chunk), output tokens/s over the run, the routing reasons,
and the balance check: the share of 0.2 s samples in which a replica had nothing in flight while another had more
than --balance-bound requests in flight. ``--no-cache-baseline`` adds round robin on replicas with the prefix
cache off. ``--redis`` repeats --redis-policies with all replicas writing their KV through to one shared
redis-server (started here on a free loopback port), so a prefix computed on one replica is a hit on the others.
``--ray POLICY`` runs POLICY once more with the replicas as a Ray Serve deployment (``kvserve ray``, on a local Ray
cluster started here on loopback), for its throughput against the same policy behind ``kvserve route``;
``--ray-throughput-optimized`` once more on a cluster in Ray Serve's throughput-optimized mode. The cluster
starts its workers (engines, ingress, proxy) at niceness 0, as `kvserve route` and its replicas run;
``--ray-default-niceness`` runs the deployment once more at Ray's default worker niceness. An empty
``--policies ""`` runs the Ray deployment alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serve_compare import cpu_description  # noqa: E402
from kvserve.bench.client import RequestOptions, RequestRecord, build_payload, send_request  # noqa: E402
from kvserve.bench.workloads import Conversation, _rng, words  # noqa: E402

MODEL_NAME = "smol"
RAY_DEFAULT_NICENESS = 15  # Ray's worker_niceness, what `ray start` gives its workers unless RAY_worker_niceness says


@dataclass
class PolicyResult:
    name: str
    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    seconds: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    reasons: dict[str, float]
    imbalanced_share: float
    samples: int
    ttfts_ms: list[float] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A kvserve command on a free loopback port, its output in a log file; stopped by PID."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", *command, "--host", "127.0.0.1",
                                      "--port", str(self.port), "--uvicorn-log-level", "warning"],
                                     cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.proc.args} not ready after {timeout_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def system_prompt(agent: int, num_tokens: int) -> str:
    rng = _rng(0, "agent", agent)
    return f"You are agent {agent}. Follow the playbook below.\n" + words(rng, num_tokens)


async def run_sessions(base_url: str, args: argparse.Namespace) -> tuple[list[RequestRecord], float]:
    options = RequestOptions(model=MODEL_NAME, ignore_eos=True)
    queue: asyncio.Queue[int] = asyncio.Queue()
    order = list(range(args.sessions))
    _rng(0, "order").shuffle(order)
    for k in order:
        queue.put_nowait(k)
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        start = time.perf_counter()

        async def worker() -> None:
            while not queue.empty():
                k = queue.get_nowait()
                conversation = Conversation(system_prompt(k % args.agents, args.system_tokens))
                rng = _rng(0, "session", k)
                for turn in range(args.turns):
                    message = f"Task {k}.{turn}: " + words(rng, args.user_tokens)
                    payload = build_payload(options, messages=conversation.with_turn(message),
                                            max_tokens=args.max_tokens)
                    record = RequestRecord(request_id=len(records), session_id=k, turn=turn)
                    records.append(await send_request(client, options, payload, record, start))
                    conversation.append(message, record.text)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return records, time.perf_counter() - start


def sample_balance(router_url: str, bound: int, stop: threading.Event, out: list[bool]) -> None:
    """Every 0.2 s: was a replica idle while another had more than ``bound`` requests in flight?"""
    while not stop.wait(0.2):
        try:
            text = httpx.get(f"{router_url}/metrics", timeout=2).text
        except httpx.TransportError:
            continue
        loads = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("kvserve_router:replica_in_flight{")]
        if loads:
            out.append(min(loads) == 0 and max(loads) > bound)


def router_reasons(router_url: str) -> dict[str, float]:
    reasons = {}
    for line in httpx.get(f"{router_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("kvserve_router:routing_decisions_total{"):
            label = line.split('reason="', 1)[1].split('"', 1)[0]
            reasons[label] = float(line.rsplit(" ", 1)[1])
    return reasons


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def measure(name: str, url: str, args: argparse.Namespace, router_metrics: bool) -> PolicyResult:
    """Run the workload against ``url``; with ``router_metrics``, sample balance and read routing reasons from
    the gateway's /metrics."""
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=sample_balance, args=(url, args.balance_bound, stop, samples))
    if router_metrics:
        sampler.start()
    records, seconds = asyncio.run(run_sessions(url, args))
    stop.set()
    if router_metrics:
        sampler.join()
    ok = [r for r in records if r.success]
    ttfts = [r.ttft_s * 1e3 for r in ok]
    return PolicyResult(
        name=name, requests=len(records), failed=len(records) - len(ok),
        prompt_tokens=sum(r.prompt_tokens or 0 for r in ok), cached_tokens=sum(r.cached_tokens or 0 for r in ok),
        output_tokens=sum(r.output_tokens for r in ok), seconds=seconds,
        ttft_p50_ms=percentile(ttfts, 50), ttft_p90_ms=percentile(ttfts, 90),
        reasons=router_reasons(url) if router_metrics else {},
        imbalanced_share=sum(samples) / len(samples) if samples else 0.0, samples=len(samples), ttfts_ms=ttfts)


def run_policy(name: str, policy: str, engine_args: list[str], args: argparse.Namespace, logs: Path) -> PolicyResult:
    replicas = [Process(["serve", *engine_args], logs / f"{name}-replica{i}.log") for i in range(args.replicas)]
    router = None
    try:
        for replica in replicas:
            replica.wait_ready()
        router = Process(["route", "--policy", policy, "--balance-abs-threshold", str(args.balance_bound),
                          *(a for r in replicas for a in ("--replica", r.url))], logs / f"{name}-router.log")
        router.wait_ready()
        return measure(name, router.url, args, router_metrics=True)
    finally:
        for process in [*([router] if router else []), *replicas]:
            process.stop()


def run_on_ray(policy: str, engine_args: list[str], args: argparse.Namespace, logs: Path,
               throughput_optimized: bool = False, worker_niceness: int = 0) -> PolicyResult:
    """The same replicas as a Ray Serve deployment (``kvserve ray``) on a local Ray cluster started here; with
    ``throughput_optimized``, the cluster runs Ray Serve's throughput-optimized mode
    (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``: HTTP straight to the ingress replica, gRPC between deployments, user
    code on the replicas' event loops). ``worker_niceness``: the niceness Ray starts its workers at."""
    ray = shutil.which("ray")
    if ray is None:
        raise SystemExit("--ray needs Ray Serve: pip install -e '.[ray]' in the checkout")
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # Ray starts its workers (here the engines, the ingress and the proxy) at niceness 15 unless told
    # otherwise; `kvserve route` and its replicas run at 0, as the load generator and Ray's own daemons do.
    subprocess.run([ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                    "--include-dashboard", "false", "--num-cpus", str(args.replicas * args.threads),
                    "--disable-usage-stats", "--temp-dir", temp_dir], check=True, capture_output=True,
                   env={**os.environ, "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1" if throughput_optimized else "0",
                        "RAY_worker_niceness": str(worker_niceness)})
    name = (f"{policy} on Ray Serve{', throughput-optimized' if throughput_optimized else ''}"
            f"{f', workers at niceness {worker_niceness}' if worker_niceness else ''}")
    deployment = None
    try:
        deployment = Process(["ray", "--address", f"127.0.0.1:{port}", "--replicas", str(args.replicas),
                              "--routing-policy", policy, *engine_args], logs / f"ray-{policy}.log")
        deployment.wait_ready()
        return measure(name, deployment.url, args, router_metrics=False)
    finally:
        if deployment is not None:
            deployment.stop()
        subprocess.run([ray, "stop", "--force"], capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("--redis needs redis-server on PATH")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def table(results: list[PolicyResult], baseline: PolicyResult | None) -> str:
    lines = ["| policy | hit rate | TTFT p50 ms | TTFT p90 ms | output tok/s | failed | idle-while-queued samples | "
             "routing reasons |", "|---|---|---|---|---|---|---|---|"]
    for r in ([baseline] if baseline else []) + results:
        reasons = ", ".join(f"{k} {int(v)}" for k, v in sorted(r.reasons.items()))
        lines.append(f"| {r.name} | {r.hit_rate:.1%} | {r.ttft_p50_ms:.0f} | {r.ttft_p90_ms:.0f} | "
                     f"{r.output_tok_s:.1f} | {r.failed}/{r.requests} | {r.imbalanced_share:.1%} of {r.samples} | "
                     f"{reasons} |")
    return "\n".join(lines)


def plot_cdfs(results: list[PolicyResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        values = sorted(r.ttfts_ms)
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                label=f"{r.name} (p90 {r.ttft_p90_ms:.0f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per replica")
    parser.add_argument("--model", default=None, help="the replicas' --model (default: the default model)")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--user-tokens", type=int, default=40)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--kv-blocks", type=int, default=320, help="device KV blocks (16 tokens) per replica")
    parser.add_argument("--balance-bound", type=int, default=4)
    parser.add_argument("--policies", default="round_robin,least_load,cache_aware,kv_events,ttft")
    parser.add_argument("--no-cache-baseline", action="store_true")
    parser.add_argument("--redis", action="store_true", help="also run --redis-policies with a shared Redis tier")
    parser.add_argument("--redis-policies", default="round_robin,cache_aware")
    parser.add_argument("--ray", default=None, metavar="POLICY",
                        help="also run POLICY with the replicas as a Ray Serve deployment (kvserve ray)")
    parser.add_argument("--ray-throughput-optimized", action="store_true",
                        help="run --ray's deployment a second time, on a cluster in Ray Serve's throughput-optimized mode")
    parser.add_argument("--ray-default-niceness", action="store_true",
                        help=f"run --ray's deployment a second time, its workers at Ray's default niceness "
                             f"({RAY_DEFAULT_NICENESS}) instead of 0")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="write TTFT CDFs per policy (PNG) here")
    args = parser.parse_args()

    engine_args = ["--num-threads", str(args.threads), "--num-kv-blocks", str(args.kv_blocks), "--max-model-len",
                   "4096", "--served-model-name", MODEL_NAME, *(["--model", args.model] if args.model else [])]
    policies = [p for p in args.policies.split(",") if p]  # empty: the Ray deployment alone
    with tempfile.TemporaryDirectory(prefix="kvserve-routing-") as tmp:
        logs = Path(tmp)
        baseline = None
        if args.no_cache_baseline:
            baseline = run_policy("no cache (round_robin)", "round_robin", [*engine_args, "--no-enable-prefix-caching"],
                                  args, logs)
            print(table([], baseline), flush=True)
        results = []
        for policy in policies:
            results.append(run_policy(policy, policy, engine_args, args, logs))
            print(table(results[-1:], None), flush=True)
        if args.ray:
            results.append(run_on_ray(args.ray, engine_args, args, logs))
            print(table(results[-1:], None), flush=True)
            if args.ray_throughput_optimized:
                results.append(run_on_ray(args.ray, engine_args, args, logs, throughput_optimized=True))
                print(table(results[-1:], None), flush=True)
            if args.ray_default_niceness:
                results.append(run_on_ray(args.ray, engine_args, args, logs, worker_niceness=RAY_DEFAULT_NICENESS))
                print(table(results[-1:], None), flush=True)
        shared = []
        if args.redis:
            redis, url = start_redis(logs)
            try:
                for policy in args.redis_policies.split(","):
                    redis_args = [*engine_args, "--kv-redis-url", url, "--kv-write-policy", "write_through"]
                    subprocess.run(["redis-cli", "-u", url, "flushall"], check=False, capture_output=True)
                    shared.append(run_policy(f"{policy} + shared Redis", policy, redis_args, args, logs))
                    print(table(shared[-1:], None), flush=True)
            finally:
                redis.terminate()
                redis.wait()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    print(f"\n{time.strftime('%Y-%m-%d')}, commit {commit.strip()}, {cpu_description()}; "
          f"{args.replicas} replicas x {args.threads} thread(s), {args.kv_blocks} KV blocks each; {args.agents} agents x "
          f"{args.system_tokens}-token system prompts, {args.sessions} sessions x {args.turns} turns, "
          f"concurrency {args.concurrency}, {args.max_tokens} output tokens")
    print(table(results + shared, baseline))
    by_name = {r.name: r for r in results}
    if args.ray and args.ray in by_name:
        for name, result in by_name.items():
            if name.startswith(f"{args.ray} on Ray Serve"):
                print(f"{name} / behind kvserve route: output tok/s "
                      f"{result.output_tok_s / by_name[args.ray].output_tok_s:.2f}x")
    if "round_robin" in by_name and "cache_aware" in by_name:
        rr, ca = by_name["round_robin"], by_name["cache_aware"]
        print(f"cache_aware / round_robin: hit rate {ca.hit_rate / max(rr.hit_rate, 1e-9):.2f}x, "
              f"TTFT p90 {ca.ttft_p90_ms / rr.ttft_p90_ms:.2f}x")
    if shared:
        rr_shared = next((r for r in shared if r.name.startswith("round_robin")), None)
        if rr_shared and "round_robin" in by_name and "cache_aware" in by_name:
            print(f"shared Redis: round_robin hit rate {by_name['round_robin'].hit_rate:.1%} -> "
                  f"{rr_shared.hit_rate:.1%} (cache_aware without Redis: {by_name['cache_aware'].hit_rate:.1%})")
    if args.output:
        everything = ([baseline] if baseline else []) + results + shared
        args.output.write_text(json.dumps([{**asdict(r), "hit_rate": r.hit_rate, "output_tok_s": r.output_tok_s}
                                           for r in everything], indent=1) + "\n")
    if args.plot:
        plot_cdfs(([baseline] if baseline else []) + results + shared, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
