"""Arguments and bodies of ``kvserve bench``, ``kvserve cost`` and ``kvserve trace`` (cli.py wires them).

Command-line code: it prints. Heavy imports (httpx, numpy, matplotlib) happen inside the commands, so
building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvserve.config_args import check_output_file
from kvserve.errors import InvalidRequest

# --------------------------------------------------------------------------------------------------
# kvserve bench
# --------------------------------------------------------------------------------------------------


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL (no /v1)")
    g.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    g.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="/v1/chat/completions (messages) or /v1/completions (a flat prompt)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos and min_tokens=max_tokens so output lengths are fixed")
    g.add_argument("--return-timings", action=argparse.BooleanOptionalAction, default=None,
                   help="ask for kvserve's per-request timings (default: when the server is kvserve)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")

    g = p.add_argument_group("workload")
    g.add_argument("--workload", nargs="+", default=["chat"], metavar="W",
                   help="agentic | chat | mixed | long-context | replay FILE (a Mooncake-format JSONL trace)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--input-len", type=int, default=128, help="chat prompt / agentic new-message tokens")
    g.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    g.add_argument("--turns", type=int, default=4, help="agentic: turns per session")
    g.add_argument("--num-docs", type=int, default=2, help="long-context: documents per group")
    g.add_argument("--doc-len", type=int, default=2000, help="long-context: document tokens")
    g.add_argument("--questions-per-doc", type=int, default=8)
    g.add_argument("--mix", default="agentic=0.5,chat=0.5", help="mixed: KIND=WEIGHT,...")
    g.add_argument("--time-scale", type=float, default=1.0, help="replay: multiply trace timestamps by this")

    g = p.add_argument_group("load")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="closed loop: sessions in flight")
    mode.add_argument("--request-rate", type=float, default=None, help="open loop: Poisson requests per second")
    g.add_argument("--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight")
    g.add_argument("--num-requests", type=int, default=None,
                   help="stop after this many (default: a replayed trace's length, none with --duration, else 64)")
    g.add_argument("--duration", type=float, default=None, help="start no request after this many seconds")
    g.add_argument("--sweep", default=None, help="comma-separated loads, one run each: concurrencies, or request "
                   "rates when --request-rate is given (its own value is then replaced by each of these)")
    g.add_argument("--slo", default=None, help="goodput objectives, e.g. ttft=500ms,tpot=50ms,e2e=2s")
    g.add_argument("--no-progress", action="store_true")

    g = p.add_argument_group("output")
    g.add_argument("--output", default=None, help="write the full result (with raw per-request records) as JSON")
    g.add_argument("--plot-dir", default=None, help="write PNG plots here")
    g.add_argument("--compare", nargs="+", metavar="NAME=FILE", default=None,
                   help="run nothing: plot several servers' saved results (--output files) side by side "
                        "into --plot-dir")

    g = p.add_argument_group("compute (kvserve servers: MFU and MBU from /metrics)")
    g.add_argument("--model-config", default=None, help="preset name, GGUF file or HF dir for the model shape "
                   "(default: the served model's path from /v1/models, when the server is local)")
    g.add_argument("--hardware", default=None, help="h100-sxm | h200 | h800 | a100-80gb | measure")
    g.add_argument("--peak-tflops", type=float, default=None)
    g.add_argument("--peak-bandwidth-gbs", type=float, default=None)
    g.add_argument("--weight-bytes", type=float, default=2, help="bytes per weight as served (bf16: 2)")
    g.add_argument("--kv-bytes", type=float, default=2, help="bytes per KV element (bf16: 2)")


def bench_config_from_args(args: argparse.Namespace) -> Any:
    from kvserve import costs
    from kvserve.bench.client import RequestOptions
    from kvserve.bench.report import parse_slo
    from kvserve.bench.runner import BenchConfig, ComputeOptions
    from kvserve.bench.workloads import WorkloadConfig, parse_mix

    name, *rest = args.workload
    trace = None
    if name == "replay":
        if len(rest) != 1:
            raise InvalidRequest("use --workload replay FILE", "workload")
        trace = rest[0]
    elif rest:
        raise InvalidRequest(f"--workload {name} takes no file", "workload")
    workload = WorkloadConfig(name=name, seed=args.seed, input_len=args.input_len, output_len=args.output_len,
                              turns=args.turns, num_docs=args.num_docs, doc_len=args.doc_len,
                              questions_per_doc=args.questions_per_doc, mix=parse_mix(args.mix), trace=trace,
                              time_scale=args.time_scale)
    options = RequestOptions(model=args.model, endpoint=args.endpoint, ignore_eos=args.ignore_eos,
                             temperature=args.temperature, api_key=args.api_key)
    if args.hardware and args.hardware != "measure":
        costs.get_hardware(args.hardware)  # a misspelt name refused now, not after the run
    concurrency = args.concurrency
    if args.sweep and args.request_rate is None and concurrency is None:
        concurrency = 1  # a sweep without a mode sweeps concurrency
    return BenchConfig(
        base_url=args.base_url, workload=workload, options=options, concurrency=concurrency,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency, num_requests=args.num_requests,
        duration_s=args.duration, slo=parse_slo(args.slo), timeout_s=args.timeout, progress=not args.no_progress,
        return_timings=args.return_timings,
        compute=ComputeOptions(model_config=args.model_config, hardware=args.hardware, peak_tflops=args.peak_tflops,
                               peak_bandwidth_gbs=args.peak_bandwidth_gbs, weight_bytes=args.weight_bytes,
                               kv_bytes=args.kv_bytes),
    )


def run_compare_plots(specs: list[str], plot_dir: str | None) -> int:
    from kvserve.bench.plots import write_comparison_plots

    if not plot_dir:
        raise InvalidRequest("--compare needs --plot-dir (where the plots go)", "plot_dir")
    servers = []
    for spec in specs:
        name, sep, file = spec.partition("=")
        if not sep or not name or not file:
            raise InvalidRequest(f"--compare takes NAME=FILE, not {spec!r}", "compare")
        try:
            data = json.loads(Path(file).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"--compare {spec}: cannot read a bench result: {exc}", "compare") from None
        results = data["sweep"] if "sweep" in data else [data]
        if not all(isinstance(r, dict) and "requests" in r and "load" in r for r in results):
            raise InvalidRequest(f"--compare {spec}: not a `kvserve bench --output` file", "compare")
        servers.append((name, results))
    for path in write_comparison_plots(servers, Path(plot_dir)):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def run_bench_command(args: argparse.Namespace) -> int:
    from kvserve.bench.report import format_sweep, format_table
    from kvserve.bench.runner import run_bench, run_sweep

    if args.plot_dir and importlib.util.find_spec("matplotlib") is None:
        raise InvalidRequest("--plot-dir and --compare draw with matplotlib: pip install matplotlib", "plot_dir")
    if args.compare:
        return run_compare_plots(args.compare, args.plot_dir)
    config = bench_config_from_args(args)
    check_output_file(args.output, "--output")
    if args.sweep:
        try:
            values = [float(v) for v in args.sweep.split(",") if v.strip()]
        except ValueError:
            raise InvalidRequest(f"bad --sweep {args.sweep!r}; expected e.g. 1,4,16", "sweep") from None
        results = run_sweep(config, values)
    else:
        results = [run_bench(config)]
    for result in results:
        print(format_table(result["summary"], f"{result['config']['workload']['name']} {result['load']['label']}"))
    if len(results) > 1:
        print(format_sweep(results))
    if args.output:
        data = results[0] if len(results) == 1 else {"sweep": results}
        Path(args.output).write_text(json.dumps(data, indent=1, default=_json_default), encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    if args.plot_dir:
        from kvserve.bench.plots import write_plots

        for path in write_plots(results, Path(args.plot_dir)):
            print(f"wrote {path}", file=sys.stderr)
    failed = sum(r["summary"]["failed_requests"] for r in results)
    succeeded = sum(r["summary"]["successful_requests"] for r in results)
    return 1 if succeeded == 0 and failed > 0 else 0


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# --------------------------------------------------------------------------------------------------
# kvserve trace
# --------------------------------------------------------------------------------------------------


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default="What is a KV cache? Answer in two sentences.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--api-key", default=None)
    p.add_argument("--show-text", action="store_true", help="also print the generated text")
    p.add_argument("--repeat", type=int, default=1,
                   help="send the prompt this many times (the first is cold, the next ones hit the prefix cache)")
    p.add_argument("--in-process", action="store_true",
                   help="start the default model's server inside this process instead of using --base-url")


def run_trace_command(args: argparse.Namespace) -> int:
    from kvserve.bench.client import RequestOptions
    from kvserve.bench.trace import render_timeline, trace_request

    if args.repeat < 1:
        raise InvalidRequest(f"--repeat must be >= 1, got {args.repeat}", "repeat")
    options = RequestOptions(model=args.model, endpoint=args.endpoint, ignore_eos=args.ignore_eos,
                             api_key=args.api_key)
    for i in range(args.repeat):
        record = trace_request(args.base_url, args.prompt, options, args.max_tokens)
        assert record.timings is not None
        if args.repeat > 1:
            print(f"--- request {i + 1} of {args.repeat} ({'cold' if i == 0 else 'warm'}) ---")
        print(render_timeline(record.timings, record.ttft_s * 1e3, record.e2e_s * 1e3))
        if args.show_text:
            print(f"\n{record.text}")
    return 0


# --------------------------------------------------------------------------------------------------
# kvserve cost
# --------------------------------------------------------------------------------------------------


def add_cost_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="preset (smollm2-135m, llama3-8b, llama3-70b, qwen3-30b-a3b, deepseek-v3), GGUF or HF dir")
    p.add_argument("--preset", default=None, choices=["deepseek-v3"],
                   help="reproduce a published deployment: training vs inference compute and token costs")
    p.add_argument("--context", type=int, default=2048, help="context length for attention terms")
    p.add_argument("--batch-sizes", default="1,8,32,128", help="decode batch sizes to tabulate")
    p.add_argument("--weight-bytes", type=float, default=2)
    p.add_argument("--kv-bytes", type=float, default=2)
    p.add_argument("--hardware", default=None, help="h100-sxm | h200 | h800 | a100-80gb: roofline bounds")
    p.add_argument("--measure-peak", action="store_true", help="measure this machine's FLOP/s and bandwidth")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None, help="two models for the same compute")
    p.add_argument("--inference-flops-per-day", type=float, default=None)
    g = p.add_argument_group("inference vs training")
    g.add_argument("--training-tokens", type=float, default=None, help="training FLOPs ≈ 6 × active × tokens")
    g.add_argument("--training-gpu-hours", type=float, default=None)
    g.add_argument("--inference-gpu-hours-per-day", type=float, default=None)
    g.add_argument("--inference-tokens-per-day", type=float, default=None, help="tokens served per day (costed as output tokens at --context)")
    g.add_argument("--days", default="365,730", help="report the ratio after these many days")
    g = p.add_argument_group("cost per million tokens")
    g.add_argument("--gpu-hour-price", type=float, default=None, help="dollars per GPU-hour")
    g.add_argument("--num-gpus", type=int, default=1, help="GPUs that together give the throughputs below")
    g.add_argument("--miss-tok-s", type=float, default=None, help="cache-miss prompt tokens/s (prefill only)")
    g.add_argument("--hit-tok-s", type=float, default=None, help="cache-hit prompt tokens/s (default: modelled)")
    g.add_argument("--output-tok-s", type=float, default=None, help="output tokens/s (decode only)")
    g.add_argument("--from-bench", default=None, help="a `kvserve bench --output` JSON: split its run's time")


def run_cost_command(args: argparse.Namespace) -> int:
    from kvserve import costs
    from kvserve.bench.model_presets import load_arch

    batch_sizes = _positive_list(args.batch_sizes, "batch_sizes", int)
    days = _positive_list(args.days, "days", float)
    for name in ("context", "num_gpus"):
        if getattr(args, name) < 1:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", name)
    for name in ("weight_bytes", "kv_bytes"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            raise InvalidRequest(f"--{name.replace('_', '-')} must be a finite number > 0", name)
    if args.from_bench and not Path(args.from_bench).is_file():
        raise InvalidRequest(f"--from-bench {args.from_bench}: no such file", "from_bench")
    out: list[str] = []
    if args.measure_peak:
        hw = costs.measure_peak()
        out.append(f"measured peak ({hw.name}): {hw.peak_flops() / 1e12:.3f} TFLOP/s matmul, "
                   f"{hw.memory_bandwidth / 1e9:.1f} GB/s memory copy")
    if args.preset == "deepseek-v3":
        from kvserve.bench.deepseek_v3 import deepseek_v3_report

        out.append(deepseek_v3_report())
    elif args.compare:
        if args.inference_flops_per_day is None:
            raise InvalidRequest("--compare needs --inference-flops-per-day", "inference_flops_per_day")
        out.append(compare_report(args.compare, args.inference_flops_per_day, args.context))
    else:
        shape = load_arch(args.model)
        hardware = costs.get_hardware(args.hardware) if args.hardware else None
        out.append(model_report(shape, args.context, batch_sizes, hardware, args.weight_bytes, args.kv_bytes))
        lifecycle = _lifecycle_from_args(args, shape)
        if lifecycle is not None:
            out.append(lifecycle_report(lifecycle, days))
        if args.gpu_hour_price is not None:
            out.append(_price_from_args(args, shape, hardware))
    print("\n\n".join(out))
    return 0


def _positive_list(text: str, name: str, kind: type[int] | type[float]) -> list[Any]:
    """A comma-separated flag's values, each a finite number > 0 (whole where ``kind`` is int)."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise InvalidRequest(f"--{name.replace('_', '-')} takes comma-separated numbers > 0, got {text!r}", name)
    return values


