"""The AMX tile multiply's peak on this machine, one thread and all threads, beside what kvserve's kernels get.

    python benchmarks/amx_peak.py [--seconds 1.0] [--repeats 5]

1. Peak: each thread issues nothing but bf16 tile multiplies (TDPBF16PS, 16x16x32) into six independent
   accumulators held in tile registers, so no load, store or dependency limits them. Reported in TFLOP/s
   for 1 thread and for every thread, alternating, best of --repeats. Whether the vCPUs have a tile unit
   each shows in the ratio: ~2x with two threads means two units, ~1x means they share one.
2. Achieved: kvserve's amx_linear over SmolLM2-135M's 30 layers of projections at 1,024 rows (a prefill
   chunk), as a share of the all-threads peak.
Needs a CPU with AMX-BF16 and a compiler (the kernel is compiled inline with -march=native).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

from kvserve.model.cpu_kernels import load_cpu_kernels

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static void multiply_only(int64_t iterations) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t ones[16 * 32];
  for (auto& v : ones) v = 0x3f80;  // bf16 1.0
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
  for (int64_t i = 0; i < iterations; ++i) {
    _tile_dpbf16ps(0, 6, 7); _tile_dpbf16ps(1, 6, 7); _tile_dpbf16ps(2, 6, 7);
    _tile_dpbf16ps(3, 6, 7); _tile_dpbf16ps(4, 6, 7); _tile_dpbf16ps(5, 6, 7);
  }
  alignas(64) float sink[256];
  _tile_stored(0, sink, 64);
  _tile_release();
}

// TFLOP/s of `threads` threads each running `iterations` rounds of six tile multiplies.
double amx_peak(int64_t iterations, int64_t threads) {
  TORCH_CHECK(syscall(SYS_arch_prctl, 0x1023, 18) == 0, "amx_peak: the kernel did not grant AMX");
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) pool.emplace_back(multiply_only, iterations);
  for (auto& thread : pool) thread.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return threads * iterations * 6 * 16.0 * 16 * 32 * 2 / seconds / 1e12;
}
"""

# SmolLM2-135M's projections per layer (out, in): q/k/v fused, o, gate/up fused, down.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def projections_tflops(rows: int, repeats: int) -> float:
    ops = torch.ops.kvserve
    weights = [[ops.amx_pack(torch.randn(n, k, dtype=torch.bfloat16) * 0.05) for n, k in SHAPES]
               for _ in range(LAYERS)]
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
    flops = LAYERS * sum(2 * rows * n * k for n, k in SHAPES)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in weights:
            for (_, k), w in zip(SHAPES, layer, strict=True):
                ops.amx_linear(inputs[k], w, None)
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0, help="rough length of one peak measurement")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None or not kernels.amx:
        raise SystemExit("this machine (or build) has no AMX")
    module = load_inline(name="kvserve_amx_peak", cpp_sources=_SOURCE, functions=["amx_peak"],
                         extra_cflags=["-O2", "-march=native"])
    threads = torch.get_num_threads()
    # Calibrate: iterations for ~--seconds on one thread.
    probe = 200_000
    rate = module.amx_peak(probe, 1) * 1e12 / (6 * 16 * 16 * 32 * 2)
    iterations = max(probe, int(rate / 6 * args.seconds))
    best = {1: 0.0, threads: 0.0}
    for repeat in range(args.repeats):
        for count in ((1, threads) if repeat % 2 == 0 else (threads, 1)):
            best[count] = max(best[count], module.amx_peak(iterations, count))
    achieved = projections_tflops(1024, args.repeats)
    print(f"AMX bf16 peak, tile multiplies only: 1 thread {best[1]:.2f} TFLOP/s, {threads} threads "
          f"{best[threads]:.2f} TFLOP/s ({best[threads] / best[1]:.2f}x)")
    print(f"amx_linear, SmolLM2-135M projections at 1,024 rows, {threads} threads: {achieved:.2f} TFLOP/s "
          f"({achieved / best[threads]:.0%} of the {threads}-thread peak)")


if __name__ == "__main__":
    main()
