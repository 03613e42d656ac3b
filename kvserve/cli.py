"""`kvserve serve | generate | chat | bench | cost | trace` — the command line. The CLI may print."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from kvserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StorageConfig,
    speculative_config_from_dict,
)
from kvserve.errors import InvalidRequest, KVServeError

SERVE_GIL_SWITCH_INTERVAL_S = 0.0001


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options, spelled as vLLM spells them where the same option exists."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-cache-gb)")
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool size in GiB")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--scheduling-policy", choices=["fcfs", "lpm"], default="lpm")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch")
    g.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="C++ CPU kernels for decode attention, the bf16 projections and the norms (built on "
                        "first use); --no-cpu-kernels runs the torch reference paths")
    g.add_argument("--speculative-config", type=parse_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM spells it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (exact: outputs do not change)')
    t = parser.add_argument_group("KV storage tiers (below device memory; all off by default)")
    t.add_argument("--kv-host-gb", type=float, default=0.0, help="host DRAM tier size in GiB")
    t.add_argument("--kv-disk-gb", type=float, default=0.0, help="disk tier size in GiB (needs --kv-disk-dir)")
    t.add_argument("--kv-disk-dir", default=None, help="directory of the disk tier (survives restarts)")
    t.add_argument("--kv-redis-url", default=None, help="Redis tier, e.g. redis://127.0.0.1:6379/0 (shareable)")
    t.add_argument("--kv-retention", type=parse_duration, default=72 * 3600.0, metavar="DURATION",
                   help="how long tier entries live: 72h, 30m, 5s or plain seconds (default 72h)")
    t.add_argument("--kv-write-policy", choices=["write_back", "write_through"], default="write_back",
                   help="write_back: blocks go down as they are evicted; write_through: as soon as they fill")


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in "72h", "30m", "5s", "2d" or a plain number of seconds."""
    value = text.strip().lower()
    scale = _DURATION_UNITS.get(value[-1:], None)
    number = value[:-1] if scale is not None else value
    try:
        seconds = float(number) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 72h, 30m, 5s or 3600)") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"a duration must be > 0, got {text!r}")
    return seconds


def parse_speculative_config(text: str) -> SpeculativeConfig:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise argparse.ArgumentTypeError("--speculative-config must be a JSON object")
    try:
        return speculative_config_from_dict(fields)
    except (InvalidRequest, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                          seed=args.seed, num_threads=args.num_threads, cpu_kernels=args.cpu_kernels),
        cache=CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_cache_gb=args.kv_cache_gb,
                          enable_prefix_caching=args.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  policy=args.scheduling_policy),
        storage=StorageConfig(host_gb=args.kv_host_gb, disk_gb=args.kv_disk_gb, disk_dir=args.kv_disk_dir,
                              redis_url=args.kv_redis_url, retention_s=args.kv_retention,
                              write_policy=args.kv_write_policy),
        speculative=args.speculative_config or SpeculativeConfig(),
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)


def _sampling_params(args: argparse.Namespace):
    from kvserve.request import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.engine import Engine

    engine = Engine(engine_config_from_args(args))
    prompt = args.prompt
    if not args.raw:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = {"prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}
    engine.add_request(prompt, _sampling_params(args))
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            sys.stdout.write(output.delta_text)
            sys.stdout.flush()
            final = output
    sys.stdout.write("\n")
    if final is not None and args.verbose:
        m = final.metrics
        ttft = (m.first_token_time - m.arrival_time) * 1e3 if m.first_token_time else float("nan")
        n = len(final.outputs[0].token_ids)
        decode_s = (m.finished_time or m.arrival_time) - (m.first_token_time or m.arrival_time)
        rate = (n - 1) / decode_s if decode_s > 0 and n > 1 else float("nan")
        print(f"[{n} tokens, finish={final.outputs[0].finish_reason}, TTFT {ttft:.0f} ms, decode {rate:.1f} tok/s]",
              file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kvserve.engine import Engine

    engine = Engine(engine_config_from_args(args))
    params = _sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("kvserve chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        text = engine.tokenizer.apply_chat_template(messages)
        try:
            engine.add_request({"prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}, params)
        except KVServeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            messages.pop()
            continue
        reply = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                sys.stdout.write(output.delta_text)
                sys.stdout.flush()
                reply.append(output.delta_text)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    # The HTTP event loop (and, on small machines, the clients) share the cores with torch's OpenMP
    # workers, whose default spin-waiting then collapses: with a load generator on the same 2 cores,
    # serving ran 1.5-2.5x slower with spinning than with passive waiting (benchmarks/serve_compare.py).
    # Must be set before torch loads; an explicit setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # The engine thread takes the GIL back after every kernel (hundreds of times a step) while the HTTP
    # thread writes the streams; a waiting thread only asks the holder to let go after the switch interval,
    # 5 ms by default. At 0.1 ms, 16-request decode steps in the server ran ~10% faster on agentic 16
    # (step profiles, alternating runs); an engine process of its own would remove the wait altogether.
    sys.setswitchinterval(SERVE_GIL_SWITCH_INTERVAL_S)
    from kvserve.config import ServerConfig
    from kvserve.server.openai_api import serve

    server_config = ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                                 api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                                 max_request_body_bytes=args.max_request_body_bytes)
    return serve(engine_config_from_args(args), server_config, shutdown_grace_s=args.shutdown_grace_period,
                 log_level=args.uvicorn_log_level)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvserve.bench.commands import run_bench_command

    return run_bench_command(args)


def cmd_cost(args: argparse.Namespace) -> int:
    from kvserve.bench.commands import run_cost_command

    return run_cost_command(args)


def cmd_trace(args: argparse.Namespace) -> int:
    from kvserve.bench.commands import run_trace_command

    if not args.in_process:
        return run_trace_command(args)
    from kvserve.server.openai_api import BackgroundServer

    server = BackgroundServer(EngineConfig(model=ModelConfig(show_progress=False)))
    try:
        args.base_url = server.base_url
        return run_trace_command(args)
    finally:
        server.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="An LLM inference serving engine.")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, models, health, metrics)")
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1 routes")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests allowed to wait for a batch slot; more get 429")
    p.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024,
                   help="request bodies larger than this get 413")
    p.add_argument("--shutdown-grace-period", type=float, default=5.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="generate a completion for one prompt")
    add_engine_arguments(p)
    add_sampling_arguments(p, max_tokens=64)
    p.add_argument("--prompt", default="What is a KV cache? Answer in two sentences.")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("-v", "--verbose", action="store_true", help="print timing to stderr")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat on the terminal, streaming")
    add_engine_arguments(p)
    add_sampling_arguments(p, max_tokens=256)
    p.add_argument("--system", default=None)
    p.set_defaults(func=cmd_chat)

    from kvserve.bench import commands as bench_commands  # argparse only; heavy imports wait for the command

    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server (kvserve, vLLM, SGLang, llama.cpp)")
    bench_commands.add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("cost", help="FLOPs and bytes per token, MFU/MBU, cost per token, inference vs training")
    bench_commands.add_cost_arguments(p)
    p.set_defaults(func=cmd_cost)

    p = sub.add_parser("trace", help="one request's trip through a running kvserve server, as a timeline")
    bench_commands.add_trace_arguments(p)
    p.set_defaults(func=cmd_trace)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KVServeError as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