def model_report(shape: Any, context: int, batch_sizes: list[int], hardware: Any, weight_bytes: float,
                 kv_bytes: float) -> str:
    from kvserve import costs

    lines = [f"model {shape.name}: {shape.total_params() / 1e9:.3f}B parameters, "
             f"{shape.active_params() / 1e9:.3f}B active per token"
             + (f" ({shape.num_experts_per_token}/{shape.num_experts} experts)" if shape.is_moe else ""),
             f"KV cache: {shape.kv_bytes_per_token(kv_bytes) / 1024:.1f} KiB per token"
             + (" (MLA latent)" if shape.is_mla else ""),
             f"linear FLOPs per token: {costs.linear_flops_per_token(shape) / 1e9:.3f} GFLOP; attention adds "
             f"{shape.attention_flops_per_pair() / 1e6:.3f} MFLOP per token of context"]
    pre = costs.prefill_cost(shape, context, 0, weight_bytes=weight_bytes, kv_bytes=kv_bytes)
    lines.append(f"prefill of {context} tokens: {pre.flops_per_token / 1e9:.3f} GFLOP/token, "
                 f"{pre.bytes_per_token / 1e6:.3f} MB/token, {pre.arithmetic_intensity:.0f} FLOP/byte")
    lines.append(f"decode at context {context}:")
    lines.append(f"  {'batch':>6} {'GFLOP/tok':>10} {'MB/tok':>10} {'FLOP/B':>8}"
                 + (f" {'bound':>8} {'tok/s max':>11}" if hardware else ""))
    for b in batch_sizes:
        step = costs.decode_cost(shape, b, context, weight_bytes=weight_bytes, kv_bytes=kv_bytes)
        row = (f"  {b:>6} {step.flops_per_token / 1e9:>10.3f} {step.bytes_per_token / 1e6:>10.3f} "
               f"{step.arithmetic_intensity:>8.1f}")
        if hardware:
            t_flops, t_bytes = step.flops / hardware.peak_flops(), step.bytes / hardware.memory_bandwidth
            row += f" {'compute' if t_flops > t_bytes else 'memory':>8} {b / max(t_flops, t_bytes):>11,.0f}"
        lines.append(row)
    if hardware:
        lines.append(f"  roofline on {hardware.name}: {hardware.peak_flops() / 1e12:.0f} TFLOP/s bf16, "
                     f"{hardware.memory_bandwidth / 1e12:.2f} TB/s ({hardware.source})")
    return "\n".join(lines)


