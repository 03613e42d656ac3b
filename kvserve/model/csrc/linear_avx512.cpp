// The projections on AVX-512 machines without AMX: out[M, N] = x[M, K] @ w[N, K]^T, in two variants on one
// packed layout.
//
// torch's bf16 linear on such a CPU converts and multiplies at ~40 GFLOP/s at decode widths and about a
// third of its fp32 rate at prefill widths. Here the weight stays bf16 in memory (half the bytes of fp32,
// which is what decode is bound by) in a layout packed once at load, widens to fp32 in registers with one
// integer op per 16 values, and meets fp32 activations in FMAs: every product of two bf16 values is exact
// in fp32 and sums are kept in fp32, as the BF16 dot-product instruction keeps them.
//
// The weight is packed by pack_bf16_pairs (pack_pairs.cpp): one 64-byte load holds two k steps of a block of
// 16 output rows.
// avx512_linear: out (+ bias) in bf16; avx512_linear_silu_mul: silu(gate) * up for the MLP's [gate | up]
//              weight packed with its gate and up rows interleaved 16 at a time.
// bf16dot_linear, bf16dot_linear_silu_mul: the same products on CPUs with AVX512-BF16 but no AMX (Zen 4 and
//              5, Cooper Lake): one VDPBF16PS per row, block and pair of k takes the pair's two products
//              straight from bf16 activations and the packed weight as it is, where the widening variant
//              spends a widening op per block and two FMAs. Products of bf16 values are exact in fp32 and
//              the sums stay fp32; the two variants differ only in the order fp32 sums are rounded.

#include "common.h"

namespace kvserve {

#if KVSERVE_HAS_AVX512

namespace {

constexpr int64_t kBlock = 16;     // output columns per packed block (one zmm of fp32)
constexpr int kMaxRows = 12;       // activation rows per micro-tile: 24 accumulators for two blocks
constexpr int64_t kRowChunk = 96;  // activation rows per work item (fp32, kept in L2 across its panels)

struct Operands {
  const void* x;        // [M, K]: fp32 for the widening variant, bf16 for the dot-product one
  int64_t M, K;
  const uint16_t* w;    // packed
  at::BFloat16* out;
  int64_t ld_out;
  const at::BFloat16* bias;  // N values or nullptr
  bool silu;            // blocks come in (gate, up) pairs; out holds silu(gate) * up, one block per pair
};

// Rows m0 .. m0 + MR - 1 against NT consecutive blocks starting at block nb, into acc. Templated so the
// accumulators stay in registers (a runtime-sized tile spills them on every FMA).
template <int MR, int NT>
inline void widening_products(const Operands& op, int64_t m0, int64_t nb, __m512 (&acc)[MR][NT]) {
  const int64_t pairs = op.K / 2;
  const float* x = static_cast<const float*>(op.x) + m0 * op.K;
  const uint16_t* w[NT];
#pragma GCC unroll 2
  for (int j = 0; j < NT; ++j) w[j] = op.w + (nb + j) * pairs * 32;
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i raw[NT];
    __m512 step[NT];
#pragma GCC unroll 2
    for (int j = 0; j < NT; ++j) {
      raw[j] = _mm512_loadu_si512(w[j] + p * 32);
      step[j] = _mm512_castsi512_ps(_mm512_slli_epi32(raw[j], 16));
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * op.K + 2 * p]);
#pragma GCC unroll 2
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_fmadd_ps(xv, step[j], acc[i][j]);
    }
#pragma GCC unroll 2
    for (int j = 0; j < NT; ++j) step[j] = _mm512_castsi512_ps(_mm512_and_si512(raw[j], high_half));
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * op.K + 2 * p + 1]);
#pragma GCC unroll 2
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_fmadd_ps(xv, step[j], acc[i][j]);
    }
  }
}

#if KVSERVE_HAS_AVX512_BF16
// The same products with VDPBF16PS: a row's (x[k], x[k + 1]) broadcast as one 32-bit value meets the
// packed (w[n][k], w[n][k + 1]) pairs of a block in one instruction.
template <int MR, int NT>
inline void dot_products(const Operands& op, int64_t m0, int64_t nb, __m512 (&acc)[MR][NT]) {
  const int64_t pairs = op.K / 2;
  const uint32_t* x = static_cast<const uint32_t*>(op.x) + m0 * pairs;
  const uint16_t* w[NT];
#pragma GCC unroll 2
  for (int j = 0; j < NT; ++j) w[j] = op.w + (nb + j) * pairs * 32;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NT];
#pragma GCC unroll 2
    for (int j = 0; j < NT; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + p * 32);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * pairs + p]));
#pragma GCC unroll 2
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
}
#endif

