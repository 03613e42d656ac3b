"""The performance and cost model: FLOPs and bytes per token, MFU / MBU, cost per token, inference vs training.

Everything here is arithmetic on a model's shape (an ``ArchConfig``: read from a GGUF / Hugging Face
directory or a preset by ``kvserve.bench.model_presets``) and on hardware numbers; nothing loads
weights or touches the engine. A worked example: ``kvserve.bench.deepseek_v3``.

Conventions (the ones vLLM, SGLang and the scaling-law papers use):

- A matmul of an ``[m, k]`` activation by a ``[k, n]`` weight costs ``2·m·k·n`` FLOPs. Per token the
  linear layers cost ``2 × matmul parameters`` (the *active* ones for MoE; the LM head counts, the
  embedding lookup does not).
- Attention adds, per (query, key) pair and per layer, ``2·num_heads·(qk_head_dim + v_head_dim)``
  FLOPs (``QKᵀ`` and ``P·V``). A prefill of ``n`` new tokens after ``p`` cached ones attends over
  ``n·p + n(n+1)/2`` pairs (causal, each token sees itself); a decode token at context ``L`` over ``L``.
- Bytes moved: decode reads every weight once per step (for MoE, the experts the batch touches) and the
  KV of every running request; prefill reads the weights once per chunk and writes the new KV.
- Training FLOPs ≈ 6 × active parameters × tokens (forward 2, backward 4).

Approximations, named so nobody mistakes them for measurements: norms, rotary embeddings, softmax and
activations are ignored (well under 1% of FLOPs for these shapes); MLA attention is counted in its
"naive" (non-absorbed) form; the expected number of distinct experts a batch touches assumes uniform
routing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from kvserve.arch import ArchConfig
from kvserve.errors import InvalidRequest

# --------------------------------------------------------------------------------------------------
# FLOPs and bytes
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cost:
    """FLOPs and bytes of some unit of work, and per token."""

    flops: float
    bytes: float
    num_tokens: int

    @property
    def flops_per_token(self) -> float:
        return self.flops / max(self.num_tokens, 1)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / max(self.num_tokens, 1)

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte: above the machine's peak_flops / peak_bandwidth the work is compute-bound."""
        return self.flops / self.bytes if self.bytes else math.inf

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.num_tokens + other.num_tokens)


def expected_experts_touched(shape: ArchConfig, num_tokens: int) -> float:
    """Distinct routed experts per MoE layer that ``num_tokens`` tokens hit, under uniform routing."""
    if not shape.is_moe:
        return 0.0
    e, k = shape.num_experts, shape.num_experts_per_token
    return e * (1.0 - (1.0 - k / e) ** max(num_tokens, 0))


def weight_bytes_read(shape: ArchConfig, num_tokens: int, weight_bytes: float = 2) -> float:
    """Bytes of weights one forward pass over ``num_tokens`` tokens reads (MoE: touched experts only)."""
    params = shape.num_layers * shape.attention_params() + shape.vocab_size * shape.hidden_size  # + LM head
    for layer, dense in enumerate(shape.layer_mlp_params(active=False)):
        if shape.is_moe_layer(layer):
            params += shape.moe_mlp_params(expected_experts_touched(shape, num_tokens))
        else:
            params += dense
    return params * weight_bytes


def linear_flops_per_token(shape: ArchConfig) -> float:
    return 2.0 * shape.matmul_params_per_token()


def prefill_cost(shape: ArchConfig, num_tokens: int, num_cached_tokens: int = 0, *,
                 weight_bytes: float = 2, kv_bytes: float = 2) -> Cost:
    """One prefill of ``num_tokens`` new tokens after ``num_cached_tokens`` found in the cache.

    FLOPs = 2·active·n + pairs·attention_per_pair, pairs = n·p + n(n+1)/2. Bytes: the weights once, the
    cached KV read once, the new KV written once.
    """
    n, p = num_tokens, num_cached_tokens
    pairs = n * p + n * (n + 1) / 2
    flops = n * linear_flops_per_token(shape) + pairs * shape.attention_flops_per_pair()
    moved = weight_bytes_read(shape, n, weight_bytes) + (p + n) * shape.kv_bytes_per_token(kv_bytes)
    return Cost(flops, moved, n)


