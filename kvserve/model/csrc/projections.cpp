// The projections: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), bf16 in and out, fp32 accumulation.
//
// gemv_bf16:  AVX512-BF16 dot products against the weight in its own layout. torch's bf16 linear reads
//             weights at ~7 GB/s at one row on the machines we target; this streams them at close to
//             memory bandwidth.
// amx_linear: AMX tile multiplies against a copy of the weight packed once into the tile layout
//             (amx_pack); rows go through in chunks of 32, at any width.
// amx_linear_silu_mul: the same multiplies for the MLP's fused gate/up weight, writing silu(gate) * up
//             straight from the accumulators.

#include "common.h"

#if KVSERVE_HAS_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvserve {
namespace {

// An optional bf16 bias of N values, contiguous; undefined when there is none.
inline at::Tensor contiguous_bias(const c10::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N, op, ": the bias must be bf16 with ",
              N, " values");
  return bias->contiguous();
}

}  // namespace

// ------------------------------------------------------------------------------------------------------
// GEMV
// ------------------------------------------------------------------------------------------------------
#if KVSERVE_HAS_AVX512_BF16

constexpr int kRowTile = 4;  // weight rows per inner tile
constexpr int kMTile = 4;    // activation rows per inner tile

// MT activation rows against NT weight rows starting at w (row stride K). Templated so the accumulators
// live in registers: a runtime-sized tile spills them to the stack on every dot product.
template <int MT, int NT>
inline void gemv_tile(const uint16_t* x, int64_t K, const uint16_t* w, float out[kMTile][kRowTile]) {
  __m512 acc[MT][NT];
#pragma GCC unroll 4
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  auto step = [&](int64_t k, __mmask32 mask) __attribute__((always_inline)) {
    __m512i wv[NT];
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + 4 * NT) * K + k), _MM_HINT_T0);
      wv[j] = _mm512_maskz_loadu_epi16(mask, w + j * K + k);
    }
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, (__m512bh)wv[j]);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, static_cast<__mmask32>(0xFFFFFFFFu));
  if (k < K) step(k, static_cast<__mmask32>((1u << (K - k)) - 1u));
#pragma GCC unroll 4
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int NT>
inline void gemv_rows(const uint16_t* x, int64_t mt, int64_t K, const uint16_t* w, float out[kMTile][kRowTile]) {
  switch (mt) {
    case 1: gemv_tile<1, NT>(x, K, w, out); break;
    case 2: gemv_tile<2, NT>(x, K, w, out); break;
    case 3: gemv_tile<3, NT>(x, K, w, out); break;
    default: gemv_tile<4, NT>(x, K, w, out); break;
  }
}

at::Tensor gemv_bf16(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16: bf16 only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "gemv_bf16: weight must be a contiguous 2-D tensor");
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x_in.size(-1) == K, "gemv_bf16: inner dimensions differ");
  at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  auto out_sizes = x_in.sizes().vec();
  out_sizes.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const at::Tensor b = contiguous_bias(bias, N, "gemv_bf16");
  const at::BFloat16* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
  const int64_t num_tiles = (N + kRowTile - 1) / kRowTile;
  parallel_range(0, num_tiles, 16, [&](int64_t t0, int64_t t1) {
    float res[kMTile][kRowTile];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kRowTile;
      const int64_t nt = std::min<int64_t>(kRowTile, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kMTile) {
        const int64_t mt = std::min<int64_t>(kMTile, M - m0);
        const uint16_t* wt = wp + n0 * K;
        if (nt == kRowTile) {
          gemv_rows<kRowTile>(xp + m0 * K, mt, K, wt, res);
        } else {
          for (int64_t j = 0; j < nt; ++j) {
            float one[kMTile][kRowTile];
            gemv_rows<1>(xp + m0 * K, mt, K, wt + j * K, one);
            for (int64_t i = 0; i < mt; ++i) res[i][j] = one[i][0];
          }
        }
        for (int64_t i = 0; i < mt; ++i)
          for (int64_t j = 0; j < nt; ++j) {
            float v = res[i][j];
            if (bp) v += static_cast<float>(bp[n0 + j]);
            op[(m0 + i) * N + n0 + j] = at::BFloat16(v);
          }
      }
    }
  });
  return out.view(out_sizes);
}

#else

at::Tensor gemv_bf16(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "gemv_bf16: this build has no AVX512-BF16");
}

#endif

