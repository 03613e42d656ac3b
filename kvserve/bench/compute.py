"""Prefill and decode compute of a benchmark run, from the cost model: FLOPs, bytes, MFU and MBU.

FLOPs come from each successful request's own token counts (prompt, cached, output; see
``costs.request_flops``), so attention is counted at each request's real context. Bytes: every engine
step reads the weights once (the step count comes from the server's ``/metrics``); decode also reads
each request's KV once per output token; prefill writes the new KV and reads the cached prefix once.
Weight reads are charged to decode: under continuous batching a step's weight read is what its decode
tokens pay for, while prefill is bound by FLOPs. Time is the engine's busy time from ``/metrics``
(seconds spent running the model), else the run's wall-clock duration.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from kvserve import costs
from kvserve.arch import ArchConfig
from kvserve.bench.client import RequestRecord

STEPS = "kvserve:engine_steps_total"
BUSY = "kvserve:engine_busy_seconds_total"


def metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None,
                  prefix: str = "kvserve:") -> dict[str, float]:
    """after − before for every counter-like sample with ``prefix`` (histogram sums and counts included)."""
    if not before or not after:
        return {}
    out = {}
    for name, value in after.items():
        if not name.startswith(prefix) or name.endswith("_created"):
            continue
        if name.endswith(("_total", "_sum", "_count")):
            out[name] = value - before.get(name, 0.0)
    return out


def run_compute(shape: ArchConfig, records: Iterable[RequestRecord], delta: dict[str, float],
                duration_s: float, hardware: costs.Hardware | None, *, weight_bytes: float = 2,
                kv_bytes: float = 2) -> dict[str, Any]:
    prefill_flops = decode_flops = 0.0
    prefill_bytes = decode_kv_bytes = 0.0
    computed_prompt = generated = counted = 0
    for r in records:
        if not r.success or r.prompt_tokens is None:
            continue
        counted += 1
        p, c, o = r.prompt_tokens, r.cached_tokens or 0, r.output_tokens
        pf, df = costs.request_flops(shape, p, c, o)
        prefill_flops += pf
        decode_flops += df
        pb, db = costs.request_kv_bytes(shape, p, c, o, kv_bytes)
        prefill_bytes += pb
        decode_kv_bytes += db
        computed_prompt += p - c
        generated += o

    steps = delta.get(STEPS)
    busy = delta.get(BUSY)
    if steps:
        tokens_per_step = (computed_prompt + generated) / steps
        weight_read = costs.weight_bytes_read(shape, max(1, round(tokens_per_step)), weight_bytes) * steps
    else:
        weight_read = 0.0
    decode_bytes = decode_kv_bytes + weight_read
    seconds = busy if busy and busy > 0 else duration_s
    total_flops, total_bytes = prefill_flops + decode_flops, prefill_bytes + decode_bytes
    out: dict[str, Any] = {
        "model": shape.name,
        "requests_counted": counted,
        "prefill_tokens_computed": computed_prompt,
        "output_tokens": generated,
        "engine_steps": steps,
        "prefill_flops": prefill_flops,
        "decode_flops": decode_flops,
        "prefill_bytes": prefill_bytes,
        "decode_bytes": decode_bytes,
        "weight_bytes_read": weight_read,
        "busy_s": seconds,
        "busy_from_metrics": bool(busy and busy > 0),
        "flops_per_s": total_flops / seconds if seconds > 0 else math.nan,
        "bytes_per_s": total_bytes / seconds if seconds > 0 else math.nan,
        "mfu": None,
    }
    if hardware is not None and seconds > 0:
        peak_f, peak_b = hardware.peak_flops(), hardware.memory_bandwidth
        out.update(
            hardware=f"{hardware.name}: {peak_f / 1e12:.3g} TFLOP/s, {peak_b / 1e9:.4g} GB/s ({hardware.source})",
            mfu=total_flops / seconds / peak_f,
            mfu_prefill=prefill_flops / seconds / peak_f,
            mfu_decode=decode_flops / seconds / peak_f,
            mbu=total_bytes / seconds / peak_b,
            mbu_prefill=prefill_bytes / seconds / peak_b,
            mbu_decode=decode_bytes / seconds / peak_b,
        )
    return out