template <int MR, int NT, bool Dot>
inline void micro_tile(const Operands& op, int64_t m0, int64_t nb) {
  __m512 acc[MR][NT];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
#if KVSERVE_HAS_AVX512_BF16
  if constexpr (Dot)
    dot_products<MR, NT>(op, m0, nb, acc);
  else
#endif
    widening_products<MR, NT>(op, m0, nb, acc);
  if (op.silu) {
    static_assert(NT == 2 || NT == 1, "a silu tile is one (gate, up) pair");
    if constexpr (NT == 2) {
      // Rounded at every step as silu_mul(linear(...)) rounds: gate and up to bf16, silu to bf16, product.
      for (int i = 0; i < MR; ++i) {
        const __m512 gate = round16_bf16(acc[i][0]);
        const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                               exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
        store16_bf16(op.out + (m0 + i) * op.ld_out + nb / 2 * kBlock,
                     _mm512_mul_ps(round16_bf16(silu), round16_bf16(acc[i][1])));
      }
    }
    return;
  }
  for (int j = 0; j < NT; ++j) {
    const __m512 b = op.bias ? load16(op.bias + (nb + j) * kBlock) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i)
      store16_bf16(op.out + (m0 + i) * op.ld_out + (nb + j) * kBlock, _mm512_add_ps(acc[i][j], b));
  }
}

template <int NT, bool Dot, int MR = kMaxRows>
inline void rows_tile(const Operands& op, int64_t m0, int64_t rows, int64_t nb) {
  if constexpr (MR > 1) {
    if (rows < MR) return rows_tile<NT, Dot, MR - 1>(op, m0, rows, nb);
  }
  micro_tile<MR, NT, Dot>(op, m0, nb);
}

// Every row of the work item's chunk against its run of block pairs; the pair's weights (2 x 16 x K bf16)
// stay in L1/L2 while the chunk's rows go by.
template <bool Dot>
void run_item(const Operands& op, int64_t m_begin, int64_t m_end, int64_t nb_begin, int64_t nb_end) {
  // Rows in even tiles (16 rows: two of 8, not 12 and 4): a thin tail tile spends its weight loads on few
  // rows. A row's result does not depend on its tile.
  const int64_t tiles = (m_end - m_begin + kMaxRows - 1) / kMaxRows;
  const int64_t tile_rows = tiles > 0 ? (m_end - m_begin + tiles - 1) / tiles : kMaxRows;
  for (int64_t nb = nb_begin; nb < nb_end; nb += 2) {
    const bool pair = nb + 1 < nb_end;
    for (int64_t m = m_begin; m < m_end; m += tile_rows) {
      const int64_t rows = std::min<int64_t>(tile_rows, m_end - m);
      if (pair)
        rows_tile<2, Dot>(op, m, rows, nb);
      else
        rows_tile<1, Dot>(op, m, rows, nb);
    }
  }
}

template <bool Dot>
void matmul(const Operands& op, int64_t num_blocks) {
  const int64_t chunks = (op.M + kRowChunk - 1) / kRowChunk;
  const int64_t pairs = (num_blocks + 1) / 2;
  // About four items per thread for each row chunk, so a thread that loses its core costs little.
  const int64_t per_item = std::max<int64_t>(1, pairs / (4 * kernel_threads()));
  const int64_t groups = (pairs + per_item - 1) / per_item;
  // Serial below ~1 M multiply-adds with the weight counted as 8 rows: at a row or two a projection is
  // bound by reading its weight, which one core does at about half the machine's bandwidth.
  const int64_t work = std::max<int64_t>(op.M, 8) * num_blocks * kBlock * op.K;
  auto item = [&](int64_t i) {
    const int64_t c = i / groups, g = i % groups;
    run_item<Dot>(op, c * kRowChunk, std::min(op.M, (c + 1) * kRowChunk), g * per_item * 2,
                  std::min(num_blocks, (g + 1) * per_item * 2));
  };
  if (work < (int64_t{1} << 20)) {  // a few microseconds: not worth waking the other threads
    for (int64_t i = 0; i < chunks * groups; ++i) item(i);
    return;
  }
  parallel_claim(chunks * groups, [&](auto&& claim) {
    for (int64_t i; (i = claim()) >= 0;) item(i);
  });
}

// x (any leading dims, last K, bf16) widened to an fp32 [M, K] copy, and out's sizes. Widened here, on the
// kernels' threads: torch's own conversion would wake OpenMP's team, whose spinning threads then take the
// cores the matmul's workers need.
std::tuple<at::Tensor, std::vector<int64_t>> widened_rows(const at::Tensor& x_in, int64_t K, int64_t width,
                                                         const char* op) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, op, ": bf16 activations only");
  TORCH_CHECK(x_in.size(-1) == K, op, ": inner dimensions differ");
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor wide = at::empty({M, K}, x.options().dtype(at::kFloat));
  const at::BFloat16* src = x.data_ptr<at::BFloat16>();
  float* dst = wide.data_ptr<float>();
  parallel_range(0, M, kSerialRows, [&](int64_t r0, int64_t r1) {
    int64_t i = r0 * K;
    for (; i + 16 <= r1 * K; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
    for (; i < r1 * K; ++i) dst[i] = static_cast<float>(src[i]);
  });
  auto out_sizes = x_in.sizes().vec();
  out_sizes.back() = width;
  return {wide, out_sizes};
}

