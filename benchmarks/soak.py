"""Soak: one ``kvserve serve`` under mixed traffic for a bounded time while its tiers are broken on purpose,
then every check that says nothing was lost. Loopback only; stops by itself.

    python benchmarks/soak.py [--duration 600] [--concurrency 6] [--abort-share 0.2] [--redis-kill-every 60]
                              [--corrupt-every 10] [--kv-blocks 128] [--host-mb 2] [--sample 24]
                              [--output FILE]

Traffic, closed-loop at --concurrency: agentic sessions (a shared ~540-token system prompt, each turn resending
the conversation with the server's own replies, three turns at most), distinct chats, prompts within a few
tokens of the context limit, n = 2 sampled with a seed, logprobs, stop strings; streamed or not by kind. --abort-share of the streams
are dropped by the client after a random number of chunks. Meanwhile the Redis tier's redis-server (started
here on a free loopback port) is SIGKILLed and restarted every --redis-kill-every s, and every --corrupt-every s
one disk-tier file is truncated and another overwritten with garbage (among the files read most recently). The host tier is --host-mb, the device
pool --kv-blocks blocks: both churn.

Checks (the exit status is 1 if any fails, each is in the JSON report):
- every answer a 200 (the traffic is valid and within the queue), and no dropped connection on a stream
  the client did not drop;
- idle afterwards: ``GET /kvserve/audit`` holds (no request left, no block used, no prefix locked);
- a --sample of the greedy answers that were not dropped equal the same request served alone on a fresh
  engine without tiers (``LLM``, float32, like the server);
- the server's resident memory, open files and threads, idle after the run, are within --rss-growth-mb, 16
  and 4 of what they were idle after the warm-up (a request of each kind, then --warm-longs prompts at the
  context limit at once, and the first quarter of the run, after which the traffic pauses for the reading);
- a SIGTERM while streams are open ends every stream with a final event (``[DONE]`` or an error event), the
  server exits 0, and every disk-tier file left is whole (but those the soak broke and nothing read since).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.bench.client import parse_prometheus  # noqa: E402
from kvserve.storage.base import CorruptEntry, read_header  # noqa: E402

MODEL_NAME = "soak"
MAX_MODEL_LEN = 1024
SYSTEM = " ".join(f"Tool {i}: call it with a JSON object of a path and a line range; it returns the lines, "
                  f"numbered, or an error naming what is wrong." for i in range(16))
TOPICS = ["paged attention", "radix trees", "disk caches", "Redis", "prefill", "decoding", "speculation",
          "batching", "preemption", "eviction", "tokenizers", "sampling"]
# The engine hands its free heap back to the OS half a second into an idle spell: memory is read after that.
IDLE_SETTLE_S = 1.5
KINDS = {"agentic": 0.35, "chat": 0.2, "long": 0.1, "sampled_n2": 0.1, "logprobs": 0.1, "stop": 0.15}


@dataclass
class Outcome:
    kind: str
    path: str
    body: dict[str, Any]
    status: int = 0
    text: str | None = None  # greedy, single-choice answers only
    dropped_by_client: bool = False
    final_event: bool = True  # a stream the client read to its end ended with [DONE] or an error event
    error: str | None = None


@dataclass
class Report:
    duration_s: float = 0.0  # of traffic, without the pause for the baseline
    pause_s: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # start-up, warm-up, traffic, ... as run
    requests: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    by_status: dict[str, int] = field(default_factory=dict)
    dropped_by_client: int = 0
    redis_kills: int = 0
    disk_files_truncated: int = 0
    disk_files_garbled: int = 0
    tier_counters: dict[str, float] = field(default_factory=dict)
    audit: dict[str, Any] = field(default_factory=dict)
    sample_checked: int = 0
    sample_mismatches: list[dict[str, Any]] = field(default_factory=list)
    rss_mb_warm: float = 0.0
    rss_mb_end: float = 0.0
    fds_warm: int = 0
    fds_end: int = 0
    threads_warm: int = 0
    threads_end: int = 0
    sigterm_streams: int = 0
    sigterm_streams_without_final_event: int = 0
    sigterm_exit_code: int | None = None
    disk_files_left: int = 0
    disk_files_torn: int = 0
    failures: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """redis-server on a fixed loopback port, killed and restarted on it."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("the soak needs redis-server on PATH (apt-get install redis-server)")
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=5)