def decode_cost(shape: ArchConfig, batch_size: int, context_len: int, *,
                weight_bytes: float = 2, kv_bytes: float = 2) -> Cost:
    """One decode step: ``batch_size`` requests each at ``context_len`` tokens (the new one included).

    FLOPs = B·(2·active + L·attention_per_pair). Bytes: the weights once per step (shared by the batch),
    each request's KV read, one new KV entry written per request.
    """
    b, ctx = batch_size, context_len
    flops = b * (linear_flops_per_token(shape) + ctx * shape.attention_flops_per_pair())
    moved = weight_bytes_read(shape, b, weight_bytes) + b * (ctx + 1) * shape.kv_bytes_per_token(kv_bytes)
    return Cost(flops, moved, b)


def request_flops(shape: ArchConfig, prompt_tokens: int, cached_tokens: int,
                  output_tokens: int) -> tuple[float, float]:
    """(prefill FLOPs, decode FLOPs) of one whole request, attention included.

    The first output token comes out of the prefill pass; each later one is a decode token at context
    ``prompt + i`` for i = 1 .. output_tokens − 1.
    """
    n = max(prompt_tokens - cached_tokens, 0)
    prefill = prefill_cost(shape, n, cached_tokens).flops
    k = max(output_tokens - 1, 0)
    # sum_{i=1..k} (prompt + i + 1) query-key pairs (the new token's own key included)
    pairs = k * (prompt_tokens + 1) + k * (k + 1) / 2
    decode = k * linear_flops_per_token(shape) + pairs * shape.attention_flops_per_pair()
    return prefill, decode


def request_kv_bytes(shape: ArchConfig, prompt_tokens: int, cached_tokens: int, output_tokens: int,
                     kv_bytes: float = 2) -> tuple[float, float]:
    """(prefill KV bytes, decode KV bytes) of one whole request: prefill reads the cached prefix and writes
    the new KV (the prompt's once in all); each decode token reads its context's KV."""
    per_token = shape.kv_bytes_per_token(kv_bytes)
    k = max(output_tokens - 1, 0)
    return prompt_tokens * per_token, (k * (prompt_tokens + 1) + k * (k + 1) / 2) * per_token


# --------------------------------------------------------------------------------------------------
# Hardware
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hardware:
    """Peak numbers of one accelerator: dense (no sparsity) tensor FLOP/s and memory bandwidth."""

    name: str
    bf16_flops: float
    fp8_flops: float | None
    memory_bandwidth: float  # bytes/s
    memory_bytes: float = 0.0
    source: str = ""

    def peak_flops(self, dtype: str = "bf16") -> float:
        if dtype == "fp8":
            if self.fp8_flops is None:
                raise InvalidRequest(f"{self.name} has no FP8 tensor cores", "dtype")
            return self.fp8_flops
        return self.bf16_flops


# Dense figures; NVIDIA's datasheets quote "with sparsity" numbers at twice these.
HARDWARE: dict[str, Hardware] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS* / FP8 3,958 TFLOPS* (*with
    # sparsity), 80 GB HBM3 at 3.35 TB/s.
    "h100-sxm": Hardware("H100 SXM", 989e12, 1979e12, 3.35e12, 80e9, "NVIDIA H100 datasheet (SXM5)"),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): same compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s.
    "h200": Hardware("H200 SXM", 989e12, 1979e12, 4.8e12, 141e9, "NVIDIA H200 datasheet (SXM)"),
    # H800 SXM5 (the export variant DeepSeek trained on): H100 SXM compute and HBM3 bandwidth, with
    # NVLink cut to 400 GB/s (NVIDIA H800 product brief; DeepSeek-V3 technical report, section 3.1).
    "h800": Hardware("H800 SXM", 989e12, 1979e12, 3.35e12, 80e9, "NVIDIA H800 SXM5 product brief"),
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): BF16 312 TFLOPS dense, no FP8, HBM2e 2,039 GB/s.
    "a100-80gb": Hardware("A100 80GB SXM", 312e12, None, 2.039e12, 80e9, "NVIDIA A100 datasheet (80GB SXM)"),
}


