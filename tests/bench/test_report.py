"""Report math against values computed independently from synthetic per-request records."""

from __future__ import annotations

import math
import random

import pytest

from kvserve.bench.client import RequestRecord
from kvserve.bench.report import SLO, format_table, latency_stats, parse_slo, summarize
from kvserve.errors import InvalidRequest


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), written out by hand."""
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def make_records(n: int = 40, seed: int = 1) -> list[RequestRecord]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        out = rng.choice([1, 2, 5, 16])
        ttft = rng.uniform(0.05, 0.8)
        itl = [rng.uniform(0.01, 0.09) for _ in range(out - 1)]
        prompt = rng.randint(20, 400)
        records.append(RequestRecord(
            request_id=i, success=True, ttft_s=ttft, itl_s=itl, e2e_s=ttft + sum(itl) + rng.uniform(0, 0.01),
            prompt_tokens=prompt, cached_tokens=rng.randint(0, prompt), output_tokens=out,
            output_tokens_from_usage=True, num_chunks=out))
    # failures count as requests but contribute nothing else
    records.append(RequestRecord(request_id=n, success=False, error="HTTP 500: boom", e2e_s=0.2, prompt_tokens=50,
                                 cached_tokens=50, output_tokens=3))
    records.append(RequestRecord(request_id=n + 1, success=False, error="ReadTimeout: slow", e2e_s=9.0))
    return records


def test_summary_matches_independent_computation() -> None:
    records = make_records()
    ok = [r for r in records if r.success]
    duration = 7.5
    s = summarize(records, duration)

    assert s["successful_requests"] == 40 and s["failed_requests"] == 2 and s["num_requests"] == 42
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    assert s["total_input_tokens"] == total_in
    assert s["total_output_tokens"] == total_out
    assert s["request_throughput"] == pytest.approx(40 / duration)
    assert s["output_throughput"] == pytest.approx(total_out / duration)
    assert s["total_token_throughput"] == pytest.approx((total_in + total_out) / duration)
    assert s["cache_hit_rate"] == pytest.approx(sum(r.cached_tokens for r in ok) / total_in)

    ttft = [r.ttft_s * 1e3 for r in ok]
    # TPOT excludes the first token and requests with a single token
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) * 1e3 for r in ok if r.output_tokens > 1]
    itl = [g * 1e3 for r in ok for g in r.itl_s]
    e2e = [r.e2e_s * 1e3 for r in ok]
    assert len(tpot) < len(ok)  # some single-token requests were left out
    for key, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        assert s[key]["mean"] == pytest.approx(sum(values) / len(values)), key
        for p in (50, 90, 99):
            assert s[key][f"p{p}"] == pytest.approx(percentile(values, p)), (key, p)
    assert s["errors"] == {"HTTP 500": 1, "ReadTimeout": 1}


def test_output_tokens_fall_back_to_chunks_and_missing_usage_gives_no_hit_rate() -> None:
    records = [RequestRecord(request_id=i, success=True, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1] * 4, num_chunks=5,
                             output_tokens=5) for i in range(3)]
    s = summarize(records, 1.0)
    assert s["cache_hit_rate"] is None
    assert s["total_output_tokens"] == 15 and s["output_tokens_from_usage"] == 0
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)


def test_goodput_counts_exactly_the_requests_meeting_every_slo() -> None:
    slo = SLO(ttft_ms=200, tpot_ms=50, e2e_ms=1000)
    cases = [  # (ttft s, e2e s, output tokens, success, meets)
        (0.100, 0.500, 9, True, True),    # tpot 50 ms: on the line counts
        (0.100, 0.501, 9, True, False),   # tpot 50.125 ms
        (0.2001, 0.3, 2, True, False),    # ttft over
        (0.200, 1.0, 1, True, True),      # one token: tpot 0; ttft and e2e on the line
        (0.050, 1.2, 100, True, False),   # e2e over although tpot is fine
        (0.050, 0.2, 3, False, False),    # failed
    ]
    records = [RequestRecord(request_id=i, success=ok, ttft_s=t, e2e_s=e, output_tokens=o)
               for i, (t, e, o, ok, _) in enumerate(cases)]
    expected = sum(meets for *_, meets in cases)
    assert [slo.met_by(r) for r in records] == [meets for *_, meets in cases]
    s = summarize(records, 4.0, slo)
    assert s["good_requests"] == expected == 2
    assert s["request_goodput"] == pytest.approx(expected / 4.0)
    # only the objectives given are checked
    assert summarize(records, 4.0, SLO(ttft_ms=200))["good_requests"] == 4
    assert "request_goodput" not in summarize(records, 4.0, SLO())


def test_parse_slo() -> None:
    assert parse_slo("ttft=500ms,tpot=50ms,e2e=2s") == SLO(500, 50, 2000)
    assert parse_slo("ttft=0.5s") == SLO(ttft_ms=500)
    assert parse_slo("e2el=300") == SLO(e2e_ms=300)
    assert parse_slo(None) == SLO()
    with pytest.raises(InvalidRequest):
        parse_slo("latency=3s")
    with pytest.raises(InvalidRequest):
        parse_slo("ttft=fast")


def test_empty_and_table() -> None:
    assert latency_stats([])["p99"] is None
    s = summarize([RequestRecord(request_id=0, error="x")], 1.0, SLO(ttft_ms=1))
    assert s["successful_requests"] == 0 and s["ttft_ms"]["mean"] is None
    table = format_table(summarize(make_records(), 2.0, SLO(ttft_ms=300)))
    for label in ("Successful requests:", "Request goodput", "P99 TTFT (ms):", "Prefix cache hit rate", "P90 ITL"):
        assert label in table