class Server:
    """``kvserve serve`` with ``engine_args`` on a free loopback port, its output in ``log``."""

    def __init__(self, engine_args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")  # noqa: SIM115 - closed in wait()
        command = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                   "--uvicorn-log-level", "warning", *engine_args]
        self.proc = subprocess.Popen(command, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the server did not start")

    def resources(self) -> tuple[float, int, int]:
        """(resident MiB, open file descriptors, threads) of the server process."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss_mb = int(fields["VmRSS"].split()[0]) / 1024
        return rss_mb, len(os.listdir(f"/proc/{self.proc.pid}/fd")), int(fields["Threads"])

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        finally:
            self._log.close()


# --- traffic --------------------------------------------------------------------------------------------
def make_request(kind: str, rng: random.Random, sessions: list[list[dict[str, str]]]) -> tuple[str, dict[str, Any], int | None]:
    """(path, body, session index) of one request of ``kind``."""
    topic = rng.choice(TOPICS)
    if kind == "agentic":
        index = rng.randrange(len(sessions))
        messages = sessions[index] + [{"role": "user", "content": f"Step {len(sessions[index]) // 2}: look at {topic}."}]
        return "/v1/chat/completions", {"messages": messages, "max_tokens": 24, "temperature": 0, "stream": True}, index
    if kind == "chat":
        question = f"In two sentences, what is {topic}? (question {rng.randrange(10**6)})"
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": question}], "max_tokens": 24,
                                        "temperature": 0, "stream": True}, None
    if kind == "long":
        max_tokens = 12
        length = MAX_MODEL_LEN - max_tokens - rng.randrange(0, 8)
        start = rng.randrange(1000, 40000)
        return "/v1/completions", {"prompt": [start + (i * 7) % 997 for i in range(length)], "max_tokens": max_tokens,
                                   "temperature": 0, "stream": True}, None
    if kind == "sampled_n2":
        return "/v1/completions", {"prompt": f"A short poem about {topic}:", "n": 2, "temperature": 0.8,
                                   "seed": rng.randrange(10**6), "max_tokens": 16}, None
    if kind == "logprobs":
        return "/v1/completions", {"prompt": f"The main idea behind {topic} is", "logprobs": 3, "max_tokens": 12,
                                   "temperature": 0}, None
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"List three facts about {topic}."}],
                                    "max_tokens": 32, "temperature": 0, "stop": [".", "\n\n"], "stream": True}, None


def chunk_text(chunk: dict[str, Any]) -> str:
    choice = chunk["choices"][0] if chunk.get("choices") else {}
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


async def send(client: httpx.AsyncClient, path: str, body: dict[str, Any], drop_after: int | None,
               outcome: Outcome) -> None:
    body = {"model": MODEL_NAME, **body}
    try:
        if not body.get("stream"):
            response = await client.post(path, json=body)
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = response.text[:300]
            if response.status_code == 200 and body.get("n", 1) == 1:
                choice = response.json()["choices"][0]
                outcome.text = choice.get("text") if "text" in choice else choice["message"]["content"]
            return
        async with client.stream("POST", path, json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = (await response.aread()).decode(errors="replace")[:300]
                return
            parts: list[str] = []
            chunks, ended = 0, False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    ended = True
                    break
                event = json.loads(data)
                if "error" in event:
                    ended = True
                    outcome.error = str(event["error"])
                    break
                parts.append(chunk_text(event))
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    outcome.dropped_by_client = True
                    return  # leaving the block closes the connection: the server aborts the request
            outcome.final_event = ended
            if ended and outcome.error is None:
                outcome.text = "".join(parts)
    except httpx.TransportError as exc:
        outcome.final_event = False
        outcome.error = f"transport: {exc!r}"


async def warm_up(url: str, args: argparse.Namespace) -> None:
    """One request of each kind (together), then --concurrency prompts at the context limit at once: the largest
    shapes the run will see, so that what memory they take is counted before the baseline."""
    rng = random.Random(args.seed - 1)
    sessions = [[{"role": "system", "content": SYSTEM}]]
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        firsts = [(kind, *make_request(kind, rng, sessions)[:2]) for kind in KINDS]
        await asyncio.gather(*(send(client, path, body, None, Outcome(kind, path, body))
                               for kind, path, body in firsts))
        longs = [make_request("long", rng, sessions) for _ in range(args.warm_longs or args.concurrency)]
        await asyncio.gather(*(send(client, path, body, None, Outcome("long", path, body)) for path, body, _ in longs))


async def traffic(url: str, args: argparse.Namespace, outcomes: list[Outcome],
                  at_quarter: Callable[[], None]) -> None:
    """--duration seconds of traffic, with a pause a quarter of the way in: the workers finish what they
    sent, ``at_quarter`` runs (on a thread) with nothing in flight, and the traffic resumes for the rest."""
    rng = random.Random(args.seed)
    sessions: list[list[dict[str, str]]] = [[{"role": "system", "content": SYSTEM}] for _ in range(2 * args.concurrency)]
    kinds, weights = list(KINDS), list(KINDS.values())
    start = time.monotonic()
    pause_at, stop_at = start + args.duration / 4, start + args.duration
    resume = asyncio.Event()
    parked: list[int] = []
    all_parked = asyncio.Event()

    uncovered = list(kinds)  # the traffic's first requests are one of each kind: every kind is checked

    async def worker(worker_id: int) -> None:
        nonlocal stop_at
        local = random.Random(args.seed * 1000 + worker_id)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while time.monotonic() < stop_at or uncovered:  # every kind is sent, however slow the machine
                if not resume.is_set() and time.monotonic() >= pause_at:
                    parked.append(worker_id)
                    if len(parked) == args.concurrency:
                        all_parked.set()
                    await resume.wait()
                    continue
                kind = uncovered.pop(0) if uncovered else local.choices(kinds, weights)[0]
                path, body, session = make_request(kind, rng, sessions)
                streamed = bool(body.get("stream"))
                drop_after = local.randint(1, 6) if streamed and local.random() < args.abort_share else None
                outcome = Outcome(kind, path, body)
                await send(client, path, body, drop_after, outcome)
                outcomes.append(outcome)
                if session is not None and outcome.text is not None:
                    sessions[session] = body["messages"] + [{"role": "assistant", "content": outcome.text}]
                    if len(sessions[session]) > 7:  # three turns: the conversation stays inside the context
                        sessions[session] = [{"role": "system", "content": SYSTEM}]
        if not resume.is_set():  # a request outlasted the pause and the traffic's end: count as parked
            parked.append(worker_id)
            if len(parked) == args.concurrency:
                all_parked.set()

    async def quarter() -> None:
        nonlocal stop_at
        await all_parked.wait()
        paused = time.monotonic()
        await asyncio.to_thread(at_quarter)
        stop_at += time.monotonic() - paused
        resume.set()

    await asyncio.gather(quarter(), *(worker(i) for i in range(args.concurrency)))


# --- faults ---------------------------------------------------------------------------------------------
def read_time(path: Path) -> int:
    try:
        return path.stat().st_atime_ns
    except OSError:  # evicted since it was listed
        return 0


def break_things(redis: RedisProcess, disk_dir: Path, args: argparse.Namespace, stop: threading.Event,
                 report: Report, corrupted: set[Path]) -> None:
    rng = random.Random(args.seed + 1)
    next_kill = time.monotonic() + args.redis_kill_every
    while not stop.wait(args.corrupt_every):
        # Among the files read most recently (the tier sets atime on reads): the likeliest to be read again.
        files = sorted(disk_dir.rglob("*.kv"), key=read_time)[-20:]
        rng.shuffle(files)
        for action, path in zip(("truncate", "garble"), files, strict=False):
            corrupted.add(path)
            try:
                size = path.stat().st_size
                if size == 0:  # truncated to nothing already (or still being written): nothing to break
                    continue
                if action == "truncate":
                    os.truncate(path, rng.randrange(size))
                    report.disk_files_truncated += 1
                else:
                    with open(path, "r+b") as f:
                        f.write(rng.randbytes(size))
                    report.disk_files_garbled += 1
            except OSError:
                pass  # evicted meanwhile
        if time.monotonic() >= next_kill:
            redis.kill()
            report.redis_kills += 1
            time.sleep(1.0)
            redis.start()
            next_kill = time.monotonic() + args.redis_kill_every


# --- checks ---------------------------------------------------------------------------------------------
def wait_idle(url: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        audit = httpx.get(f"{url}/kvserve/audit", timeout=30).json()
        if audit["num_unfinished"] == 0 or time.monotonic() > deadline:
            return audit
        time.sleep(0.1)


def check_sample(outcomes: list[Outcome], args: argparse.Namespace, report: Report) -> None:
    from kvserve.offline import LLM
    from kvserve.sampling_params import SamplingParams

    greedy = [o for o in outcomes if o.text is not None and o.body.get("temperature") == 0 and o.body.get("n", 1) == 1]
    sample = random.Random(args.seed + 2).sample(greedy, min(args.sample, len(greedy)))
    llm = LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=args.kv_blocks)
    try:
        for outcome in sample:
            body = outcome.body
            params = SamplingParams(temperature=0.0, max_tokens=body["max_tokens"], stop=body.get("stop"))
            if "messages" in body:
                text = llm.chat([body["messages"]], params)[0].outputs[0].text
            else:
                text = llm.generate([body["prompt"]], params)[0].outputs[0].text
            report.sample_checked += 1
            if text != outcome.text:
                report.sample_mismatches.append({"kind": outcome.kind, "served": outcome.text, "alone": text})
    finally:
        llm.close()


async def sigterm_under_load(server: Server, report: Report) -> None:
    """Open streams, SIGTERM the server, and read each stream to its end."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        outcomes = [Outcome("sigterm", "/v1/completions", {}) for _ in range(4)]
        bodies = [{"prompt": f"Write a long story about {topic}.", "max_tokens": 400, "ignore_eos": True,
                   "temperature": 0, "stream": True} for topic in TOPICS[:4]]
        tasks = [asyncio.create_task(send(client, "/v1/completions", body, None, outcome))
                 for body, outcome in zip(bodies, outcomes, strict=True)]
        await asyncio.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks)
    report.sigterm_streams = sum(o.status == 200 for o in outcomes)
    report.sigterm_streams_without_final_event = sum(o.status == 200 and not o.final_event for o in outcomes)