def _lifecycle_from_args(args: argparse.Namespace, shape: Any) -> Any:
    from kvserve import costs

    if args.training_gpu_hours and args.inference_gpu_hours_per_day:
        return costs.Lifecycle(shape.name, training_gpu_hours=args.training_gpu_hours,
                               inference_gpu_hours_per_day=args.inference_gpu_hours_per_day)
    if args.training_tokens and args.inference_tokens_per_day:
        return costs.Lifecycle(shape.name, training_flops=costs.training_flops(shape, args.training_tokens),
                               inference_flops_per_day=costs.inference_flops_for_tokens(
                                   shape, 0, args.inference_tokens_per_day, args.context))
    if any((args.training_gpu_hours, args.inference_gpu_hours_per_day, args.training_tokens,
            args.inference_tokens_per_day)):
        raise InvalidRequest("give --training-gpu-hours with --inference-gpu-hours-per-day, or --training-tokens "
                             "with --inference-tokens-per-day", "training")
    return None


def lifecycle_report(lifecycle: Any, days: list[float]) -> str:
    lines = [f"inference vs training compute ({lifecycle.name}):"]
    for d in days:
        lines.append(f"  after {d:g} days ({d / 365:.1f} years): inference = {lifecycle.ratio_after(d):.1f}x training")
    lines.append(f"  inference equals training after {lifecycle.breakeven_days():.0f} days")
    return "\n".join(lines)


