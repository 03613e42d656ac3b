"""A case study for the cost model: DeepSeek-V3's published training cost against a published day of
its inference (``kvserve cost --preset deepseek-v3``).

The figures are DeepSeek's own:

- DeepSeek-V3 technical report (arXiv 2412.19437), Table 1: 2.664M H800 GPU-hours pre-training + 119K
  context extension + 5K post-training = 2.788M H800 GPU-hours; 14.8T training tokens.
- DeepSeek "Day 6" inference-system overview (open-infra-index, 2025-03-01): over 24 h an average of
  226.75 nodes of 8 H800 GPUs were busy serving V3/R1 (cost $87,072 at $2/GPU-hour); 608B input tokens
  of which 342B (56.3%) hit the on-disk KV cache, and 168B output tokens; each H800 node averaged ~73.7k
  input tokens/s (cache hits included) while prefilling, or ~14.8k output tokens/s while decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve import costs
from kvserve.bench.commands import format_prices
from kvserve.bench.model_presets import PRESETS


@dataclass(frozen=True, slots=True)
class PublishedDay:
    """A model's training cost and one day of its serving, as the operator published them."""

    training_gpu_hours: float
    training_tokens: float
    inference_nodes: float
    gpus_per_node: int
    day_input_tokens: float
    day_cached_tokens: float
    day_output_tokens: float
    gpu_hour_price: float
    node_prefill_tok_s: float  # input tokens/s per node while prefilling, cache hits included
    node_decode_tok_s: float  # output tokens/s per node while decoding
    list_prices: str  # the operator's price list then, for comparison

    @property
    def inference_gpu_hours_per_day(self) -> float:
        return self.inference_nodes * self.gpus_per_node * 24

    @property
    def cache_hit_share(self) -> float:
        return self.day_cached_tokens / self.day_input_tokens


DEEPSEEK_V3 = PublishedDay(
    training_gpu_hours=2.788e6,
    training_tokens=14.8e12,
    inference_nodes=226.75,
    gpus_per_node=8,
    day_input_tokens=608e9,
    day_cached_tokens=342e9,
    day_output_tokens=168e9,
    gpu_hour_price=2.0,
    node_prefill_tok_s=73.7e3,
    node_decode_tok_s=14.8e3,
    list_prices="$0.07 hit / $0.27 miss / $1.10 output per M tokens",
)


def deepseek_v3_report(day: PublishedDay = DEEPSEEK_V3) -> str:
    """DeepSeek-V3's published training cost against its published day of inference."""
    shape = PRESETS["deepseek-v3"]
    life = costs.Lifecycle("deepseek-v3", training_gpu_hours=day.training_gpu_hours,
                           inference_gpu_hours_per_day=day.inference_gpu_hours_per_day)
    h800 = costs.get_hardware("h800")
    train_flops = costs.training_flops(shape, day.training_tokens)
    train_gpu_s = day.training_gpu_hours * 3600
    miss = day.day_input_tokens - day.day_cached_tokens
    out_tokens = day.day_output_tokens
    day_flops = costs.inference_flops_for_tokens(shape, miss, out_tokens, context_len=4096)
    flops_life = costs.Lifecycle("deepseek-v3 (FLOPs)", training_flops=train_flops, inference_flops_per_day=day_flops)
    price = day.gpu_hour_price
    lines = [
        f"DeepSeek-V3: {shape.total_params() / 1e9:.0f}B parameters, {shape.active_params() / 1e9:.1f}B active, "
        f"KV {shape.kv_bytes_per_token() / 1024:.1f} KiB/token (MLA)",
        f"training: {day.training_gpu_hours / 1e6:.3f}M H800 GPU-hours "
        f"(${day.training_gpu_hours * price / 1e6:.3f}M at ${price:g}/GPU-hour), "
        f"{day.training_tokens / 1e12:.1f}T tokens",
        f"  6 x active x tokens = {train_flops:.3g} FLOPs = {train_flops / train_gpu_s / h800.peak_flops() * 100:.0f}%"
        f" of H800 bf16 peak over those hours (FP8 training: {train_flops / train_gpu_s / h800.peak_flops('fp8') * 100:.0f}%)",
        f"inference: {day.inference_nodes} nodes x {day.gpus_per_node} H800 x 24 h = "
        f"{day.inference_gpu_hours_per_day:,.0f} GPU-hours/day "
        f"(${day.inference_gpu_hours_per_day * price:,.0f}/day)",
        f"  inference/training (GPU-hours): {life.ratio_after(365):.1f}x after one year, "
        f"{life.ratio_after(730):.1f}x after two years; equal after {life.breakeven_days():.0f} days",
        f"  tokens that day: {day.day_input_tokens / 1e9:.0f}B input "
        f"({day.cache_hit_share:.1%} cache hits), "
        f"{out_tokens / 1e9:.0f}B output",
        f"  FLOPs those tokens need (2 x active, attention at 4k context): {day_flops:.3g}/day, "
        f"{flops_life.ratio_after(365):.1f}x training per year: inference runs at "
        f"{day_flops / (day.inference_gpu_hours_per_day * 3600 * h800.peak_flops()) * 100:.0f}% "
        f"of bf16 peak (training: {train_flops / train_gpu_s / h800.peak_flops() * 100:.0f}%)",
    ]
    # Cost per million tokens from the published per-node throughputs; the prefill node's time is split
    # between cache-miss and cache-hit tokens by modelled cost (a hit costs only its KV read).
    miss_s, hit_s, _ = costs.modelled_seconds_per_token(shape, h800, context_len=4096)
    prefill = day.node_prefill_tok_s
    miss_rate, hit_rate, _ = costs.split_throughput(1.0, prefill * (1 - day.cache_hit_share),
                                                    prefill * day.cache_hit_share, 0.0, (miss_s, hit_s, 0.0))
    rates = (miss_rate, hit_rate, day.node_decode_tok_s)
    prices = costs.token_prices(price, miss_tok_s=rates[0], hit_tok_s=rates[1], output_tok_s=rates[2],
                                num_gpus=day.gpus_per_node)
    lines.append(format_prices(prices, price, day.gpus_per_node, rates,
                               f"one H800 node at its published {day.node_prefill_tok_s / 1e3:.1f}k input / "
                               f"{day.node_decode_tok_s / 1e3:.1f}k output tok/s"))
    lines.append(f"  (DeepSeek's V3 list prices then: {day.list_prices})")
    return "\n".join(lines)
