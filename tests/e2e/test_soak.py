"""The short soak in CI: ``benchmarks/soak.py`` for 7 seconds of traffic (its long run is a benchmark, with its
figures in docs/reliability.md). The script checks everything itself and exits 1 on any failure; this test
also checks that the faults it claims to inject did happen."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_with_aborts_redis_kills_and_garbled_disk_files(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (install it: apt-get install -y redis-server)")
    output = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/soak.py", "--duration", "7", "--concurrency", "4", "--warm-longs", "2",
         "--redis-kill-every", "4", "--corrupt-every", "1.5", "--sample", "3", "--output", str(output)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert output.exists(), result.stderr[-4000:]
    report = json.loads(output.read_text())
    assert result.returncode == 0, report["failures"]
    assert report["failures"] == []
    assert report["redis_kills"] >= 1 and report["disk_files_garbled"] >= 1 and report["disk_files_truncated"] >= 1
    assert report["dropped_by_client"] >= 1 and report["sample_checked"] >= 1
    assert set(report["by_kind"]) == {"agentic", "chat", "long", "sampled_n2", "logprobs", "stop"}
    assert report["sigterm_streams"] >= 1