def _price_from_args(args: argparse.Namespace, shape: Any, hardware: Any) -> str:
    from kvserve import costs

    hw = hardware or costs.get_hardware("h100-sxm")
    miss_s, hit_s, out_s = costs.modelled_seconds_per_token(shape, hw, context_len=args.context)
    if args.from_bench:
        data = json.loads(Path(args.from_bench).read_text(encoding="utf-8"))
        runs = data["sweep"] if "sweep" in data else [data]
        s = runs[-1]["summary"]
        hit = s["total_cached_tokens"]
        miss_rate, hit_rate, out_rate = costs.split_throughput(
            s["duration_s"], s["total_input_tokens"] - hit, hit, s["total_output_tokens"], (miss_s, hit_s, out_s))
        source = f"{args.from_bench}: run time split by modelled cost on {hw.name}"
    else:
        if args.miss_tok_s is None or args.output_tok_s is None:
            raise InvalidRequest("give --miss-tok-s and --output-tok-s, or --from-bench FILE", "gpu_hour_price")
        miss_rate, out_rate = args.miss_tok_s, args.output_tok_s
        hit_rate = args.hit_tok_s or miss_rate * miss_s / hit_s  # modelled: a hit costs its KV read only
        source = "given throughputs" + ("" if args.hit_tok_s else f"; hit throughput modelled on {hw.name}")
    prices = costs.token_prices(args.gpu_hour_price, miss_tok_s=miss_rate, hit_tok_s=hit_rate, output_tok_s=out_rate,
                                num_gpus=args.num_gpus)
    return format_prices(prices, args.gpu_hour_price, args.num_gpus, (miss_rate, hit_rate, out_rate), source)


