// The projections: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), bf16 in and out, fp32 accumulation.
//
// gemv_bf16:  AVX512-BF16 dot products against the weight in its own layout. torch's bf16 linear reads
//             weights at ~7 GB/s at one row on the machines we target; this streams them at close to
//             memory bandwidth.
// amx_linear: AMX tile multiplies against a copy of the weight packed once into the tile layout
//             (amx_pack); rows go through in chunks of 32, at any width.

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
  at::parallel_for(0, num_tiles, 16, [&](int64_t t0, int64_t t1) {
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
  at::parallel_for(0, N / kAmxN, 1, [&](int64_t b0, int64_t b1) {
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

// out[M, N] = x[M, K] @ w^T (+ bias) with w packed by amx_pack.
at::Tensor amx_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(request_amx(), "amx_linear: the kernel did not grant AMX");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "amx_linear: bf16 only");
  const int64_t NB = packed.size(0), KB = packed.size(1);
  const int64_t N = NB * kAmxN, K = KB * kAmxK;
  TORCH_CHECK(x_in.size(-1) == K, "amx_linear: inner dimensions differ");
  at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  TORCH_CHECK(M >= 1, "amx_linear: no rows");
  auto out_sizes = x_in.sizes().vec();
  out_sizes.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  const at::Tensor b = contiguous_bias(bias, N, "amx_linear");
  const at::BFloat16* bp = b.defined() ? b.data_ptr<at::BFloat16>() : nullptr;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  // Tiles: rows of x in one or two A tiles (0, 1); four C accumulators (2..5) as 1x4 or 2x2 (m x n-block);
  // weight tiles in 6, 7. Few rows (decode): a task is four n-blocks of the output; rows go through in
  // chunks of 32, so a task's weight tiles are read from memory once and from cache for the later chunks.
  const bool blocked = M >= kBlockedMinRows;
  const int64_t pairs = (NB + 1) / 2;
  const int64_t row_tasks = (M + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t pair_tasks = (pairs + kPairsPerTask - 1) / kPairsPerTask;
  // Many rows (prefill chunks): tasks of up to kPairsPerTask pairs of n-blocks x kRowsPerTask rows. A
  // task's 32-row chunk goes through the depth kDepthBlock k-steps at a time: that slice of x (<= 18 KB)
  // stays in L1 while each pair of n-blocks streams its weight tiles from L2 (the task's weights, <= 400
  // KB, stay there for all its row chunks), and the accumulators wait in a 16 KB fp32 buffer between
  // depth blocks. With both operands streaming from L2 the tile unit ran at a third of its peak.
  auto run_blocked = [&](auto&& claim, auto&& configure, auto&& tile_at) {
    alignas(64) float acc[kPairsPerTask][4][16 * 16];
    // A finished pair's accumulators wait here and are written out (bias, bf16) while the next pair's
    // first multiplies run: written right after their own multiplies, the stores left the tile unit idle
    // for about a quarter of the time.
    alignas(64) float done[4][16 * 16];
    int64_t done_m0 = -1, done_rows = 0, done_na = 0, done_nb = 0;
    auto flush = [&]() {
      if (done_m0 < 0) return;
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t rows = std::min<int64_t>(16, done_rows - 16 * half);
        const float* lo = done[2 * half];
        const float* hi = done[2 * half + 1];
        for (int64_t r = 0; r < rows; ++r) {
          at::BFloat16* dst = op + (done_m0 + 16 * half + r) * N + done_na * kAmxN;
#if KVSERVE_HAS_AVX512_BF16
          const __m512 a = _mm512_add_ps(_mm512_load_ps(lo + r * 16), bp ? load16(bp + done_na * kAmxN) : _mm512_setzero_ps());
          if (done_nb != done_na) {  // the pair's two n-blocks are one 64-byte run of the output row
            const __m512 b = _mm512_add_ps(_mm512_load_ps(hi + r * 16), bp ? load16(bp + done_nb * kAmxN) : _mm512_setzero_ps());
            _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, a));
          } else {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(a));
          }
#else
          for (int64_t n = 0; n < kAmxN; ++n) {
            dst[n] = at::BFloat16(lo[r * 16 + n] + (bp ? static_cast<float>(bp[done_na * kAmxN + n]) : 0.f));
            if (done_nb != done_na)
              dst[kAmxN + n] = at::BFloat16(hi[r * 16 + n] + (bp ? static_cast<float>(bp[done_nb * kAmxN + n]) : 0.f));
          }
#endif
        }
      }
      done_m0 = -1;
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
              if (kb == kb0) flush();  // overlaps the multiplies just issued
            }
            if (kb1 < KB) {
              _tile_stored(2, a, 64); _tile_stored(3, a + 256, 64); _tile_stored(4, a + 512, 64); _tile_stored(5, a + 768, 64);
              continue;
            }
            _tile_stored(2, done[0], 64); _tile_stored(3, done[1], 64);
            _tile_stored(4, done[2], 64); _tile_stored(5, done[3], 64);
            done_m0 = m0; done_rows = mc; done_na = na; done_nb = nb;
          }
        }
      }
    }
    flush();
  };
  const int64_t tasks = blocked ? pair_tasks * row_tasks : (NB + 3) / 4;
  parallel_claim(tasks, [&](auto&& claim) {
    int64_t configured_rows = -1;
    alignas(64) float cbuf[16 * 16];
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
    auto store = [&](int tile, int64_t m0, int64_t rows, int64_t nb) {
      switch (tile) {
        case 2: _tile_stored(2, cbuf, 64); break;
        case 3: _tile_stored(3, cbuf, 64); break;
        case 4: _tile_stored(4, cbuf, 64); break;
        default: _tile_stored(5, cbuf, 64); break;
      }
      const int64_t n0 = nb * kAmxN;
#if KVSERVE_HAS_AVX512_BF16
      // One output row of the tile is one vector: add the bias, round to bf16 (nearest even), store.
      const __m512 bias_row = bp ? load16(bp + n0) : _mm512_setzero_ps();
      for (int64_t r = 0; r < rows; ++r) {
        const __m256bh row = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(cbuf + r * 16), bias_row));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + (m0 + r) * N + n0), (__m256i)row);
      }