bool has_avx512_bf16() { return KVSERVE_HAS_AVX512_BF16; }

// ------------------------------------------------------------------------------------------------------
// AMX linear: bf16 tile matmuls against weights packed once at load time into the tile layout.
// ------------------------------------------------------------------------------------------------------
#if KVSERVE_HAS_AMX

constexpr int64_t kAmxN = 16;  // output columns per weight tile
constexpr int64_t kAmxK = 32;  // reduction depth per tile (16 rows of bf16 pairs)
// The blocked many-row path of amx_linear (see there).
constexpr int64_t kBlockedMinRows = 128;
constexpr int64_t kPairsPerTask = 4;
constexpr int64_t kRowsPerTask = 256;
constexpr int64_t kDepthBlock = 9;
constexpr int64_t kRowsPerFlush = 4;  // a divisor of 16

bool request_amx() {
  // Linux hands out AMX tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// w [N, K] -> [N/16, K/32, 16, 32]: tile (n-block, k-block) holds, for each of its 16 k-pairs, the 16
// columns' (w[n][2p], w[n][2p+1]) side by side: the VNNI layout the tile multiply reads.
at::Tensor amx_pack(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2, "amx_pack: bf16 [N, K] only");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kAmxN == 0 && K % kAmxK == 0, "amx_pack: N must be a multiple of 16 and K of 32");
  at::Tensor src = w.contiguous();
  at::Tensor packed = at::empty({N / kAmxN, K / kAmxK, kAmxK / 2, kAmxN * 2}, w.options());
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>());
  uint16_t* d = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  parallel_range(0, N / kAmxN, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kb = 0; kb < K / kAmxK; ++kb) {
        uint16_t* tile = d + (nb * (K / kAmxK) + kb) * kAmxK * kAmxN;
        for (int64_t p = 0; p < kAmxK / 2; ++p)
          for (int64_t n = 0; n < kAmxN; ++n)
            for (int64_t e = 0; e < 2; ++e)
              tile[(p * kAmxN + n) * 2 + e] = s[(nb * kAmxN + n) * K + kb * kAmxK + 2 * p + e];
      }
  });
  return packed;
}

namespace {

// Writes a finished pair of accumulator tiles (fp32 [16][16] each: n-blocks na and nb of rows m0..m0+rows-1)
// to the output. Plain: the two n-blocks' columns (+ bias), as bf16, one 64-byte run per row (nb == na:
// a lone last n-block). silu_mul: the pair is the gate and the up of output columns (na / 2) * 16 ..: writes
// silu(gate) * up, rounded at every step as the unfused projection and silu_mul round.
struct PairWriter {
  at::BFloat16* out;
  int64_t ld;  // output row stride
  const at::BFloat16* bias;
  bool silu;

  void operator()(const float* a, const float* b, int64_t m0, int64_t rows, int64_t na, int64_t nb) const {
#if KVSERVE_HAS_AVX512_BF16
    const __m512 bias_a = bias ? load16(bias + na * kAmxN) : _mm512_setzero_ps();
    const __m512 bias_b = bias ? load16(bias + nb * kAmxN) : _mm512_setzero_ps();
#endif
    for (int64_t r = 0; r < rows; ++r) {
#if KVSERVE_HAS_AVX512_BF16
      if (silu) {
        const __m512 gate = round16_bf16(_mm512_load_ps(a + r * 16));
        const __m512 up = round16_bf16(_mm512_load_ps(b + r * 16));
        const __m512 act = round16_bf16(_mm512_div_ps(
            gate, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate)))));
        store16_bf16(out + (m0 + r) * ld + na / 2 * kAmxN, _mm512_mul_ps(act, up));
        continue;
      }
      at::BFloat16* dst = out + (m0 + r) * ld + na * kAmxN;
      const __m512 lo = _mm512_add_ps(_mm512_load_ps(a + r * 16), bias_a);
      if (nb == na) {
        store16_bf16(dst, lo);
        continue;
      }
      const __m512 hi = _mm512_add_ps(_mm512_load_ps(b + r * 16), bias_b);
      _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
      for (int64_t n = 0; n < kAmxN; ++n) {
        if (silu) {
          const float gate = round_bf16(a[r * 16 + n]), up = round_bf16(b[r * 16 + n]);
          out[(m0 + r) * ld + na / 2 * kAmxN + n] = at::BFloat16(round_bf16(gate / (1.f + std::exp(-gate))) * up);
          continue;
        }
        out[(m0 + r) * ld + na * kAmxN + n] = at::BFloat16(a[r * 16 + n] + (bias ? static_cast<float>(bias[na * kAmxN + n]) : 0.f));
        if (nb != na)
          out[(m0 + r) * ld + nb * kAmxN + n] = at::BFloat16(b[r * 16 + n] + (bias ? static_cast<float>(bias[nb * kAmxN + n]) : 0.f));
      }
#endif
    }
  }
};