def format_prices(prices: Any, gpu_hour_price: float, num_gpus: int, rates: tuple[float, float, float],
                  source: str) -> str:
    lines = [f"cost per million tokens at ${gpu_hour_price:g}/GPU-hour x {num_gpus} GPU(s) ({source}):"]
    for label, price, rate in (("cache-miss input", prices.cache_miss_input, rates[0]),
                               ("cache-hit input", prices.cache_hit_input, rates[1]),
                               ("output", prices.output, rates[2])):
        lines.append(f"  {label:<17} ${price:>10.5f} / M tokens   ({rate:,.0f} tok/s)")
    return "\n".join(lines)


def compare_report(models: list[str], flops_per_day: float, context: int) -> str:
    from kvserve import costs
    from kvserve.bench.model_presets import load_arch

    lines = [f"tokens served per day for {flops_per_day:.3g} FLOP/day (context {context}):",
             f"  {'model':<16} {'active B':>9} {'GFLOP/prefill tok':>18} {'GFLOP/decode tok':>17} "
             f"{'prefill tok/day':>16} {'decode tok/day':>15}"]
    served = []
    for spec in models:
        shape = load_arch(spec)
        pre = costs.inference_flops_for_tokens(shape, 1, 0, context)
        dec = costs.inference_flops_for_tokens(shape, 0, 1, context)
        served.append((shape.name, flops_per_day / pre, flops_per_day / dec))
        lines.append(f"  {shape.name:<16} {shape.active_params() / 1e9:>9.3f} {pre / 1e9:>18.3f} {dec / 1e9:>17.3f} "
                     f"{flops_per_day / pre:>16.4g} {flops_per_day / dec:>15.4g}")
    (a, pa, da), (b, pb, db) = served
    lines.append(f"  {a} serves {pa / pb:.3g}x the prefill tokens and {da / db:.3g}x the decode tokens of {b}")
    lines.append("  (FLOPs only: decode at small batch is bound by memory bandwidth, see `kvserve cost --hardware`)")
    return "\n".join(lines)
