"""Prometheus metrics in the ``kvserve:`` namespace, on a registry owned by one app (no global state).

Two sources:
  - per request, observed by the server when a request ends: latency histograms (TTFT, TPOT, ITL,
    end-to-end, queue, prefill, decode), token counters and finished requests by reason;
  - engine-wide, read at scrape time from ``AsyncEngine.stats()`` (a snapshot the engine thread takes
    after each step): queue lengths, KV blocks, prefix-cache queries and hits, preemptions, and per KV
    storage tier (``kvserve:kv_tier_*{tier="host"}``) hits and misses in tokens, bytes, latency, sizes.

Counters are exposed with the ``_total`` suffix (``kvserve:prompt_tokens_total``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.request import RequestMetrics

if TYPE_CHECKING:
    from kvserve.engine import EngineStats

NAMESPACE = "kvserve:"

# Buckets as vLLM's, so dashboards built for one read the other.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], is_alive: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        n = NAMESPACE
        self.ttft = Histogram(f"{n}time_to_first_token_seconds", "Time from arrival to the first output token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{n}time_per_output_token_seconds",
                              "Per request: decode time divided by output tokens after the first.",
                              buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{n}inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{n}e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{n}request_queue_time_seconds", "Time from arrival to first scheduled.",
                                    buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram(f"{n}request_prefill_time_seconds",
                                      "Time from first scheduled to the first token.",
                                      buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram(f"{n}request_decode_time_seconds", "Time from the first to the last token.",
                                     buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{n}prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.cached_prompt_tokens = Counter(f"{n}prompt_tokens_cached",
                                            "Prompt tokens found in the prefix cache at admission.", registry=r)
        self.generation_tokens = Counter(f"{n}generation_tokens", "Output tokens of ended requests.", registry=r)
        self.reasoning_tokens = Counter(f"{n}reasoning_tokens",
                                        "Output tokens a reasoning model's chat replies spent on their thoughts.",
                                        registry=r)
        self.request_success = Counter(f"{n}request_success", "Engine requests ended, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.http_errors = Counter(f"{n}http_errors", "Requests answered with an error, by status and code.",
                                   ["status", "code"], registry=r)
        for reason in FINISH_REASONS:
            self.request_success.labels(finished_reason=reason)  # exported at 0 from the start
        r.register(_EngineCollector(stats, is_alive))

    # --- observations -----------------------------------------------------------------------------------
    def observe_admitted(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_prompt_tokens.inc(num_cached_tokens)

    def observe_finished(self, finish_reason: str, num_output_tokens: int, m: RequestMetrics | None) -> None:
        """One engine request ended (finished, or aborted because its client left)."""
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.generation_tokens.inc(num_output_tokens)
        if m is None or finish_reason == "abort":
            return  # latencies of requests nobody waited for would only skew the histograms
        lat = m.latencies(num_output_tokens)
        for histogram, value in ((self.queue_time, lat.queue_s), (self.ttft, lat.ttft_s),
                                 (self.prefill_time, lat.prefill_s), (self.e2e, lat.e2e_s),
                                 (self.decode_time, lat.decode_s), (self.tpot, lat.tpot_s)):
            if value is not None:
                histogram.observe(value)
        for gap in lat.itls_s:
            self.itl.observe(gap)

    def observe_error(self, status: int, code: str | None) -> None:
        self.http_errors.labels(status=str(status), code=code or "").inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector(Collector):
    """Engine-wide gauges and counters, read from the engine thread's last snapshot at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], is_alive: Callable[[], bool]) -> None:
        self._stats = stats
        self._is_alive = is_alive

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        n = NAMESPACE
        gauges = {
            "engine_alive": ("1 while the engine loop runs, 0 once it has died.", float(self._is_alive())),
            "num_requests_running": ("Requests in the running batch.", s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", s.num_waiting),
            "kv_blocks_total": ("KV blocks in the device pool.", s.num_kv_blocks),
            "kv_blocks_used": ("KV blocks held by running requests.", s.num_used_blocks),
            "kv_blocks_cached": ("KV blocks indexed by the prefix cache.", s.num_cached_blocks),
            "kv_blocks_free": ("KV blocks on the free list (neither used nor cached).", s.num_free_blocks),
            "kv_cache_usage_perc": ("Fraction of KV blocks held by running requests.",
                                    s.num_used_blocks / s.num_kv_blocks if s.num_kv_blocks else 0.0),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{n}{name}", doc, value=value)
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            "num_preemptions": ("Requests preempted (KV freed, to be recomputed).", s.num_preemptions),
            "kv_blocks_evicted": ("KV blocks evicted from the prefix cache.", s.num_evicted_blocks),
            "prompt_tokens_computed": ("Prompt tokens the model computed (cache misses and recomputes).",
                                       s.num_prompt_tokens_computed),
            "engine_generated_tokens": ("Tokens sampled by the engine.", s.num_generated_tokens),
            "engine_steps": ("Engine steps run.", s.num_steps),
            "engine_busy_seconds": ("Seconds the engine spent running the model.", s.busy_time_s),
            "grammar_compiles": ("Structured-output constraints compiled (compile-cache misses).", s.grammar.compiles),
            "grammar_compile_errors": ("Constraints that failed to compile (each a 400).", s.grammar.compile_errors),
            "grammar_compile_seconds": ("Time spent compiling constraints.", s.grammar.compile_time_s),
            "grammar_cache_hits": ("Constraints found compiled in the compile cache.", s.grammar.cache_hits),
            "grammar_compile_timeouts": ("Requests refused because their constraint compiled too slowly.",
                                         s.grammar.timeouts),
            "grammar_xgrammar_compiles": ("JSON Schemas compiled on xgrammar (also in grammar_compiles).",
                                          s.grammar.xgrammar_compiles),
            "grammar_xgrammar_refusals": ("JSON Schemas xgrammar could not compile, compiled on llguidance instead.",
                                          s.grammar.xgrammar_refusals),
            "grammar_constrained_tokens": ("Tokens sampled under a grammar's mask.", s.num_constrained_tokens),
            "grammar_mask_seconds": ("Time spent computing and applying grammar masks.", s.grammar_mask_time_s),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"{n}{name}", doc, value=value)
        yield from _tier_metrics(s)
        yield from _speculative_metrics(s)


def _speculative_metrics(s: EngineStats) -> Iterator[Metric]:
    """Speculative decoding's counters and gauges, labelled with the method ("none" when it is off)."""
    n = NAMESPACE
    verified, accepted = s.num_draft_tokens, s.num_accepted_draft_tokens
    counters = (
        ("spec_decode_num_drafts", "Decodes that verified speculative drafts.", s.num_draft_steps),
        ("spec_decode_num_draft_tokens", "Speculative draft tokens verified.", verified),
        ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.", accepted),
        ("spec_decode_num_rejected_tokens", "Speculative draft tokens rejected.", verified - accepted),
        ("spec_decode_num_proposed_tokens", "Draft tokens proposed (the scheduler may cut some).",
         s.num_proposed_draft_tokens),
        ("spec_decode_num_lookup_draft_tokens", "Of the draft tokens verified, those prompt lookup found.",
         s.num_lookup_draft_tokens),
        ("spec_decode_num_lookup_accepted_tokens", "Of the draft tokens accepted, those prompt lookup found.",
         s.num_lookup_accepted_tokens),
        ("spec_decode_draft_seconds", "Time spent proposing drafts (a draft model's forwards).", s.draft_time_s),
    )
    gauges = (
        ("spec_decode_acceptance_rate", "Drafts accepted per draft verified, so far.",
         accepted / verified if verified else 0.0),
        ("spec_decode_mean_accepted_length", "Drafts accepted per decode that verified drafts, so far.",
         accepted / s.num_draft_steps if s.num_draft_steps else 0.0),
        ("spec_decode_draft_time_share", "Share of the engine's busy time spent proposing drafts.",
         s.draft_time_s / s.busy_time_s if s.busy_time_s else 0.0),
        ("spec_decode_draft_length", "Drafts per request the last step chose (adaptive).", s.draft_length),
    )
    for name, doc, value in counters:
        family = CounterMetricFamily(f"{n}{name}", doc, labels=["method"])
        family.add_metric([s.spec_method], value)
        yield family
    for name, doc, value in gauges:
        family = GaugeMetricFamily(f"{n}{name}", doc, labels=["method"])
        family.add_metric([s.spec_method], value)
        yield family


# Per storage tier (label tier="device" | "host" | "disk" | "redis"): (name, help, TierStats field).
_TIER_COUNTERS = (
    ("kv_tier_hit_tokens", "Prompt tokens found in this tier at admission.", "hits"),
    ("kv_tier_miss_tokens", "Prompt tokens looked up in this tier at admission and not found.", "misses"),
    ("kv_tier_read_bytes", "KV payload bytes read from this tier.", "bytes_read"),
    ("kv_tier_written_bytes", "KV payload bytes written to this tier.", "bytes_written"),
    ("kv_tier_evictions", "Entries this tier evicted to stay within its capacity.", "evictions"),
    ("kv_tier_expirations", "Entries this tier dropped after the retention time.", "expirations"),
    ("kv_tier_errors", "Failed operations of this tier (each one served as a miss).", "errors"),
    ("kv_tier_corrupt_entries", "Entries that failed verification and were deleted.", "corrupt"),
    ("kv_tier_refused_entries", "Entries whose stored token ids differ from the block looked up (deleted).",
     "refused"),
    ("kv_tier_load_seconds", "Time spent reading from this tier.", "load_latency_s"),
    ("kv_tier_loads", "Batched reads from this tier.", "load_count"),
)
_TIER_GAUGES = (
    ("kv_tier_entries", "Entries held by this tier (absent where it cannot count them: Redis).", "entries"),
    ("kv_tier_bytes", "Bytes held by this tier (absent where it cannot count them: Redis).", "bytes_held"),
)


def _tier_metrics(s: EngineStats) -> Iterator[Metric]:
    n = NAMESPACE
    cached = CounterMetricFamily(f"{n}kv_cached_tokens_by_tier",
                                 "Prompt tokens found cached at admission, by the tier they came from.",
                                 labels=["tier"])
    for tier, value in s.cached_tokens_by_tier.items():
        cached.add_metric([tier], value)
    yield cached
    healthy = GaugeMetricFamily(f"{n}kv_tier_healthy", "1 while the tier answers, 0 while it is backing off.",
                                labels=["tier"])
    for tier, ok in s.tiers_healthy.items():
        healthy.add_metric([tier], float(ok))
    yield healthy
    for name, doc, field_name in _TIER_COUNTERS:
        family = CounterMetricFamily(f"{n}{name}", doc, labels=["tier"])
        for tier, stats in s.tiers.items():
            family.add_metric([tier], getattr(stats, field_name))
        yield family
    for name, doc, field_name in _TIER_GAUGES:
        family = GaugeMetricFamily(f"{n}{name}", doc, labels=["tier"])
        for tier, stats in s.tiers.items():
            value = getattr(stats, field_name)
            if value is not None:
                family.add_metric([tier], value)
        yield family
