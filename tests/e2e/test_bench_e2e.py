"""`kvserve bench` and `kvserve trace` against a real `kvserve serve` process on the default model.

Every reported number is recomputed here from the raw per-request records the JSON carries, and the
server's own /metrics counters are checked against the records' usage.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvserve.bench.commands import run_compare_plots
from kvserve.bench.plots import hit_rate_per_turn
from kvserve.cli import main
from kvserve.errors import InvalidRequest

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_ARGS = ["--num-kv-blocks", "1024", "--max-model-len", "4096",
               "--max-num-batched-tokens", "2048"]
BENCH_ARGS = ["--num-requests", "16", "--output-len", "8", "--concurrency", "4", "--no-progress",
              "--peak-tflops", "1.0", "--peak-bandwidth-gbs", "20"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("bench-server") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--uvicorn-log-level", "warning", *SERVER_ARGS],
                                cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"server did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            yield url
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)


def _percentile(values: list[float], p: float) -> float:
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def check_against_records(result: dict[str, Any]) -> None:
    s, records = result["summary"], result["requests"]
    ok = [r for r in records if r["success"]]
    assert s["num_requests"] == len(records) == 16
    assert s["successful_requests"] == len(ok) == 16 and s["failed_requests"] == 0
    dur = s["duration_s"]
    assert dur >= max(r["start_s"] + r["e2e_s"] for r in ok) - 1e-6
    prompt = sum(r["prompt_tokens"] for r in ok)
    output = sum(r["output_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    assert all(r["output_tokens"] == 8 and r["output_tokens_from_usage"] for r in ok)  # ignore_eos honoured
    assert all(r["num_chunks"] >= 1 and len(r["itl_s"]) == r["num_chunks"] - 1 for r in ok)
    assert s["total_input_tokens"] == prompt and s["total_output_tokens"] == output
    assert s["total_cached_tokens"] == cached
    assert s["request_throughput"] == pytest.approx(len(ok) / dur)
    assert s["output_throughput"] == pytest.approx(output / dur)
    assert s["total_token_throughput"] == pytest.approx((prompt + output) / dur)
    assert s["cache_hit_rate"] == pytest.approx(cached / prompt)
    series = {
        "ttft_ms": [r["ttft_s"] * 1e3 for r in ok],
        "tpot_ms": [(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) * 1e3 for r in ok],
        "itl_ms": [g * 1e3 for r in ok for g in r["itl_s"]],
        "e2e_ms": [r["e2e_s"] * 1e3 for r in ok],
    }
    for key, values in series.items():
        assert s[key]["mean"] == pytest.approx(sum(values) / len(values)), key
        for p in (50, 90, 99):
            assert s[key][f"p{p}"] == pytest.approx(_percentile(values, p)), (key, p)
    good = sum(r["ttft_s"] * 1e3 <= 60_000 and (r["e2e_s"] - r["ttft_s"]) / 7 * 1e3 <= 5_000 for r in ok)
    assert s["good_requests"] == good and s["request_goodput"] == pytest.approx(good / dur)

    # The server's counters agree with the usage the client saw.
    delta = result["server"]["metrics_delta"]
    assert result["server"]["kvserve"]
    assert delta["kvserve:prompt_tokens_total"] == prompt
    assert delta["kvserve:prompt_tokens_cached_total"] == cached
    assert delta["kvserve:generation_tokens_total"] == output
    # Server-side timings came back with every request and agree with usage.
    for r in ok:
        lookup = r["timings"]["cache_lookup"]
        assert (lookup["prompt_tokens"], lookup["cached_tokens"]) == (r["prompt_tokens"], r["cached_tokens"])
    compute = s["compute"]
    busy = delta["kvserve:engine_busy_seconds_total"]
    assert compute["busy_s"] == pytest.approx(busy) and compute["engine_steps"] == delta["kvserve:engine_steps_total"]
    assert compute["prefill_tokens_computed"] == prompt - cached
    assert compute["mfu"] == pytest.approx((compute["prefill_flops"] + compute["decode_flops"]) / busy / 1e12)
    assert compute["mbu"] == pytest.approx((compute["prefill_bytes"] + compute["decode_bytes"]) / busy / 20e9)


def run_bench(base_url: str, tmp_path: Path, workload: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"{workload}.json"
    code = main(["bench", "--base-url", base_url, "--workload", workload, *BENCH_ARGS, "--output", str(out),
                 "--slo", "ttft=60s,tpot=5s", *extra])
    assert code == 0
    return json.loads(out.read_text())


def test_bench_agentic_hits_the_prefix_cache(base_url: str, tmp_path: Path) -> None:
    result = run_bench(base_url, tmp_path, "agentic", "--input-len", "32", "--turns", "4",
                       "--plot-dir", str(tmp_path / "plots"))
    check_against_records(result)
    assert result["summary"]["cache_hit_rate"] > 0.8
    assert (tmp_path / "plots" / "latency_cdfs.png").stat().st_size > 10_000
    assert (tmp_path / "plots" / "hit_rate_per_turn.png").stat().st_size > 10_000
    rates = hit_rate_per_turn(result)
    assert sorted(rates) == [0, 1, 2, 3] and rates[0] < min(rates[1], rates[2], rates[3])

    # Several servers side by side from saved results (here the same server twice, under two names).
    out = tmp_path / "agentic.json"
    assert main(["bench", "--compare", f"kvserve={out}", f"again={out}", "--plot-dir", str(tmp_path / "cmp")]) == 0
    for name in ("compare_latency_cdfs.png", "compare_hit_rate_per_turn.png"):
        assert (tmp_path / "cmp" / name).stat().st_size > 10_000
    with pytest.raises(InvalidRequest, match="NAME=FILE"):
        run_compare_plots([str(out)], str(tmp_path / "cmp"))
    with pytest.raises(InvalidRequest, match="not a `kvserve bench --output` file"):
        (tmp_path / "other.json").write_text('{"a": 1}')
        run_compare_plots([f"x={tmp_path / 'other.json'}"], str(tmp_path / "cmp"))


def test_bench_chat_hardly_hits(base_url: str, tmp_path: Path) -> None:
    result = run_bench(base_url, tmp_path, "chat", "--input-len", "64", "--seed", "7")
    check_against_records(result)
    assert result["summary"]["cache_hit_rate"] < 0.05


def test_trace_draws_the_pipeline(base_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "Name a colour.", "--base-url", base_url, "--max-tokens", "4", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    for stage in ("tokenize", "queue", "cache lookup", "prefill", "first token", "decode", "detokenize"):
        assert stage in out
    assert "3 tokens in 3 steps" in out
