// The projections on CPUs without AVX-512 (AVX2 and FMA: Zen 1-3, Haswell to Comet Lake, most small cloud
// VMs): out[M, N] = x[M, K] @ w[N, K]^T on the AVX-512 family's packed layout (pack_pairs.cpp).
//
// torch's bf16 linear on such a CPU is several times slower than its fp32 one at every width
// (benchmarks/cpu_kernels.py): it has no bf16 arithmetic to call. Here, as in the widening AVX-512 kernel,
// the weight stays bf16 in memory, widens to fp32 in registers with one integer op per 8 values, and meets
// fp32 activations in FMAs; products of bf16 values are exact in fp32 and the sums stay fp32.
//
// A packed block is 16 output columns, two ymm of 8.
//
// avx2_linear: out (+ bias) in bf16; avx2_linear_silu_mul: silu(gate) * up for the MLP's [gate | up] weight
// packed with its gate and up rows interleaved 16 at a time, rounded at every step as
// silu_mul(avx2_linear(...)) rounds, so the fused and unfused pair are bit-identical.

#include "common.h"

namespace kvserve {

#if KVSERVE_HAS_AVX2

namespace {

constexpr int64_t kBlock = 16;     // output columns per packed block
// Rows per micro-tile: 4 of one block (8 accumulators), 2 of a gate/up pair (8); with the rows' broadcasts,
// the weight step and the mask, that fills the 16 ymm registers without spilling (larger tiles measured
// slower in benchmarks/cpu_kernels.py's sweep).
constexpr int kPlainRows = 4;
constexpr int kSiluRows = 2;
constexpr int64_t kRowChunk = 96;  // activation rows per work item (fp32, kept in L2 across its blocks)

struct Operands {
  const float* x;  // [M, K] fp32
  int64_t M, K;
  const uint16_t* w;  // packed
  at::BFloat16* out;
  int64_t ld_out;
  const at::BFloat16* bias;  // N values or nullptr
  bool silu;                 // blocks come in (gate, up) pairs; out holds silu(gate) * up, one block per pair
};

// Rows m0 .. m0 + MR - 1 against NB consecutive blocks from block nb: acc[i][2 j + h] holds row i's
// columns 8 h .. 8 h + 7 of block j. Templated so the accumulators stay in registers.
template <int MR, int NB>
inline void products(const Operands& op, int64_t m0, int64_t nb, __m256 (&acc)[MR][2 * NB]) {
  const int64_t pairs = op.K / 2;
  const float* x[MR];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i) x[i] = op.x + (m0 + i) * op.K;
  const uint16_t* w = op.w + nb * pairs * 32;
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p, w += 32) {
#pragma GCC unroll 2
    for (int e = 0; e < 2; ++e) {  // step k = 2p, then k + 1
      __m256 xv[MR];
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) xv[i] = _mm256_broadcast_ss(x[i] + 2 * p + e);
#pragma GCC unroll 4
      for (int c = 0; c < 2 * NB; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (c / 2) * pairs * 32 + (c % 2) * 16));
        const __m256 step = _mm256_castsi256_ps(e == 0 ? _mm256_slli_epi32(raw, 16) : _mm256_and_si256(raw, high_half));
#pragma GCC unroll 6
        for (int i = 0; i < MR; ++i) acc[i][c] = _mm256_fmadd_ps(xv[i], step, acc[i][c]);
      }
    }
  }
}

template <int MR, int NB>
inline void micro_tile(const Operands& op, int64_t m0, int64_t nb) {
  __m256 acc[MR][2 * NB];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < 2 * NB; ++c) acc[i][c] = _mm256_setzero_ps();
  products<MR, NB>(op, m0, nb, acc);
  if constexpr (NB == 2) {
    // A (gate, up) pair: rounded at every step as silu_mul(linear(...)) rounds.
    for (int i = 0; i < MR; ++i)
      for (int h = 0; h < 2; ++h)
        store8_bf16(op.out + (m0 + i) * op.ld_out + nb / 2 * kBlock + h * 8,
                    _mm256_mul_ps(round8_bf16(silu8(round8_bf16(acc[i][h]))), round8_bf16(acc[i][2 + h])));
  } else {
    for (int h = 0; h < 2; ++h) {
      const __m256 b = op.bias ? load8(op.bias + nb * kBlock + h * 8) : _mm256_setzero_ps();
      for (int i = 0; i < MR; ++i)
        store8_bf16(op.out + (m0 + i) * op.ld_out + nb * kBlock + h * 8, _mm256_add_ps(acc[i][h], b));
    }
  }
}

template <int NB, int MR>
inline void rows_tile(const Operands& op, int64_t m0, int64_t rows, int64_t nb) {
  if constexpr (MR > 1) {
    if (rows < MR) return rows_tile<NB, MR - 1>(op, m0, rows, nb);
  }
  micro_tile<MR, NB>(op, m0, nb);
}

