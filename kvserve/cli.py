"""`kvserve serve | route | ray | generate | chat | models | bench | cost | trace | eval` — the command line. The CLI may print."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

from kvserve.config import EngineConfig, ModelConfig
from kvserve.config_args import (
    add_engine_arguments,
    add_router_arguments,
    add_server_arguments,
    engine_config_from_args,
    parse_duration,
    parse_speculative_config,
    router_config_from_args,
    server_config_from_args,
)
from kvserve.errors import ConfigError, KVServeError
from kvserve.serving_config import RouterConfig, RoutingPolicyName

__all__ = ["build_parser", "engine_config_from_args", "main", "parse_duration", "parse_speculative_config"]


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)


def _sampling_params(args: argparse.Namespace):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.engine import Engine

    params = _sampling_params(args)  # refused before the model loads
    engine = Engine(engine_config_from_args(args))
    prompt = args.prompt
    if not args.raw:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = {"prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}
    engine.add_request(prompt, params)
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

    params = _sampling_params(args)  # refused before the model loads
    engine = Engine(engine_config_from_args(args))
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
    # workers, whose default spin-waiting then collapses under load (benchmarks/serve_compare.py measures
    # it). Must be set before torch loads; an explicit setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {args.replicas}", "replicas")
    if args.replicas == 1 and args.routing_policy is not None:
        raise ConfigError("--routing-policy chooses among replicas: it needs --replicas 2 or more", "routing_policy")
    server_config = server_config_from_args(args)
    if server_config.hardware not in (None, "measure"):
        from kvserve import costs

        try:
            costs.get_hardware(server_config.hardware)  # a misspelt name found now, not once the model loaded
        except KVServeError as exc:
            raise ConfigError(str(exc), "hardware") from None
    if args.replicas > 1:
        return _serve_replicas(args)
    from kvserve.server.openai_api import serve
    from kvserve.server.serving import SERVE_GIL_SWITCH_INTERVAL_S

    sys.setswitchinterval(SERVE_GIL_SWITCH_INTERVAL_S)
    return serve(engine_config_from_args(args), server_config)


def _serve_replicas(args: argparse.Namespace) -> int:
    """N engine processes on loopback, each with its share of the threads, and the gateway in front."""
    from kvserve.router.serving import ReplicaProcesses, run_router, threads_per_replica, without_options

    engine_config = engine_config_from_args(args)  # checked here, once, before any process starts
    server_config = server_config_from_args(args)
    serve_args = without_options(args.argv[args.argv.index("serve") + 1:],
                                 ("--replicas", "--routing-policy", "--host", "--port", "--num-threads"))
    threads = threads_per_replica(args.replicas, engine_config.model.num_threads)
    replicas = ReplicaProcesses(serve_args, args.replicas, threads)
    try:
        replicas.wait_until_listening()
        policy = args.routing_policy or "cache_aware"
        return run_router(RouterConfig(replicas=tuple(replicas.urls), policy=policy,
                                       host=server_config.host, port=server_config.port,
                                       replica_api_key=server_config.api_key,
                                       max_request_body_bytes=server_config.max_request_body_bytes,
                                       uvicorn_log_level=server_config.uvicorn_log_level,
                                       shutdown_grace_period_s=server_config.shutdown_grace_period_s))
    finally:
        # The replicas drain as long as the gateway did (they took the same --shutdown-grace-period).
        replicas.stop(timeout_s=server_config.shutdown_grace_period_s + 10)


def cmd_ray(args: argparse.Namespace) -> int:
    """Replicas as a Ray Serve deployment on a Ray cluster, kvserve's policy as its request router."""
    import importlib.util

    from kvserve.router.serving import run_on_ray, without_options

    if importlib.util.find_spec("ray") is None:
        raise ConfigError("kvserve ray needs Ray Serve: pip install -e '.[ray]' in the checkout", "ray")
    if args.replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {args.replicas}", "replicas")
    engine_config = engine_config_from_args(args)  # checked here, before anything is deployed
    server_config = server_config_from_args(args)
    serve_args = without_options(args.argv[args.argv.index("ray") + 1:],
                                 ("--address", "--replicas", "--routing-policy", "--host", "--port", "--num-threads"))
    threads = engine_config.model.num_threads or 1
    config = RouterConfig(policy=args.routing_policy, host=server_config.host, port=server_config.port)
    return run_on_ray(args.address, serve_args, args.replicas, threads, config)


def cmd_route(args: argparse.Namespace) -> int:
    from kvserve.router.serving import run_router

    if not args.replica:
        raise ConfigError("kvserve route needs at least one --replica URL", "replicas")
    return run_router(router_config_from_args(args, tuple(args.replica)))


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


def cmd_eval(args: argparse.Namespace) -> int:
    from kvserve.evals.commands import run_eval_command

    return run_eval_command(args)


def cmd_models(args: argparse.Namespace) -> int:
    from kvserve.model_store.commands import run_models_command

    return run_models_command(args)


class _ExactFlagsParser(argparse.ArgumentParser):
    """Flags by their full names only (subcommands' parsers too): argparse would take ``--replica 2`` for
    ``--replicas 2``, and the argument lists passed on to replicas are rewritten by full flag names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _ExactFlagsParser(prog="kvserve", description="An LLM inference serving engine.")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, models, health, metrics)")
    add_engine_arguments(p)
    add_server_arguments(p)
    p.set_defaults(func=cmd_serve)

    p.add_argument("--replicas", type=int, default=1,
                   help="engine processes on this machine, the CPU threads shared between them, behind a gateway "
                        "on --host/--port (default: 1, no gateway)")
    p.add_argument("--routing-policy", choices=list(typing.get_args(RoutingPolicyName)), default=None,
                   help="with --replicas: how the gateway picks a replica (default: cache_aware)")

    p = sub.add_parser("route", help="a gateway across replicas: OpenAI API, cache-aware routing, failover")
    p.add_argument("--replica", action="append", metavar="URL",
                   help="base URL of an OpenAI-compatible replica (repeat for each)")
    add_router_arguments(p)
    p.set_defaults(func=cmd_route)

    p = sub.add_parser("ray", help="replicas as a Ray Serve deployment on a Ray cluster, routed by kvserve's policy")
    add_engine_arguments(p)
    add_server_arguments(p)
    p.add_argument("--address", default="auto", help="the Ray cluster to join (default: auto)")
    p.add_argument("--replicas", type=int, default=2, help="kvserve replicas, each of --num-threads CPUs (default: 2 replicas of 1 CPU)")
    p.add_argument("--routing-policy", choices=[n for n in typing.get_args(RoutingPolicyName) if n != "kv_events"],
                   default="cache_aware", help="how requests are spread over the replicas (default: cache_aware)")
    p.set_defaults(func=cmd_ray)

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
    from kvserve.model_store.commands import add_models_arguments

    p = sub.add_parser("models", help="known models: list, pull (download and check), rm, path")
    add_models_arguments(p)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server (kvserve, vLLM, SGLang, llama.cpp)")
    bench_commands.add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("cost", help="FLOPs and bytes per token, MFU/MBU, cost per token, inference vs training")
    bench_commands.add_cost_arguments(p)
    p.set_defaults(func=cmd_cost)

    p = sub.add_parser("trace", help="one request's trip through a running kvserve server, as a timeline")
    bench_commands.add_trace_arguments(p)
    p.set_defaults(func=cmd_trace)

    from kvserve.evals.commands import add_eval_arguments

    p = sub.add_parser("eval", help="benchmarks of answer quality against an OpenAI-compatible endpoint")
    add_eval_arguments(p)
    p.set_defaults(func=cmd_eval)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KVServeError as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