// x [M, K] against the packed weight's NB n-blocks, each finished pair of tiles handed to write.
void amx_matmul(const at::BFloat16* xp, int64_t M, const at::BFloat16* wp, int64_t NB, int64_t KB,
                const PairWriter& write) {
  const int64_t K = KB * kAmxK;
  auto tile_at = [&](int64_t nb, int64_t kb) { return wp + (nb * KB + kb) * kAmxK * kAmxN; };
  // Tiles: rows of x in one or two A tiles (0, 1); four C accumulators (2..5) as 1x4 or 2x2 (m x n-block);
  // weight tiles in 6, 7.
  //
  // Few rows (decode): a task is four n-blocks of the output; rows go through in chunks of 32, so a task's
  // weight tiles are read from memory once and from cache for the later chunks.
  //
  // Many rows (prefill chunks): tasks of up to kPairsPerTask pairs of n-blocks x kRowsPerTask rows. A
  // task's 32-row chunk goes through the depth kDepthBlock k-steps at a time: that slice of x (<= 18 KB)
  // stays in L1 while each pair of n-blocks streams its weight tiles from L2 (the task's weights, <= 400
  // KB, stay there for all its row chunks), and the accumulators wait in a 16 KB fp32 buffer between
  // depth blocks. With both operands streaming from L2 the tile unit ran at a third of its peak.
  const bool blocked = M >= kBlockedMinRows;
  const int64_t pairs = (NB + 1) / 2;
  const int64_t row_tasks = (M + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t tasks = blocked ? (pairs + kPairsPerTask - 1) / kPairsPerTask * row_tasks : (NB + 3) / 4;
  parallel_claim(tasks, [&](auto&& claim) {
    int64_t configured_rows = 0;
    // mc < 0: the blocked path's chunk of -mc <= 16 rows, whose second A tile repeats the first.
    auto configure = [&](int64_t mc) {
      if (mc == configured_rows) return;
      const int64_t r0 = std::min<int64_t>(std::abs(mc), 16), r1 = mc > 16 ? mc - 16 : (mc < 0 ? r0 : 1);
      TileConfig cfg;
      cfg.rows[0] = r0; cfg.colsb[0] = 64;
      cfg.rows[1] = r1; cfg.colsb[1] = 64;
      for (int c = 2; c < 6; ++c) {
        cfg.rows[c] = ((mc > 16 || mc < 0) && c >= 4) ? r1 : r0;
        cfg.colsb[c] = 64;
      }
      cfg.rows[6] = cfg.rows[7] = 16; cfg.colsb[6] = cfg.colsb[7] = 64;
      asm volatile("" : : "r"(&cfg) : "memory");  // keep GCC from dropping the stores LDTILECFG reads
      _tile_loadconfig(&cfg);
      configured_rows = mc;
    };
    // Finished accumulators: stored here, then written out.
    alignas(64) float done[4][16 * 16];
    auto store_done = [&]() {
      _tile_stored(2, done[0], 64); _tile_stored(3, done[1], 64);
      _tile_stored(4, done[2], 64); _tile_stored(5, done[3], 64);
    };
    if (blocked) {
      alignas(64) float acc[kPairsPerTask][4][16 * 16];
      // A finished pair waits in `done` and is written out a few rows per k-step of the next pair, between
      // its multiplies: written right after their own multiplies, the stores left the tile unit idle for
      // about a quarter of the time, and a whole pair's silu at once is more than the core can overlap.
      int64_t done_m0 = -1, done_rows = 0, done_na = 0, done_nb = 0, written = 0;
      auto flush = [&](int64_t upto) {
        if (done_m0 < 0) return;
        upto = std::min(upto, done_rows);
        for (; written < upto; written += kRowsPerFlush) {  // row runs never straddle the two halves
          const int64_t half = written / 16, rows = std::min<int64_t>(kRowsPerFlush, upto - written);
          write(done[2 * half] + (written % 16) * 16, done[2 * half + 1] + (written % 16) * 16,
                done_m0 + written, rows, done_na, done_nb);
        }
        if (written >= done_rows) done_m0 = -1;
      };
      for (int64_t t; (t = claim()) >= 0;) {
        const int64_t p0 = (t / row_tasks) * kPairsPerTask, np = std::min<int64_t>(kPairsPerTask, pairs - p0);
        const int64_t m_begin = (t % row_tasks) * kRowsPerTask, m_end = std::min<int64_t>(M, m_begin + kRowsPerTask);
        for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
          const int64_t mc = std::min<int64_t>(32, m_end - m0);
          configure(mc > 16 ? mc : -mc);
          const at::BFloat16* x0 = xp + m0 * K;
          const at::BFloat16* x1 = mc > 16 ? x0 + 16 * K : x0;  // one A tile: the second repeats it, unstored
          for (int64_t kb0 = 0; kb0 < KB; kb0 += kDepthBlock) {
            const int64_t kb1 = std::min<int64_t>(KB, kb0 + kDepthBlock);
            for (int64_t j = 0; j < np; ++j) {
              const int64_t na = 2 * (p0 + j), nb = std::min<int64_t>(na + 1, NB - 1);
              float* a = acc[j][0];
              if (kb0 == 0) {
                _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
              } else {
                _tile_loadd(2, a, 64); _tile_loadd(3, a + 256, 64); _tile_loadd(4, a + 512, 64); _tile_loadd(5, a + 768, 64);
              }
              for (int64_t kb = kb0; kb < kb1; ++kb) {
                _tile_loadd(0, x0 + kb * kAmxK, K * 2);
                _tile_loadd(1, x1 + kb * kAmxK, K * 2);
                _tile_loadd(6, tile_at(na, kb), 64);
                _tile_loadd(7, tile_at(nb, kb), 64);
                _tile_dpbf16ps(2, 0, 6); _tile_dpbf16ps(3, 0, 7);
                _tile_dpbf16ps(4, 1, 6); _tile_dpbf16ps(5, 1, 7);
                flush((kb - kb0 + 1) * kRowsPerFlush);  // overlaps the multiplies just issued
              }
              flush(32);
              if (kb1 < KB) {
                _tile_stored(2, a, 64); _tile_stored(3, a + 256, 64); _tile_stored(4, a + 512, 64); _tile_stored(5, a + 768, 64);
                continue;
              }
              store_done();
              done_m0 = m0; done_rows = mc; done_na = na; done_nb = nb; written = 0;
            }
          }
        }
      }
      flush(32);
      _tile_release();
      return;
    }
    for (int64_t t; (t = claim()) >= 0;) {
      const int64_t nb0 = t * 4;
      const int64_t nbs = std::min<int64_t>(4, NB - nb0);
      // n-blocks past the end of N are clamped to a valid tile; their accumulators are never written.
      auto nb_at = [&](int64_t j) { return nb0 + std::min<int64_t>(j, nbs - 1); };
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int64_t mc = std::min<int64_t>(32, M - m0);
        configure(mc);
        const at::BFloat16* xc = xp + m0 * K;
        if (mc <= 16) {  // one A tile against four n-blocks
          _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
          for (int64_t kb = 0; kb < KB; ++kb) {
            _tile_loadd(0, xc + kb * kAmxK, K * 2);
            _tile_loadd(6, tile_at(nb_at(0), kb), 64); _tile_dpbf16ps(2, 0, 6);
            _tile_loadd(7, tile_at(nb_at(1), kb), 64); _tile_dpbf16ps(3, 0, 7);
            _tile_loadd(6, tile_at(nb_at(2), kb), 64); _tile_dpbf16ps(4, 0, 6);
            _tile_loadd(7, tile_at(nb_at(3), kb), 64); _tile_dpbf16ps(5, 0, 7);
          }
          store_done();
          write(done[0], done[1], m0, mc, nb0, nb_at(1));
          if (nbs > 2) write(done[2], done[3], m0, mc, nb0 + 2, nb_at(3));
        } else {  // two A tiles against two n-blocks at a time
          for (int64_t pair = 0; pair < nbs; pair += 2) {
            _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
            for (int64_t kb = 0; kb < KB; ++kb) {
              _tile_loadd(0, xc + kb * kAmxK, K * 2);
              _tile_loadd(1, xc + 16 * K + kb * kAmxK, K * 2);
              _tile_loadd(6, tile_at(nb_at(pair), kb), 64);
              _tile_loadd(7, tile_at(nb_at(pair + 1), kb), 64);
              _tile_dpbf16ps(2, 0, 6); _tile_dpbf16ps(3, 0, 7);
              _tile_dpbf16ps(4, 1, 6); _tile_dpbf16ps(5, 1, 7);
            }
            store_done();
            write(done[0], done[1], m0, 16, nb0 + pair, nb_at(pair + 1));
            write(done[2], done[3], m0 + 16, mc - 16, nb0 + pair, nb_at(pair + 1));
          }
        }
      }
    }
    _tile_release();
  });
}