// Every row of the item's chunk against its run of blocks (gate/up pairs with silu); a block's weights
// (16 x K bf16) stay in L1/L2 while the chunk's rows go by. A row's result does not depend on its tile.
void run_item(const Operands& op, int64_t m_begin, int64_t m_end, int64_t nb_begin, int64_t nb_end) {
  const int per_tile = op.silu ? kSiluRows : kPlainRows;
  const int64_t step = op.silu ? 2 : 1;
  // Rows in even tiles (6 rows: two of 3, not 4 and 2): a thin tail tile spends its weight loads on few rows.
  const int64_t tiles = (m_end - m_begin + per_tile - 1) / per_tile;
  const int64_t tile_rows = tiles > 0 ? (m_end - m_begin + tiles - 1) / tiles : per_tile;
  for (int64_t nb = nb_begin; nb < nb_end; nb += step) {
    for (int64_t m = m_begin; m < m_end; m += tile_rows) {
      const int64_t rows = std::min<int64_t>(tile_rows, m_end - m);
      if (op.silu)
        rows_tile<2, kSiluRows>(op, m, rows, nb);
      else
        rows_tile<1, kPlainRows>(op, m, rows, nb);
    }
  }
}

void matmul(const Operands& op, int64_t num_blocks) {
  const int64_t chunks = (op.M + kRowChunk - 1) / kRowChunk;
  // Work items hold whole gate/up pairs; about four per thread for each row chunk, so a thread that loses
  // its core costs little.
  const int64_t unit = op.silu ? 2 : 1;
  const int64_t units = num_blocks / unit;
  const int64_t per_item = std::max<int64_t>(1, units / (4 * kernel_threads()));
  const int64_t groups = (units + per_item - 1) / per_item;
  auto item = [&](int64_t i) {
    const int64_t c = i / groups, g = i % groups;
    run_item(op, c * kRowChunk, std::min(op.M, (c + 1) * kRowChunk), g * per_item * unit,
             std::min(num_blocks, (g + 1) * per_item * unit));
  };
  // Serial below ~1 M multiply-adds with the weight counted as 8 rows (as the AVX-512 kernel decides).
  const int64_t work = std::max<int64_t>(op.M, 8) * num_blocks * kBlock * op.K;
  if (work < (int64_t{1} << 20)) {
    for (int64_t i = 0; i < chunks * groups; ++i) item(i);
    return;
  }
  parallel_claim(chunks * groups, [&](auto&& claim) {
    for (int64_t i; (i = claim()) >= 0;) item(i);
  });
}

at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         bool silu, const char* name) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 && packed.size(2) == 2 * kBlock, name,
              ": the weight must be packed by pack_bf16_pairs");
  const int64_t blocks = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(!silu || blocks % 2 == 0, name, ": the packed weight must hold gate and up blocks in pairs");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, name, ": bf16 activations only");
  TORCH_CHECK(x_in.size(-1) == K, name, ": inner dimensions differ");
  const int64_t width = silu ? blocks / 2 * kBlock : blocks * kBlock;
  // Activations widened to fp32 once, on the kernels' threads (torch's conversion would wake OpenMP's team).
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor wide = at::empty({M, K}, x.options().dtype(at::kFloat));
  const at::BFloat16* src = x.data_ptr<at::BFloat16>();
  float* dst = wide.data_ptr<float>();
  parallel_range(0, M, kSerialRows, [&](int64_t r0, int64_t r1) {
    int64_t i = r0 * K;
    for (; i + 8 <= r1 * K; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
    for (; i < r1 * K; ++i) dst[i] = static_cast<float>(src[i]);
  });
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(!silu && bias->scalar_type() == at::kBFloat16 && bias->numel() == width, name,
                ": the bias must be bf16 with ", width, " values");
    b = bias->contiguous();
  }
  at::Tensor out = at::empty({M, width}, x_in.options());
  matmul({dst, M, K, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), out.data_ptr<at::BFloat16>(),
          width, b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, silu},
         blocks);
  auto out_sizes = x_in.sizes().vec();
  out_sizes.back() = width;
  return out.view(out_sizes);
}

}  // namespace

at::Tensor avx2_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return packed_linear(x, packed, bias, false, "avx2_linear");
}

at::Tensor avx2_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed) {
  return packed_linear(x, packed, c10::nullopt, true, "avx2_linear_silu_mul");
}

void avx2_matmul_packed(const float* x_wide, int64_t M, const at::BFloat16* packed, int64_t NB, int64_t K,
                        at::BFloat16* out, int64_t ld, const at::BFloat16* bias, bool silu_mul) {
  matmul({x_wide, M, K, reinterpret_cast<const uint16_t*>(packed), out, ld, bias, silu_mul}, NB);
}

#else

at::Tensor avx2_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "avx2_linear: this build has no AVX2 and FMA");
}
at::Tensor avx2_linear_silu_mul(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "avx2_linear_silu_mul: this build has no AVX2 and FMA");
}

#endif

bool has_avx2() { return KVSERVE_HAS_AVX2; }

}  // namespace kvserve