// out = x @ W^T (+ bias), or silu(gate) * up of the interleaved [gate | up] weight, on either variant.
template <bool Dot>
at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         bool silu, const char* name) {
  const int64_t blocks = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(!silu || blocks % 2 == 0, name, ": the packed weight must hold gate and up blocks in pairs");
  const int64_t width = silu ? blocks / 2 * kBlock : blocks * kBlock;
  at::Tensor x;
  std::vector<int64_t> out_sizes;
  if constexpr (Dot) {
    TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, name, ": bf16 activations only");
    TORCH_CHECK(x_in.size(-1) == K, name, ": inner dimensions differ");
    x = x_in.reshape({-1, K}).contiguous();  // read as it is: pairs of bf16 are the instruction's operand
    out_sizes = x_in.sizes().vec();
    out_sizes.back() = width;
  } else {
    std::tie(x, out_sizes) = widened_rows(x_in, K, width, name);
  }
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(!silu && bias->scalar_type() == at::kBFloat16 && bias->numel() == width, name,
                ": the bias must be bf16 with ", width, " values");
    b = bias->contiguous();
  }
  at::Tensor out = at::empty({x.size(0), width}, x_in.options());
  matmul<Dot>({x.data_ptr(), x.size(0), K, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
               out.data_ptr<at::BFloat16>(), width, b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, silu},
              blocks);
  return out.view(out_sizes);
}

}  // namespace

at::Tensor avx512_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return packed_linear<false>(x_in, packed, bias, false, "avx512_linear");
}

at::Tensor avx512_linear_silu_mul(const at::Tensor& x_in, const at::Tensor& packed) {
  return packed_linear<false>(x_in, packed, c10::nullopt, true, "avx512_linear_silu_mul");
}

#if KVSERVE_HAS_AVX512_BF16
at::Tensor bf16dot_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return packed_linear<true>(x_in, packed, bias, false, "bf16dot_linear");
}

at::Tensor bf16dot_linear_silu_mul(const at::Tensor& x_in, const at::Tensor& packed) {
  return packed_linear<true>(x_in, packed, c10::nullopt, true, "bf16dot_linear_silu_mul");
}
#else
at::Tensor bf16dot_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "bf16dot_linear: this build has no AVX512-BF16");
}
at::Tensor bf16dot_linear_silu_mul(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "bf16dot_linear_silu_mul: this build has no AVX512-BF16");
}
#endif

namespace {
// The variant the build's CPU takes for weights packed elsewhere (the quantised projections' panels): the dot
// products on bf16 x where it has AVX512-BF16, else the widening FMAs on x_wide.
constexpr bool kDotBuild = KVSERVE_HAS_AVX512_BF16;

Operands packed_operands(const at::BFloat16* x, const float* x_wide, int64_t M, const at::BFloat16* packed, int64_t K,
                         at::BFloat16* out, int64_t ld, const at::BFloat16* bias, bool silu_mul) {
  return {kDotBuild ? static_cast<const void*>(x) : static_cast<const void*>(x_wide), M, K,
          reinterpret_cast<const uint16_t*>(packed), out, ld, bias, silu_mul};
}
}  // namespace

void avx512_matmul_packed(const at::BFloat16* x, const float* x_wide, int64_t M, const at::BFloat16* packed,
                          int64_t NB, int64_t K, at::BFloat16* out, int64_t ld, const at::BFloat16* bias,
                          bool silu_mul) {
  matmul<kDotBuild>(packed_operands(x, x_wide, M, packed, K, out, ld, bias, silu_mul), NB);
}

void avx512_matmul_packed_here(const at::BFloat16* x, const float* x_wide, int64_t M, const at::BFloat16* packed,
                               int64_t NB, int64_t K, at::BFloat16* out, int64_t ld, const at::BFloat16* bias,
                               bool silu_mul) {
  run_item<kDotBuild>(packed_operands(x, x_wide, M, packed, K, out, ld, bias, silu_mul), 0, M, 0, NB);
}

#else

at::Tensor avx512_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "avx512_linear: this build has no AVX-512");
}
at::Tensor avx512_linear_silu_mul(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "avx512_linear_silu_mul: this build has no AVX-512");
}
at::Tensor bf16dot_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "bf16dot_linear: this build has no AVX-512");
}
at::Tensor bf16dot_linear_silu_mul(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "bf16dot_linear_silu_mul: this build has no AVX-512");
}

#endif

bool has_avx512() { return KVSERVE_HAS_AVX512; }

}  // namespace kvserve