#else
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = 0; n < kAmxN; ++n) {
          float v = cbuf[r * 16 + n];
          if (bp) v += static_cast<float>(bp[n0 + n]);
          op[(m0 + r) * N + n0 + n] = at::BFloat16(v);
        }
#endif
    };
    auto tile_at = [&](int64_t nb, int64_t kb) { return wp + (nb * KB + kb) * kAmxK * kAmxN; };
    if (blocked) {
      run_blocked(claim, configure, tile_at);
      _tile_release();
      return;
    }
    for (int64_t t; (t = claim()) >= 0;) {
      const int64_t nb0 = t * 4;
      const int64_t nbs = std::min<int64_t>(4, NB - nb0);
      // n-blocks past the end of N are clamped to a valid tile; their accumulators are never stored.
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
          for (int j = 0; j < nbs; ++j) store(2 + j, m0, mc, nb0 + j);
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
            store(2, m0, 16, nb0 + pair);
            store(4, m0 + 16, mc - 16, nb0 + pair);
            if (pair + 1 < nbs) {
              store(3, m0, 16, nb0 + pair + 1);
              store(5, m0 + 16, mc - 16, nb0 + pair + 1);
            }
          }
        }
      }
    }
    _tile_release();
  });
  return out.view(out_sizes);
}

#else

at::Tensor amx_pack(const at::Tensor&) { TORCH_CHECK(false, "amx_pack: this build has no AMX"); }
at::Tensor amx_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "amx_linear: this build has no AMX");
}
bool request_amx() { return false; }

#endif

bool has_amx() { return KVSERVE_HAS_AMX && request_amx(); }

}  // namespace kvserve