def get_hardware(name: str) -> Hardware:
    key = name.lower().replace("_", "-")
    aliases = {"h100": "h100-sxm", "a100": "a100-80gb", "h200-sxm": "h200", "h800-sxm": "h800"}
    key = aliases.get(key, key)
    if key not in HARDWARE:
        raise InvalidRequest(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}", "hardware")
    return HARDWARE[key]


def measure_peak(seconds: float = 1.0, device: str = "auto") -> Hardware:
    """Measure this machine's matmul FLOP/s and memory bandwidth (torch if present, else numpy).

    FLOP/s: the best of repeated square matmuls (bf16 on CUDA, float32 on CPU). Bandwidth: the best of
    repeated copies of a buffer far larger than the caches, counting the read and the write.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is installed with kvserve
        torch = None
    if torch is not None and (device == "cuda" or (device == "auto" and torch.cuda.is_available())):
        return _measure_torch_cuda(torch, seconds)
    import numpy as np

    n = 1024
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    flops = _best_rate(lambda: a @ b, 2.0 * n**3, seconds / 2)
    src = np.ones(64 << 20, dtype=np.uint8) * 3  # 64 MiB: larger than any CPU cache
    dst = np.empty_like(src)
    bandwidth = _best_rate(lambda: np.copyto(dst, src), 2.0 * src.nbytes, seconds / 2)
    return Hardware("this machine (CPU, fp32 matmul)", flops, None, bandwidth, source="measured")


def _measure_torch_cuda(torch: Any, seconds: float) -> Hardware:  # pragma: no cover - needs a GPU
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def matmul() -> None:
        a @ b
        torch.cuda.synchronize()

    flops = _best_rate(matmul, 2.0 * n**3, seconds / 2)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize()

    bandwidth = _best_rate(copy, 2.0 * src.numel(), seconds / 2)
    return Hardware(f"{torch.cuda.get_device_name()} (bf16 matmul)", flops, None, bandwidth, source="measured")


def _best_rate(fn: Any, work: float, budget_s: float) -> float:
    fn()  # warm up
    best = math.inf
    deadline = time.perf_counter() + budget_s
    runs = 0
    while runs < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        runs += 1
        if runs >= 200:
            break
    return work / best


def utilisation(flops: float, moved_bytes: float, seconds: float, hardware: Hardware,
                dtype: str = "bf16") -> tuple[float, float]:
    """(MFU, MBU): achieved FLOP/s ÷ peak FLOP/s and achieved bytes/s ÷ peak bandwidth."""
    if seconds <= 0:
        return math.nan, math.nan
    return flops / seconds / hardware.peak_flops(dtype), moved_bytes / seconds / hardware.memory_bandwidth


# --------------------------------------------------------------------------------------------------
# Inference vs training over a deployment's life
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """Training compute against inference compute per day, in FLOPs or GPU-hours (give one unit)."""

    name: str
    training_gpu_hours: float | None = None
    inference_gpu_hours_per_day: float | None = None
    training_flops: float | None = None
    inference_flops_per_day: float | None = None

    def ratio_after(self, days: float) -> float:
        """Inference compute after ``days`` ÷ training compute."""
        if self.training_gpu_hours and self.inference_gpu_hours_per_day:
            return days * self.inference_gpu_hours_per_day / self.training_gpu_hours
        if self.training_flops and self.inference_flops_per_day:
            return days * self.inference_flops_per_day / self.training_flops
        raise InvalidRequest("give training and inference compute in the same unit (GPU-hours or FLOPs)")

    def breakeven_days(self) -> float:
        return 1.0 / self.ratio_after(1.0)


def training_flops(shape: ArchConfig, num_tokens: float) -> float:
    """≈ 6 × active parameters × training tokens."""
    return 6.0 * shape.active_params() * num_tokens


def inference_flops_for_tokens(shape: ArchConfig, prefill_tokens: float, decode_tokens: float,
                               context_len: int = 0) -> float:
    """FLOPs to serve so many cache-miss prompt tokens and output tokens at an average context."""
    per_pair = shape.attention_flops_per_pair()
    # a token at average position ~context/2 in its prompt attends over that many keys; decode over context
    prefill = prefill_tokens * (linear_flops_per_token(shape) + per_pair * context_len / 2)
    decode = decode_tokens * (linear_flops_per_token(shape) + per_pair * context_len)
    return prefill + decode


# --------------------------------------------------------------------------------------------------
# Cost per token
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenPrices:
    """Dollars per million tokens of each kind."""

    cache_miss_input: float
    cache_hit_input: float
    output: float


def price_per_million(gpu_hour_price: float, tokens_per_s: float, num_gpus: int = 1) -> float:
    """Dollars per million tokens for ``num_gpus`` GPUs that together serve ``tokens_per_s``."""
    if tokens_per_s <= 0:
        return math.inf
    return gpu_hour_price * num_gpus / 3600.0 / tokens_per_s * 1e6


def token_prices(gpu_hour_price: float, *, miss_tok_s: float, hit_tok_s: float, output_tok_s: float,
                 num_gpus: int = 1) -> TokenPrices:
    """Cost per million tokens from each kind's throughput when the deployment does only that kind."""
    return TokenPrices(
        cache_miss_input=price_per_million(gpu_hour_price, miss_tok_s, num_gpus),
        cache_hit_input=price_per_million(gpu_hour_price, hit_tok_s, num_gpus),
        output=price_per_million(gpu_hour_price, output_tok_s, num_gpus),
    )