// x [..., K] -> x [M, K] and the output [M, width], checking the packed weight's depth.
std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> amx_operands(const at::Tensor& x_in, const at::Tensor& packed,
                                                                      int64_t width, const char* op) {
  TORCH_CHECK(request_amx(), op, ": the kernel did not grant AMX");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, op, ": bf16 only");
  const int64_t K = packed.size(1) * kAmxK;
  TORCH_CHECK(x_in.size(-1) == K, op, ": inner dimensions differ");
  at::Tensor x = x_in.reshape({-1, K}).contiguous();
  TORCH_CHECK(x.size(0) >= 1, op, ": no rows");
  auto out_sizes = x_in.sizes().vec();
  out_sizes.back() = width;
  return {x, at::empty({x.size(0), width}, x.options()), out_sizes};
}

}  // namespace

void amx_matmul_packed(const at::BFloat16* x, int64_t M, const at::BFloat16* packed, int64_t NB, int64_t KB,
                       at::BFloat16* out, int64_t ld, const at::BFloat16* bias, bool silu_mul) {
  TORCH_CHECK(request_amx(), "amx_matmul_packed: the kernel did not grant AMX");
  amx_matmul(x, M, packed, NB, KB, PairWriter{out, ld, bias, silu_mul});
}

// out[M, N] = x[M, K] @ w^T (+ bias) with w packed by amx_pack.
at::Tensor amx_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const int64_t NB = packed.size(0), N = NB * kAmxN;
  auto [x, out, out_sizes] = amx_operands(x_in, packed, N, "amx_linear");
  const at::Tensor b = contiguous_bias(bias, N, "amx_linear");
  amx_matmul(x.data_ptr<at::BFloat16>(), x.size(0), packed.data_ptr<at::BFloat16>(), NB, packed.size(1),
             PairWriter{out.data_ptr<at::BFloat16>(), N, b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, false});
  return out.view(out_sizes);
}

