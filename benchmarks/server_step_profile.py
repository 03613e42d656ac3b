"""Where a server run's time goes, step by step: prefill-carrying steps, decode-only steps, idle gaps.

    python benchmarks/server_step_profile.py [--workload agentic] [--concurrency 16] [--port 8110]
                                             [--no-stream] [-- extra kvserve serve options]

Starts `kvserve serve` with every engine step timed (this script re-runs itself as the server, wrapping
``Engine.step``), runs the `kvserve bench` load that ``serve_compare.py`` uses (32 requests, 32 output
tokens, 64-token messages, 4-turn agentic sessions), stops the server and prints: the number of steps
that carried prefill chunks, their time and tokens; the decode-only steps and their time; the time the
engine sat idle between steps. ``--no-stream`` sends the same conversations unstreamed instead (one
response per request), to see what streaming costs the server and the load generator. ``--alternate-pool``
alternates the server's steps between the kernels' worker threads (with torch's ops on the engine thread,
the default) and OpenMP's team, and prints each side's decode steps: the worker pool's A/B inside the
server, with its HTTP loop and the load generator on the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def serve_with_step_timing(trace_path: str, serve_args: list[str], alternate_pool: bool) -> int:
    """Run `kvserve serve`, appending (start, seconds, runner seconds, prefill tokens, decode rows, side) per
    step; side 1 on the worker pool, 0 on OpenMP's team, -1 when not alternating."""
    from contextlib import nullcontext

    import torch

    from kvserve import engine as engine_module
    from kvserve.cli import main

    records: list[tuple[float, float, float, int, int, int]] = []
    plain_step = engine_module.Engine.step
    scopes: dict[int, object] = {}

    def timed_step(self: engine_module.Engine) -> list:
        side = -1
        if alternate_pool:
            model = self.runner.model
            scope = scopes.setdefault(id(model), model.thread_scope)
            side = len(records) % 2
            model.thread_scope = scope if side else nullcontext()
            torch.ops.kvserve.use_worker_pool(bool(side))
        start = time.perf_counter()
        runner = self.runner
        plain_execute = runner.execute
        seen: dict[str, float | int] = {}

        def execute(out):  # noqa: ANN001, ANN202 - the runner's own signature
            seen["prefill"] = sum(len(s.token_ids) for s in out.scheduled if len(s.token_ids) > 1 or not s.sample)
            seen["decode"] = sum(1 for s in out.scheduled if s.sample and len(s.token_ids) == 1)
            t0 = time.perf_counter()
            result = plain_execute(out)
            seen["runner"] = time.perf_counter() - t0
            return result

        runner.execute = execute
        try:
            return plain_step(self)
        finally:
            del runner.execute
            if "runner" in seen:
                records.append((start, time.perf_counter() - start, float(seen["runner"]), int(seen["prefill"]),
                                int(seen["decode"]), side))

    engine_module.Engine.step = timed_step
    atexit.register(lambda: Path(trace_path).write_text(json.dumps(records)))
    return main(["serve", *serve_args])


async def unstreamed_load(base_url: str, concurrency: int, num_requests: int) -> None:
    """The agentic conversations of `kvserve bench`, each turn sent with stream=false."""
    from kvserve.bench.workloads import Conversation, Workload, WorkloadConfig

    workload = Workload(WorkloadConfig(name="agentic", seed=0, input_len=64, output_len=32, turns=4))
    turns_per_session = -(-num_requests // concurrency)

    async def session(client: httpx.AsyncClient, k: int) -> None:
        spec = workload.session(k)
        conversation = Conversation(spec.system)
        for turn in spec.turns[:turns_per_session]:
            body = {"messages": conversation.with_turn(turn.message), "max_tokens": turn.max_tokens,
                    "min_tokens": turn.max_tokens, "ignore_eos": True, "temperature": 0.0}
            response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            conversation.append(turn.message, response.json()["choices"][0]["message"]["content"])

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await asyncio.gather(*(session(client, k) for k in range(concurrency)))


def summarise(records: list[tuple[float, float, float, int, int, int]]) -> None:
    if not records:
        print("no engine steps were recorded")
        return
    span = records[-1][0] + records[-1][1] - records[0][0]
    prefill = [r for r in records if r[3] > 0]
    decode = [r for r in records if r[3] == 0]
    busy = sum(r[1] for r in records)
    print(f"{len(records)} steps over {span:.2f} s; in steps {busy:.2f} s (runner {sum(r[2] for r in records):.2f} s), "
          f"idle between steps {span - busy:.2f} s")
    print(f"steps with prefill chunks: {len(prefill)}, {sum(r[1] for r in prefill):.2f} s, "
          f"{sum(r[3] for r in prefill)} prompt tokens")
    for r in prefill:
        print(f"  prefill step: {r[1] * 1e3:.0f} ms (runner {r[2] * 1e3:.0f} ms), {r[3]} prompt tokens, {r[4]} decode rows")
    if decode:
        print(f"decode-only steps: {len(decode)}, {sum(r[1] for r in decode):.2f} s, median "
              f"{statistics.median(r[1] for r in decode) * 1e3:.1f} ms at a median of "
              f"{statistics.median(r[4] for r in decode):.0f} requests")
    for side, name in ((1, "worker pool"), (0, "OpenMP")):
        steps = [r[1] for r in decode if r[5] == side]
        if steps:
            print(f"  on the {name}: {len(steps)} decode-only steps, median {statistics.median(steps) * 1e3:.1f} ms")


def main() -> None:
    if len(sys.argv) > 3 and sys.argv[1] == "--serve-child":
        sys.exit(serve_with_step_timing(sys.argv[3], sys.argv[4:], sys.argv[2] == "alternate"))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="agentic")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--port", type=int, default=8110)
    parser.add_argument("--no-stream", action="store_true", help="agentic only: send the turns unstreamed")
    parser.add_argument("--alternate-pool", action="store_true",
                        help="alternate steps between the kernels' worker threads and OpenMP's team")
    parser.add_argument("serve_args", nargs="*", help="extra `kvserve serve` options (after --)")
    args = parser.parse_args()
    base_url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "steps.json")
        server = subprocess.Popen([sys.executable, __file__, "--serve-child",
                                   "alternate" if args.alternate_pool else "plain", trace, "--port", str(args.port),
                                   "--uvicorn-log-level", "warning", *args.serve_args])
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"{base_url}/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise SystemExit(f"the server exited with {server.returncode}")
                time.sleep(1)
            if args.no_stream:
                asyncio.run(unstreamed_load(base_url, args.concurrency, args.num_requests))
            else:
                subprocess.run([sys.executable, "-m", "kvserve", "bench", "--base-url", base_url, "--workload",
                                args.workload, "--seed", "0", "--concurrency", str(args.concurrency),
                                "--num-requests", str(args.num_requests), "--output-len", "32", "--input-len", "64",
                                "--turns", "4", "--no-progress", "--output", os.path.join(tmp, "bench.json")],
                               check=True, stdout=subprocess.DEVNULL)
        finally:
            server.terminate()
            server.wait(timeout=60)
        summarise(json.loads(Path(trace).read_text()) if Path(trace).exists() else [])


if __name__ == "__main__":
    main()