def split_throughput(duration_s: float, miss_tokens: float, hit_tokens: float, output_tokens: float,
                     seconds_per_token: tuple[float, float, float]) -> tuple[float, float, float]:
    """Attribute a mixed run's time to its three token kinds in proportion to their modelled cost.

    ``seconds_per_token`` is the modelled (miss, hit, output) time of one token (see
    ``modelled_seconds_per_token``); returns each kind's throughput as if the run had done only it.
    """
    modelled = [n * s for n, s in zip((miss_tokens, hit_tokens, output_tokens), seconds_per_token, strict=True)]
    total = sum(modelled)
    rates = []
    for n, m in zip((miss_tokens, hit_tokens, output_tokens), modelled, strict=True):
        share = duration_s * m / total if total > 0 else 0.0
        rates.append(n / share if share > 0 else math.inf)
    return rates[0], rates[1], rates[2]


def modelled_seconds_per_token(shape: ArchConfig, hardware: Hardware, *, context_len: int = 2048,
                               batch_size: int = 32, weight_bytes: float = 2) -> tuple[float, float, float]:
    """Roofline time of one (cache-miss prompt, cache-hit prompt, output) token on ``hardware``.

    A miss token costs its prefill FLOPs; a hit token only its KV read back; an output token the larger
    of its share of a decode step's FLOPs and bytes at ``batch_size``.
    """
    flops_s, bw = hardware.peak_flops(), hardware.memory_bandwidth
    chunk = prefill_cost(shape, context_len, 0, weight_bytes=weight_bytes)
    miss = max(chunk.flops / flops_s, chunk.bytes / bw) / max(context_len, 1)
    hit = shape.kv_bytes_per_token() / bw
    step = decode_cost(shape, batch_size, context_len, weight_bytes=weight_bytes)
    out = max(step.flops / flops_s, step.bytes / bw) / batch_size
    return miss, hit, out
