"""Write deploy/grafana/kvserve.json, a Grafana dashboard over kvserve's Prometheus metrics.

    python3 scripts/grafana_dashboard.py           # rewrite the dashboard
    python3 scripts/grafana_dashboard.py --check   # exit 1 if the committed dashboard is stale

Import it in Grafana (Dashboards > Import) and pick the Prometheus data source that scrapes the servers'
``/metrics``; the ``instance`` variable selects servers. Alert levels are drawn as panel thresholds; the
README's Metrics section says what each one means.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "deploy" / "grafana" / "kvserve.json"
SELECTOR = '{instance=~"$instance"}'
WIDTH, HEIGHT = 12, 8


def quantiles(metric: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{SELECTOR}[$__rate_interval])))",
             f"p{round(q * 100)}") for q in qs]


def rate(metric: str, by: str | None = None) -> str:
    inner = f"rate({metric}{SELECTOR}[$__rate_interval])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def ratio(numerator: str, denominator: str) -> str:
    return f"{rate(numerator)} / clamp_min({rate(denominator)}, 1e-9)"


# (title, unit, [(expr, legend)], thresholds as (value, colour) above a green base, or None)
PANELS: list[tuple[str, str, list[tuple[str, str]], list[tuple[float, str]] | None]] = [
    ("Time to first token", "s", quantiles("kvserve:time_to_first_token_seconds"), [(2.0, "yellow"), (10.0, "red")]),
    ("Inter-token latency", "s", quantiles("kvserve:inter_token_latency_seconds"), [(0.1, "yellow"), (0.25, "red")]),
    ("Time per output token", "s", quantiles("kvserve:time_per_output_token_seconds"), None),
    ("End-to-end latency", "s", quantiles("kvserve:e2e_request_latency_seconds"), None),
    ("Requests waiting (queue) and running", "short",
     [(f"sum(kvserve:num_requests_waiting{SELECTOR})", "waiting"),
      (f"sum(kvserve:num_requests_running{SELECTOR})", "running")], [(32.0, "yellow"), (128.0, "red")]),
    ("KV cache usage (blocks held by running requests)", "percentunit",
     [(f"max by (instance) (kvserve:kv_cache_usage_perc{SELECTOR})", "{{instance}}")], [(0.8, "yellow"), (0.95, "red")]),
    ("KV blocks: used, cached (evictable), free", "short",
     [(f"sum(kvserve:kv_blocks_used{SELECTOR})", "used"), (f"sum(kvserve:kv_blocks_cached{SELECTOR})", "cached"),
      (f"sum(kvserve:kv_blocks_free{SELECTOR})", "free")], None),
    ("Prefix cache hit rate (prompt tokens found / looked up)", "percentunit",
     [(ratio("kvserve:prefix_cache_hits_total", "kvserve:prefix_cache_queries_total"), "hit rate"),
      (ratio("kvserve:prompt_tokens_cached_total", "kvserve:prompt_tokens_total"), "share of prompt tokens cached")],
     None),
    ("Cached prompt tokens by tier", "short",
     [(rate("kvserve:kv_cached_tokens_by_tier_total", "tier"), "{{tier}}")], None),
    ("Tier traffic", "Bps",
     [(rate("kvserve:kv_tier_read_bytes_total", "tier"), "read {{tier}}"),
      (rate("kvserve:kv_tier_written_bytes_total", "tier"), "written {{tier}}")], None),
    ("Tier faults (each served as a miss)", "short",
     [(rate("kvserve:kv_tier_errors_total", "tier"), "errors {{tier}}"),
      (rate("kvserve:kv_tier_corrupt_entries_total", "tier"), "corrupt {{tier}}"),
      (rate("kvserve:kv_tier_refused_entries_total", "tier"), "refused {{tier}}"),
      (f"min by (tier) (kvserve:kv_tier_healthy{SELECTOR})", "healthy {{tier}}")], None),
    ("Preemptions and evictions per second", "short",
     [(rate("kvserve:num_preemptions_total"), "preemptions"),
      (rate("kvserve:kv_blocks_evicted_total"), "blocks evicted")], [(1.0, "yellow"), (10.0, "red")]),
    ("Tokens per second", "short",
     [(rate("kvserve:prompt_tokens_total"), "prompt in"), (rate("kvserve:prompt_tokens_computed_total"), "prompt computed"),
      (rate("kvserve:generation_tokens_total"), "generated"),
      (rate("kvserve:reasoning_tokens_total"), "of them thoughts")], None),
    ("Speculative decoding", "percentunit",
     [(f"avg by (method) (kvserve:spec_decode_acceptance_rate{SELECTOR})", "acceptance {{method}}"),
      (f"avg by (method) (kvserve:spec_decode_draft_time_share{SELECTOR})", "draft time share {{method}}")], None),
    ("Errors by status", "short", [(rate("kvserve:http_errors_total", "status"), "{{status}}")], None),
    ("Engine busy share and liveness", "percentunit",
     [(rate("kvserve:engine_busy_seconds_total"), "busy"),
      (f"min(kvserve:engine_alive{SELECTOR})", "alive")], None),
]


def panel(index: int, title: str, unit: str, targets: list[tuple[str, str]],
          thresholds: list[tuple[float, str]] | None) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    steps += [{"color": colour, "value": value} for value, colour in thresholds or []]
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": (index % 2) * WIDTH, "y": (index // 2) * HEIGHT, "w": WIDTH, "h": HEIGHT},
        "fieldConfig": {
            "defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps},
                         "custom": {"thresholdsStyle": {"mode": "line" if thresholds else "off"}}},
            "overrides": [],
        },
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)],
    }


def dashboard() -> dict[str, Any]:
    return {
        "title": "kvserve",
        "uid": "kvserve",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "instance", "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": "label_values(kvserve:engine_alive, instance)", "includeAll": True, "multi": True,
             "current": {"text": "All", "value": "$__all"}, "refresh": 2},
        ]},
        "panels": [panel(i, *spec) for i, spec in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed dashboard is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run python3 scripts/grafana_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