def disk_files(disk_dir: Path, corrupted: set[Path]) -> tuple[int, int]:
    """(entry files, torn ones the soak did not break itself) in the disk tier's directory."""
    files = list(disk_dir.rglob("*.kv"))
    torn = 0
    for path in files:
        if path in corrupted:
            continue
        try:
            read_header(path.read_bytes())
        except CorruptEntry:
            torn += 1
    return len(files), torn


def judge(report: Report, outcomes: list[Outcome], args: argparse.Namespace) -> None:
    fail = report.failures.append
    refused = [o for o in outcomes if o.status != 200]
    if refused:  # every request the soak sends is valid and the queue is never full
        fail(f"{len(refused)} answers were not 200: the first, {refused[0].kind}: {refused[0].status} {refused[0].error}")
    cut = [o for o in outcomes if not o.dropped_by_client and not o.final_event]
    if cut:
        fail(f"{len(cut)} streams ended without a final event: {cut[0].error}")
    audit = report.audit
    if not audit.get("ok") or audit["num_unfinished"] or audit["num_used_blocks"] or audit["num_locked_nodes"]:
        fail(f"the audit after the run: {audit}")
    if report.sample_mismatches:
        fail(f"{len(report.sample_mismatches)} of {report.sample_checked} sampled answers differ from serving alone")
    if report.rss_mb_end > report.rss_mb_warm + args.rss_growth_mb:
        fail(f"resident memory grew from {report.rss_mb_warm:.0f} to {report.rss_mb_end:.0f} MiB")
    if report.fds_end > report.fds_warm + 16 or report.threads_end > report.threads_warm + 4:
        fail(f"fds {report.fds_warm} -> {report.fds_end}, threads {report.threads_warm} -> {report.threads_end}")
    if report.sigterm_streams_without_final_event or report.sigterm_exit_code != 0:
        fail(f"SIGTERM: {report.sigterm_streams_without_final_event} streams without a final event, exit "
             f"{report.sigterm_exit_code}")
    if report.disk_files_torn:
        fail(f"{report.disk_files_torn} torn disk-tier files after the shutdown")