// silu(gate) * up for [gate | up] = x @ w^T, with w packed by amx_pack after its gate and up rows were
// interleaved 16 at a time (gate 0-15, up 0-15, gate 16-31, ...): out [M, N / 2], as silu_mul(amx_linear)
// computes it, bit for bit, without the [M, N] product ever reaching memory.
at::Tensor amx_linear_silu_mul(const at::Tensor& x_in, const at::Tensor& packed) {
  const int64_t NB = packed.size(0);
  TORCH_CHECK(NB % 2 == 0, "amx_linear_silu_mul: the packed weight must hold gate and up blocks in pairs");
  auto [x, out, out_sizes] = amx_operands(x_in, packed, NB / 2 * kAmxN, "amx_linear_silu_mul");
  amx_matmul(x.data_ptr<at::BFloat16>(), x.size(0), packed.data_ptr<at::BFloat16>(), NB, packed.size(1),
             PairWriter{out.data_ptr<at::BFloat16>(), NB / 2 * kAmxN, nullptr, true});
  return out.view(out_sizes);
}

#else

at::Tensor amx_pack(const at::Tensor&) { TORCH_CHECK(false, "amx_pack: this build has no AMX"); }
at::Tensor amx_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "amx_linear: this build has no AMX");
}
at::Tensor amx_linear_silu_mul(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "amx_linear_silu_mul: this build has no AMX");
}
void amx_matmul_packed(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int64_t, at::BFloat16*, int64_t,
                       const at::BFloat16*, bool) {
  TORCH_CHECK(false, "amx_matmul_packed: this build has no AMX");
}
bool request_amx() { return false; }

#endif

bool has_amx() { return KVSERVE_HAS_AMX && request_amx(); }

}  // namespace kvserve
