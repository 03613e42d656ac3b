"""The int8 dot product's peak on this machine (VPDPBUSD, 512-bit), beside what the quantised kernels get.

    python benchmarks/vnni_peak.py [--model smollm2-135m] [--rows 512] [--seconds 0.5] [--repeats 7]

1. Peak: every thread issues nothing but VPDPBUSD into twelve independent accumulators (64 multiply-adds an
   instruction), so no load or dependency limits it; and the same with the int8 kernels' per-chunk float
   work beside it (for eight rows: eight instructions with broadcast activations each, then a conversion,
   a scale and an FMA, and with --offset the asymmetric formats' second FMA): what that mix allows.
   Reported as shares of the peak on one thread.
2. Achieved: the model's quantised projections (every layer, held interleaved) at --rows rows with int8
   activations, as a share of the peak on each thread (VPDPBUSD instructions the products need, 64
   multiply-adds each, over the time).
Each round measures all of them in turn; shares are medians of the rounds' ratios (a shared VM's speed
moves from minute to minute).
Needs a CPU with AVX512-VNNI and a compiler (compiled inline with -march=native).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from quantized import quantized_projections  # benchmarks/quantized.py
from torch.utils.cpp_extension import load_inline

from kvserve import LLM
from kvserve.model.cpu_kernels import KernelThreadScope, load_cpu_kernels

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <chrono>
#include <cstring>
#include <vector>

// Nanoseconds per VPDPBUSD of `iterations` rounds of twelve independent ones.
double dot_only(int64_t iterations) {
  __m512i acc[12];  // distinct, so that the compiler cannot merge them
#pragma GCC unroll 12
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(2);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < iterations; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
    asm volatile("" : "+v"(w), "+v"(x));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  __m512i sum = acc[0];
  for (int i = 1; i < 12; ++i) sum = _mm512_add_epi32(sum, acc[i]);
  asm volatile("" : : "v"(sum));
  return seconds / (iterations * 12.0) * 1e9;
}

// Nanoseconds per VPDPBUSD of the int8 kernels' mix: per round, eight rows' eight instructions on broadcast
// activations, then each row's conversion, scale and FMA (and with `offset`, a second FMA).
double kernel_mix(int64_t iterations, bool offset) {
  std::vector<int8_t> x(1 << 16);
  std::vector<float> scales(1 << 12);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<int8_t>(i * 7);
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = i * 1e-3f;
  __m512 acc[8];
#pragma GCC unroll 8
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512i w[8];
#pragma GCC unroll 8
  for (int g = 0; g < 8; ++g) w[g] = _mm512_set1_epi8(g + 1);
  const __m512 d = _mm512_set1_ps(1.0001f), m = _mm512_set1_ps(0.5f);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < iterations; ++k) {
    const int8_t* p = x.data() + (k & 255) * 256;
    const float* s = scales.data() + (k & 511) * 8;
    __m512i sums[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) sums[i] = _mm512_set1_epi32(i);
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g)
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        int32_t v;
        std::memcpy(&v, p + 32 * i + 4 * g, 4);
        sums[i] = _mm512_dpbusd_epi32(sums[i], w[g], _mm512_set1_epi32(v));
      }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]), _mm512_mul_ps(d, _mm512_set1_ps(s[i])), acc[i]);
      if (offset) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(s[i + 1]), acc[i]);
    }
    asm volatile("" : "+v"(w[0]));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  __m512 total = acc[0];
  for (int i = 1; i < 8; ++i) total = _mm512_add_ps(total, acc[i]);
  asm volatile("" : : "v"(total));
  return seconds / (iterations * 64.0) * 1e9;
}
"""


class Projections:
    """Every layer's quantised projections of a model (held interleaved) at some number of rows, with int8
    activations."""

    def __init__(self, model: str, rows: int) -> None:
        llm = LLM(model=model, num_kv_blocks=64, max_num_seqs=1, quantized_activations="int8")
        self.weights = [w for w in quantized_projections(llm, model) if w.interleaved]
        if not self.weights:
            raise SystemExit(f"{model}: no projection is held interleaved here")
        self.inputs = {w.cols: torch.randn(rows, w.cols, dtype=torch.bfloat16) for w in self.weights}
        self.instructions = sum(rows * w.shape[0] * w.shape[1] for w in self.weights) / 64

    def ns_per_instruction(self) -> float:
        """Nanoseconds per VPDPBUSD on each thread, one pass."""
        with KernelThreadScope():
            start = time.perf_counter()
            for w in self.weights:
                torch.ops.kvserve.quant_linear(self.inputs[w.cols], w.data, w.types, w.cols, None, 4, 2**31 - 1, True)
            seconds = time.perf_counter() - start
        return seconds * torch.get_num_threads() / self.instructions * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=0.5, help="rough length of one peak measurement")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.quantized_interleave_rows:
        raise SystemExit("this machine (or build) has no AVX512-VNNI kernels")
    module = load_inline(name="kvserve_vnni_peak", cpp_sources=_SOURCE, functions=["dot_only", "kernel_mix"],
                         extra_cflags=["-O2", "-march=native"])
    projections = Projections(args.model, args.rows)
    projections.ns_per_instruction()  # warm-up
    iterations = max(1000, int(args.seconds / (12 * module.dot_only(100_000) * 1e-9)))
    # The VMs' speed moves from minute to minute: each round measures all four, and the shares are medians
    # of the rounds' own ratios.
    rounds = []
    for _ in range(args.repeats):
        time.sleep(0.5)  # the kernels' workers spin a while after a pass, on the core the peak is measured on
        peak = module.dot_only(iterations)
        rounds.append((peak, peak / module.kernel_mix(iterations // 5, False),
                       peak / module.kernel_mix(iterations // 5, True), peak / projections.ns_per_instruction()))
    peak, mix, mix_offset, achieved = (statistics.median(column) for column in zip(*rounds, strict=True))
    print(f"VPDPBUSD peak, independent instructions only: {peak:.3f} ns each, one thread (median of "
          f"{args.repeats})")
    print(f"the int8 kernels' mix: {mix:.0%} of peak; with the offset's FMA {mix_offset:.0%}")
    print(f"{args.model}'s projections at {args.rows} rows, int8 activations, {torch.get_num_threads()} threads: "
          f"{achieved:.0%} of peak per thread")


if __name__ == "__main__":
    main()