def run(args: argparse.Namespace) -> Report:
    report = Report()
    workdir = Path(tempfile.mkdtemp(prefix="kvserve-soak-"))
    disk_dir = workdir / "kv"
    redis = RedisProcess(workdir)
    engine_args = ["--dtype", "float32", "--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN),
                   "--num-kv-blocks", str(args.kv_blocks), "--max-num-seqs", str(max(2, args.concurrency)),
                   "--kv-host-gb", str(args.host_mb / 1024), "--kv-disk-dir", str(disk_dir), "--kv-disk-gb", "0.25",
                   "--kv-redis-url", redis.url, "--shutdown-grace-period", "3"]
    server = Server(engine_args, workdir / "server.log")
    outcomes: list[Outcome] = []
    stop = threading.Event()
    clock = [time.monotonic()]

    def phase(name: str) -> None:
        now = time.monotonic()
        report.phase_seconds[name] = round(now - clock[0], 2)
        clock[0] = now

    try:
        server.wait_ready()
        phase("start-up")
        asyncio.run(warm_up(server.url, args))
        phase("warm-up")
        start = time.monotonic()
        corrupted: set[Path] = set()
        faults = threading.Thread(target=break_things, args=(redis, disk_dir, args, stop, report, corrupted),
                                  daemon=True)
        faults.start()

        def warm_sample() -> None:
            wait_idle(server.url)
            time.sleep(IDLE_SETTLE_S)
            report.rss_mb_warm, report.fds_warm, report.threads_warm = server.resources()

        asyncio.run(traffic(server.url, args, outcomes, warm_sample))
        report.pause_s = round(time.monotonic() - start - args.duration, 2)
        report.duration_s = time.monotonic() - start - report.pause_s
        stop.set()
        faults.join()
        phase("traffic")
        report.audit = wait_idle(server.url)
        time.sleep(IDLE_SETTLE_S)
        phase("idle wait")
        report.rss_mb_end, report.fds_end, report.threads_end = server.resources()
        counters = parse_prometheus(httpx.get(f"{server.url}/metrics", timeout=10).text)
        report.tier_counters = {name.removeprefix("kvserve:"): value for name, value in counters.items()
                                if name.startswith("kvserve:kv_tier_") and name.endswith("_total")}
        asyncio.run(sigterm_under_load(server, report))
        report.sigterm_exit_code = server.wait(timeout_s=30)
        phase("sigterm and exit")
        report.disk_files_left, report.disk_files_torn = disk_files(disk_dir, corrupted)
        check_sample(outcomes, args, report)
        phase("served-alone check")
    finally:
        stop.set()
        if server.proc.poll() is None:
            server.proc.kill()
            server.wait(timeout_s=10)
        redis.stop()
        if report.failures or not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    report.requests = len(outcomes)
    for o in outcomes:
        report.by_kind[o.kind] = report.by_kind.get(o.kind, 0) + 1
        report.by_status[str(o.status)] = report.by_status.get(str(o.status), 0) + 1
    report.dropped_by_client = sum(o.dropped_by_client for o in outcomes)
    judge(report, outcomes, args)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--warm-longs", type=int, default=None,
                        help="prompts at the context limit sent at once in the warm-up (default: --concurrency)")
    parser.add_argument("--abort-share", type=float, default=0.2, help="share of streams the client drops")
    parser.add_argument("--redis-kill-every", type=float, default=60.0)
    parser.add_argument("--corrupt-every", type=float, default=10.0)
    parser.add_argument("--kv-blocks", type=int, default=128, help="device KV pool, in blocks of 16 tokens")
    parser.add_argument("--host-mb", type=float, default=2.0, help="host tier size")
    parser.add_argument("--sample", type=int, default=24, help="greedy answers re-served alone and compared")
    parser.add_argument("--rss-growth-mb", type=float, default=64.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (server log, tier files)")
    parser.add_argument("--output", type=Path, help="write the report as JSON")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the server and redis-server are stopped
    return emit(run(args), args.output)


def emit(report: Any, output: Path | None) -> int:
    """Print a report (a dataclass with ``failures``) as JSON, write it to ``output``; the exit status."""
    text = json.dumps(asdict(report), indent=2)
    print(text)
    if output:
        output.write_text(text + "\n")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
