"""Frozen configuration of the serving processes: the HTTP server over one engine (``ServerConfig``) and the
gateway in front of replicas (``RouterConfig``). Their fields are settings as the engine's are
(``kvserve/config.py``): ``kvserve/config_args.py`` builds their flags and the README's flags table."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from kvserve.config import check_finite, check_whole, setting
from kvserve.errors import ConfigError

UvicornLogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]
ToolCallParser = Literal["auto", "hermes", "llama3_json", "mistral", "granite", "phi4_mini_json", "pythonic",
                         "qwen3_coder"]
# What the server itself gives the chat template (from the request's own fields): no client's variable, nor a default.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools",
                                     "documents", "bos_token", "eos_token"})


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    served_model_name: tuple[str, ...] = setting(
        (), "the model names clients may send (one or more); a response names the one its request named, else "
            "the first", default_text="--model")
    api_key: str | None = setting(None, "require 'Authorization: Bearer <key>' on /v1 routes")
    max_waiting_requests: int = setting(256, "requests allowed to wait for a batch slot; more get 429 (a single "
                                             "request with more sequences than that, prompts × n, is a 400)")
    # Larger bodies get 413 before they are read: parsing and tokenizing megabytes stalls every request.
    max_request_body_bytes: int = setting(16 * 1024 * 1024, "request bodies larger than this get 413",
                                          default_text="16777216 (16 MiB)")
    response_store_mib: int = setting(64, "memory for the Responses API's stored responses (store: true), "
                                          "measured as their JSON, which previous_response_id continues and GET "
                                          "/v1/responses/{id} returns; the least recently used are dropped past it; "
                                          "0 stores none",
                                      flag="--response-store-mib")
    allow_runtime_lora_updating: bool = setting(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime LoRA routes): a client "
               "may then load adapters from paths on this machine; give --api-key with it on a shared network")
    default_chat_template_kwargs: str | None = setting(
        None, "chat template variables every chat request gets unless it sets them itself in its own "
              "chat_template_kwargs, as a JSON object (vLLM's flag): '{\"enable_thinking\": false}' turns Qwen3's "
              "thoughts off for every request", metavar="JSON")
    tool_call_parser: ToolCallParser = setting(
        "auto", "the format tool calls are written, constrained and read in (vLLM's names): hermes (<tool_call> JSON "
                "</tool_call>: Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.1 and 3.2's JSON with \"parameters\"), "
                "mistral ([TOOL_CALLS] and a JSON list: Mistral 7B v0.3, Nemo, Small), granite and phi4_mini_json "
                "(the same list after <|tool_call|> or <tool_call>, and after functools), qwen3_coder (<function=...> and "
                "<parameter=...> blocks: Qwen3-Coder), pythonic ([f(a=1)]: Llama 3.2's "
                "and Llama 4's pythonic templates), or auto: the one whose words the chat template holds, else hermes")
    shutdown_grace_period_s: float = setting(5.0, "seconds in-flight requests get to finish after SIGTERM "
                                                  "before they are aborted", flag="--shutdown-grace-period")
    uvicorn_log_level: UvicornLogLevel = setting("info", "log level of the HTTP server (uvicorn)")
    hardware: str | None = setting(None, "the peaks the dashboard's MFU and MBU divide by: h100-sxm, h200, h800, "
                                         "a100-80gb, or 'measure' (this machine, measured for a second at "
                                         "start-up: on a CPU, torch's float32 matmul, which bf16 and int8 "
                                         "kernels can outrun); without it the dashboard shows FLOP/s and "
                                         "bytes/s only")

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):  # one name, as callers in Python may give it
            object.__setattr__(self, "served_model_name", (self.served_model_name,))
        elif not isinstance(self.served_model_name, tuple):
            object.__setattr__(self, "served_model_name", tuple(self.served_model_name or ()))
        if any(not isinstance(name, str) or not name.strip() for name in self.served_model_name):
            raise ConfigError(f"served_model_name: each name must be a non-empty string, got "
                              f"{list(self.served_model_name)}", "served_model_name")
        if self.default_chat_template_kwargs is not None:
            try:
                defaults = json.loads(self.default_chat_template_kwargs)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"default_chat_template_kwargs is not JSON: {exc}",
                                  "default_chat_template_kwargs") from None
            if not isinstance(defaults, dict):
                raise ConfigError("default_chat_template_kwargs must be a JSON object of template variables",
                                  "default_chat_template_kwargs")
            if reserved := sorted(set(defaults) & RESERVED_TEMPLATE_NAMES):
                raise ConfigError(f"default_chat_template_kwargs: {reserved[0]!r} is set by each request itself, not "
                                  "a template variable to default", "default_chat_template_kwargs")
        check_whole(self.port, "port", 0, 65535)
        check_whole(self.max_waiting_requests, "max_waiting_requests", 1)
        check_whole(self.max_request_body_bytes, "max_request_body_bytes", 1)
        check_whole(self.response_store_mib, "response_store_mib", 0)
        check_finite(self.shutdown_grace_period_s, "shutdown_grace_period_s", 0)


RoutingPolicyName = Literal["round_robin", "least_load", "cache_aware", "kv_events", "ttft"]
ModelPolicyName = Literal["random", "length", "cascade", "probe", "gain"]
CascadeSignal = Literal["mean_logprob", "min_logprob", "mean_entropy"]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The gateway in front of replicas (``kvserve route``). ``replicas`` are base URLs of OpenAI-compatible
    servers; kvserve replicas also tell it their tokenizer, KV pool and load."""

    replicas: tuple[str, ...] = setting((), "base URL of a replica (repeat the flag for each)", flag=None)
    policy: RoutingPolicyName = setting("cache_aware", "how a request's replica is chosen")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on")
    health_interval_s: float = setting(1.0, "seconds between health and load checks of each replica: the load "
                                            "read from replicas is never older than this plus the check's "
                                            "timeout", flag="--health-interval")
    startup_timeout_s: float = setting(180.0, "seconds each replica gets to answer at start-up",
                                       flag="--startup-timeout")
    request_timeout_s: float = setting(600.0, "seconds a replica may take to connect, or between two chunks of "
                                             "an answer, before the request fails", flag="--request-timeout")
    max_request_body_bytes: int = setting(16 * 1024 * 1024, "request bodies larger than this get 413",
                                          default_text="16777216 (16 MiB)")
    balance_abs_threshold: int = setting(
        4, "every policy: a replica does not compete for a request that would leave it more than this many "
           "requests above the idlest replica (and more than --balance-rel-threshold times the idlest's load)")
    balance_rel_threshold: float = setting(1.5, "every policy: see --balance-abs-threshold")
    kv_events_interval_s: float = setting(0.2, "kv_events: seconds between reads of each replica's block events",
                                          flag="--kv-events-interval")
    cache_threshold: float = setting(0.5, "cache_aware, kv_events: the share of a prompt a replica must hold for the prefix "
                                          "to decide; below it the least-loaded replica takes the request")
    prefix_page_tokens: int = setting(16, "cache_aware: tokens per page of the prefix index (a replica's KV block)")
    prefix_capacity_tokens: int | None = setting(
        None, "cache_aware: tokens of routed prompts remembered per replica (least recently routed forgotten "
              "first)", default_text="the replica's KV pool; 1048576 for replicas that do not tell it")
    prefill_seconds_per_token: float = setting(
        1e-3, "ttft: seconds per prompt token a replica is assumed to take until its first answers are measured")
    shared_tier_cost: float = setting(0.2, "ttft: the cost of loading a token's KV from the shared tier (Redis), as a "
                                           "share of computing it")
    replica_api_key: str | None = setting(None, "API key of the router's own calls to the replicas (health, "
                                                  "models, load); requests pass on their client's key")
    uvicorn_log_level: UvicornLogLevel = setting("info", "log level of the HTTP server (uvicorn)")
    shutdown_grace_period_s: float = setting(5.0, "seconds requests in flight get to finish after SIGTERM before "
                                                  "their connections are closed", flag="--shutdown-grace-period")
    model_policy: ModelPolicyName | None = setting(
        None, "route requests for --auto-model to --small-model or --large-model by difficulty: random (a share "
              "--route-threshold to the large), length (prompts longer than --route-threshold tokens to the large), "
              "cascade (the small answers; below --route-threshold confidence the large answers instead), probe "
              "(a classifier of the small model's failure on its prompt state; --probe) or gain (classifiers of "
              "both models' failure on it: the large model where it is expected to add most; --probe)",
        default_text="none: no auto model")
    auto_model: str = setting("auto", "the model name routed by --model-policy")
    small_model: str | None = setting(None, "--model-policy: the cheaper model")
    large_model: str | None = setting(None, "--model-policy: the better model")
    route_threshold: float | None = setting(
        None, "--model-policy's threshold",
        default_text="random 0.5, length 256, cascade -0.14 (measured on HumanEval), probe 0.5, gain 0.15 (about "
                     "half of the HumanEval and LeetCode prompts)")
    cascade_signal: CascadeSignal = setting("mean_logprob", "cascade: the small answer's confidence")
    probe_path: str | None = setting(None, "probe, gain: the classifiers' file (kvserve eval train-probe)",
                                     flag="--probe")
    route_seed: int = setting(0, "random: the seed of its choices")

    def __post_init__(self) -> None:
        if self.model_policy is None:
            given = [name for name in ("small_model", "large_model", "probe_path", "route_threshold")
                     if getattr(self, name) is not None]
            if given:  # each would be ignored: no request is routed by difficulty without a policy
                raise ConfigError(f"{given[0]} routes by difficulty: it needs --model-policy", given[0])
        else:
            if not self.small_model or not self.large_model or self.small_model == self.large_model:
                raise ConfigError("--model-policy needs --small-model and --large-model, two different models",
                                  "model_policy")
            if self.model_policy in ("probe", "gain") and not self.probe_path:
                raise ConfigError(f"--model-policy {self.model_policy} needs --probe FILE", "probe_path")
            if self.model_policy == "random" and self.route_threshold is not None \
                    and not 0.0 <= self.route_threshold <= 1.0:
                raise ConfigError("random: --route-threshold is the large model's share, in [0, 1]",
                                  "route_threshold")
        check_whole(self.port, "port", 0, 65535)
        check_finite(self.shutdown_grace_period_s, "shutdown_grace_period_s", 0)
        if self.route_threshold is not None:
            if not math.isfinite(self.route_threshold):
                raise ConfigError(f"route_threshold must be a finite number, got {self.route_threshold}",
                                  "route_threshold")
            bounds = {"probe": (0.0, 1.0), "gain": (-1.0, 1.0)}.get(self.model_policy or "")
            if bounds is not None and not bounds[0] <= self.route_threshold <= bounds[1]:
                raise ConfigError(f"{self.model_policy}: --route-threshold is a probability"
                                  f"{' difference' if self.model_policy == 'gain' else ''}, in [{bounds[0]:g}, "
                                  f"{bounds[1]:g}]", "route_threshold")
        positive = ("health_interval_s", "startup_timeout_s", "request_timeout_s", "max_request_body_bytes",
                    "balance_abs_threshold", "prefix_page_tokens", "prefill_seconds_per_token",
                    "kv_events_interval_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}", name)
        if not self.balance_rel_threshold >= 1.0:  # NaN too: it would turn the load bound off
            raise ConfigError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}",
                              "balance_rel_threshold")
        if not 0.0 <= self.shared_tier_cost <= 1.0:
            raise ConfigError(f"shared_tier_cost must be in [0, 1], got {self.shared_tier_cost}", "shared_tier_cost")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ConfigError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}", "cache_threshold")
        if self.prefix_capacity_tokens is not None and self.prefix_capacity_tokens < self.prefix_page_tokens:
            raise ConfigError("prefix_capacity_tokens must hold at least one page", "prefix_capacity_tokens")
        for url in self.replicas:
            try:
                parts = urlsplit(url)
                port_ok = parts.port is None or parts.port > 0  # .port raises on a port that is not a number
            except ValueError:
                parts, port_ok = None, False
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
                raise ConfigError(f"a replica is a base URL (http://host:port), got {url!r}", "replicas")
