"""`kvserve trace --in-process`: a cold and a warm request, the warm one's prefill shrinking."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_trace_in_process_shows_cold_then_warm() -> None:
    prompt = "Tools: " + " ".join(f"tool_{i}(path) reads file {i};" for i in range(20)) + " Which tool reads file 7?"
    result = subprocess.run(
        [sys.executable, "-m", "kvserve", "trace", "--in-process", "--repeat", "2", "--max-tokens", "4", prompt],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    cold, warm = result.stdout.split("(warm)")
    found = [int(m) for m in re.findall(r"(\d+)/\d+ prompt tokens found", result.stdout)]
    prefill = [int(m) for m in re.findall(r"prefill .* (\d+) tokens in", result.stdout)]
    assert "(cold)" in cold and found[0] == 0 and found[1] > 0
    assert prefill[1] < prefill[0] and prefill[0] + found[0] == prefill[1] + found[1]
