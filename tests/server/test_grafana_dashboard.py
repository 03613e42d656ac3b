"""deploy/grafana/kvserve.json is the generated one, and every metric its panels query is one the server
exports (read from a real server's /metrics, counting families that have no sample yet)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("_sum", "_count")}


def exported_names(base_url: str) -> set[str]:
    names: set[str] = set()
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=10).text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def test_the_dashboard_is_generated_and_queries_only_exported_metrics(base_url: str) -> None:
    check = subprocess.run([sys.executable, "scripts/grafana_dashboard.py", "--check"], cwd=ROOT,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "kvserve.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"kvserve:[a-z0-9_]+", target["expr"])}
    assert len(queried) >= 20
    missing = queried - exported_names(base_url)
    assert not missing, f"the dashboard queries metrics the server does not export: {sorted(missing)}"
