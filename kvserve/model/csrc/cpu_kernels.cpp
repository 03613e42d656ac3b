// CPU kernels for where a step spends its time: the projections, decode attention, and the element-wise
// glue between them.
//
// Built on first use by kvserve/model/cpu_kernels.py (torch.utils.cpp_extension, -march=native) and
// registered as torch ops under torch.ops.kvserve. The torch reference paths stay the oracle: tests
// compare every kernel against them.
//
// gemv_bf16:     out[M, N] = x[M, K] @ w[N, K]^T (+ bias), bf16 in/out, fp32 accumulation with AVX512-BF16
//                dot products. torch's bf16 linear reaches ~7 GB/s of weight reads at one row on the
//                machines we target; this streams the weights at close to memory bandwidth.
// amx_linear:    the same product as AMX tile multiplies against a copy of the weight packed once into
//                the tile layout (amx_pack); rows go through in chunks of 32.
// paged_decode:  one query token per sequence against its KV blocks, read in place from the paged cache
//                (no gather copy), split along the keys so few long sequences still use every core.
//                Returns fp32 output and the log-sum-exp, so partial results (cascade attention over a
//                shared prefix) can be merged exactly.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KVSERVE_HAS_AVX512_BF16 1
#else
#define KVSERVE_HAS_AVX512_BF16 0
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define KVSERVE_HAS_AMX 1
#else
#define KVSERVE_HAS_AMX 0
#endif

namespace {

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// An optional bf16 bias of N values, contiguous; undefined when there is none.
inline at::Tensor contiguous_bias(const c10::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N, op, ": the bias must be bf16 with ",
              N, " values");
  return bias->contiguous();
}

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
// AMX linear for decode batches (up to 32 rows): bf16 tile matmuls against weights packed once at load
// time into the tile layout, so the weight read streams at memory bandwidth whatever the batch width.
// ------------------------------------------------------------------------------------------------------
#if KVSERVE_HAS_AMX

constexpr int64_t kAmxN = 16;  // output columns per weight tile
constexpr int64_t kAmxK = 32;  // reduction depth per tile (16 rows of bf16 pairs)

bool request_amx() {
  // Linux hands out AMX tile state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

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
  // weight tiles in 6, 7. A task is four n-blocks of the output; rows go through in chunks of 32, so a
  // task's weight tiles are read from memory once and from cache for the later chunks.
  const int64_t tasks = (NB + 3) / 4;
  at::parallel_for(0, tasks, 4, [&](int64_t t0, int64_t t1) {
    int64_t configured_rows = -1;
    alignas(64) float cbuf[16 * 16];
    auto configure = [&](int64_t mc) {
      if (mc == configured_rows) return;
      const int64_t r0 = std::min<int64_t>(mc, 16), r1 = mc > 16 ? mc - 16 : 1;
      TileConfig cfg;
      cfg.rows[0] = r0; cfg.colsb[0] = 64;
      cfg.rows[1] = r1; cfg.colsb[1] = 64;
      for (int c = 2; c < 6; ++c) {
        cfg.rows[c] = (mc > 16 && c >= 4) ? r1 : r0;
        cfg.colsb[c] = 64;
      }
      cfg.rows[6] = cfg.rows[7] = 16; cfg.colsb[6] = cfg.colsb[7] = 64;
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
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = 0; n < kAmxN; ++n) {
          float v = cbuf[r * 16 + n];
          if (bp) v += static_cast<float>(bp[n0 + n]);
          op[(m0 + r) * N + n0 + n] = at::BFloat16(v);
        }
    };
    auto tile_at = [&](int64_t nb, int64_t kb) { return wp + (nb * KB + kb) * kAmxK * kAmxN; };
    for (int64_t t = t0; t < t1; ++t) {
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

// ------------------------------------------------------------------------------------------------------
// Paged decode attention
// ------------------------------------------------------------------------------------------------------
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = bf16_to_float(s[d]);
  } else {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  }
}

// One (sequence, kv head, key split): running max m, sum l and unnormalised output acc per query head.
template <typename T>
void attend_split(const T* q, int64_t G, int64_t D, const T* k_cache, const T* v_cache, const int32_t* blocks,
                  int64_t block_size, int64_t kv_heads, int64_t head, int64_t key_begin, int64_t key_end,
                  float scale, float* acc, float* m, float* l) {
  std::vector<float> qf(G * D), kf(D), vf(D), s(G * block_size);
  for (int64_t g = 0; g < G; ++g) {
    load_row(q + g * D, qf.data() + g * D, D);
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  std::fill(acc, acc + G * D, 0.f);
  const int64_t token_stride = kv_heads * D;
  for (int64_t start = key_begin; start < key_end;) {
    const int64_t blk = blocks[start / block_size];
    const int64_t off = start % block_size;
    const int64_t n = std::min(block_size - off, key_end - start);
    const T* kb = k_cache + (blk * block_size + off) * token_stride + head * D;
    const T* vb = v_cache + (blk * block_size + off) * token_stride + head * D;
    for (int64_t t = 0; t < n; ++t) {
      load_row(kb + t * token_stride, kf.data(), D);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf.data() + g * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kf[d];
        s[g * block_size + t] = dot;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s.data() + g * block_size;
      float block_max = m[g];
      for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sg[t]);
      const float rescale = std::exp(m[g] - block_max);  // exp(-inf) = 0 on the first block
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = std::exp(sg[t] - block_max);
        sum += sg[t];
      }
      l[g] = l[g] * rescale + sum;
      m[g] = block_max;
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] *= rescale;
    }
    for (int64_t t = 0; t < n; ++t) {
      load_row(vb + t * token_stride, vf.data(), D);
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g * block_size + t];
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
      }
    }
    start += n;
  }
}

#if defined(__AVX512F__)
// 16 floats from T (bf16 widens by a shift; fp32 loads as is).
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

// exp on 16 lanes: 2^n * e^r with |r| <= ln2/2 and a degree-6 polynomial (relative error ~1e-7).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// r[i] = sum of the lanes of v[i], for 16 vectors at once (~45 shuffles and adds instead of 16 full
// horizontal reductions): pairwise within 128-bit lanes, then across them.
inline __m512 hsum16(const __m512* v) {
  __m512 quads[4];
  for (int q = 0; q < 4; ++q) {
    const __m512* w = v + 4 * q;
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    // each 128-bit lane j: [w0_j, w1_j, w2_j, w3_j], partial sums over that lane
    quads[q] = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE));
  }
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

// The same contract as attend_split, vectorised for head_dim == 16 * C: keys a block (<= 16 tokens) at a
// time, scores of a block as one vector per query head, the output accumulated in registers/L1.
template <typename T, int C>
void attend_split_avx512(const T* q, int64_t G, const T* k_cache, const T* v_cache, const int32_t* blocks,
                         int64_t block_size, int64_t kv_heads, int64_t head, int64_t key_begin, int64_t key_end,
                         float scale, float* acc, float* m, float* l) {
  constexpr int64_t D = 16 * C;
  std::vector<__m512> qv(G * C), av(G * C);
  std::vector<__m512> dots(G * 16);
  std::vector<float> probs(G * 16);
  for (int64_t g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) {
      qv[g * C + c] = _mm512_mul_ps(load16(q + g * D + 16 * c), _mm512_set1_ps(scale));
      av[g * C + c] = _mm512_setzero_ps();
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  const int64_t token_stride = kv_heads * D;
  for (int64_t start = key_begin; start < key_end;) {
    const int64_t blk = blocks[start / block_size];
    const int64_t off = start % block_size;
    const int64_t n = std::min<int64_t>({block_size - off, key_end - start, 16});
    const T* kb = k_cache + (blk * block_size + off) * token_stride + head * D;
    const T* vb = v_cache + (blk * block_size + off) * token_stride + head * D;
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    // Each key row is widened once and dotted with every query head of the group.
    for (int64_t t = 0; t < n; ++t) {
      const T* kt = kb + t * token_stride;
      __m512 krow[C];
      for (int c = 0; c < C; ++c) krow[c] = load16(kt + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        const __m512* qg = qv.data() + g * C;
        __m512 dot = _mm512_mul_ps(qg[0], krow[0]);
        for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(qg[c], krow[c], dot);
        dots[g * 16 + t] = dot;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t t = n; t < 16; ++t) dots[g * 16 + t] = _mm512_setzero_ps();
      const __m512 s = _mm512_maskz_mov_ps(valid, hsum16(dots.data() + g * 16));
      const float block_max = std::max(m[g], _mm512_mask_reduce_max_ps(valid, s));
      const float rescale = std::exp(m[g] - block_max);  // exp(-inf) = 0 on the first block
      const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(block_max))));
      l[g] = l[g] * rescale + _mm512_reduce_add_ps(p);
      m[g] = block_max;
      _mm512_storeu_ps(probs.data() + g * 16, p);
      const __m512 rv = _mm512_set1_ps(rescale);
      for (int c = 0; c < C; ++c) av[g * C + c] = _mm512_mul_ps(av[g * C + c], rv);
    }
    for (int64_t t = 0; t < n; ++t) {
      const T* vt = vb + t * token_stride;
      __m512 vrow[C];
      for (int c = 0; c < C; ++c) vrow[c] = load16(vt + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 pg = _mm512_set1_ps(probs[g * 16 + t]);
        for (int c = 0; c < C; ++c) av[g * C + c] = _mm512_fmadd_ps(pg, vrow[c], av[g * C + c]);
      }
    }
    start += n;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, av[g * C + c]);
}
#endif

// Picks the vectorised path when the head size has one, the portable loop otherwise.
template <typename T>
void attend(const T* q, int64_t G, int64_t D, const T* k_cache, const T* v_cache, const int32_t* blocks,
            int64_t block_size, int64_t kv_heads, int64_t head, int64_t key_begin, int64_t key_end, float scale,
            float* acc, float* m, float* l) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, float>) {
    switch (D) {
      case 64:
        return attend_split_avx512<T, 4>(q, G, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin,
                                         key_end, scale, acc, m, l);
      case 128:
        return attend_split_avx512<T, 8>(q, G, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin,
                                         key_end, scale, acc, m, l);
      default:
        break;
    }
  }
#endif
  attend_split<T>(q, G, D, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin, key_end, scale, acc, m,
                  l);
}

template <typename T>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t split_size,
                       at::Tensor& out, at::Tensor& lse) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t block_size = k_cache.size(1);
  const int64_t max_blocks = block_table.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max<int64_t>(max_len, lens[b]);
  split_size = std::max<int64_t>(block_size, split_size / block_size * block_size);
  const int64_t S = std::max<int64_t>(1, (max_len + split_size - 1) / split_size);
  // Partials: [B, H, S, G, D] outputs and [B, H, S, G] running max / sum.
  std::vector<float> part_acc(B * H * S * G * D), part_m(B * H * S * G), part_l(B * H * S * G);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, B * H * S, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * S), h = (i / S) % H, split = i % S;
      const int64_t begin = split * split_size, end = std::min<int64_t>(lens[b], begin + split_size);
      float* acc = part_acc.data() + i * G * D;
      float* m = part_m.data() + i * G;
      float* l = part_l.data() + i * G;
      if (begin >= end) {
        std::fill(m, m + G, neg_inf);
        std::fill(l, l + G, 0.f);
        std::fill(acc, acc + G * D, 0.f);
        continue;
      }
      attend<T>(qp + (b * H + h) * G * D, G, D, kp, vp, table + b * max_blocks, block_size, H, h, begin, end,
                      fscale, acc, m, l);
    }
  });

  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t g = 0; g < G; ++g) {
        float gmax = neg_inf;
        for (int64_t s = 0; s < S; ++s) gmax = std::max(gmax, part_m[(i * S + s) * G + g]);
        float* o = op + (i * G + g) * D;
        std::fill(o, o + D, 0.f);
        if (gmax == neg_inf) {  // no keys at all: an empty suffix in cascade attention
          lp[i * G + g] = neg_inf;
          continue;
        }
        float total = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          const int64_t p = (i * S + s) * G + g;
          if (part_m[p] == neg_inf) continue;
          const float w = std::exp(part_m[p] - gmax);
          total += part_l[p] * w;
          const float* a = part_acc.data() + p * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        lp[i * G + g] = gmax + std::log(total);
      }
    }
  });
}

// q [B, H_kv, G, D]; caches [num_blocks, block_size, H_kv, D]; block_table int32 [B, max_blocks];
// seq_lens int32 [B]. Returns (out fp32 [B, H_kv, G, D], lse fp32 [B, H_kv, G]).
std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache, const at::Tensor& block_table,
                                                const at::Tensor& seq_lens, double scale, int64_t split_size) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "paged_decode: q must be a contiguous [B, H_kv, G, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: caches must be contiguous [num_blocks, block_size, H_kv, D]");
  TORCH_CHECK(k_cache.size(2) == q.size(1) && k_cache.size(3) == q.size(3), "paged_decode: head layout differs");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode: dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.dim() == 2,
              "paged_decode: block_table must be contiguous int32 [B, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.numel() == q.size(0), "paged_decode: bad seq_lens");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < q.size(0); ++b)
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= block_table.size(1) * k_cache.size(1),
                "paged_decode: a sequence is longer than its block table");
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  switch (q.scalar_type()) {
    case at::kBFloat16:
      paged_decode_impl<at::BFloat16>(q, k_cache, v_cache, block_table, seq_lens, scale, split_size, out, lse);
      break;
    case at::kFloat:
      paged_decode_impl<float>(q, k_cache, v_cache, block_table, seq_lens, scale, split_size, out, lse);
      break;
    case at::kHalf:
      paged_decode_impl<at::Half>(q, k_cache, v_cache, block_table, seq_lens, scale, split_size, out, lse);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return {out, lse};
}

// ------------------------------------------------------------------------------------------------------
// Element-wise decode glue, bf16: each is one pass instead of the 4-8 small torch ops it replaces (at one
// token per step those ops cost more in dispatch than in arithmetic). Rounding follows the Hugging Face
// reference: the norm in fp32, cast to bf16, then multiplied by the bf16 weight.
// ------------------------------------------------------------------------------------------------------
inline float round_bf16(float v) { return static_cast<float>(at::BFloat16(v)); }

// residual' = x + residual (bf16), normed = rms_norm(residual') * weight. residual may be undefined.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const c10::optional<at::Tensor>& residual_in,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "add_rms_norm: bf16 only");
  const int64_t H = x_in.size(-1);
  TORCH_CHECK(weight.numel() == H, "add_rms_norm: weight size differs");
  at::Tensor x = x_in.contiguous();
  const bool has_residual = residual_in.has_value() && residual_in->defined();
  at::Tensor summed = x;
  if (has_residual) {
    TORCH_CHECK(residual_in->sizes() == x_in.sizes(), "add_rms_norm: residual shape differs");
    summed = at::empty_like(x);
  }
  at::Tensor residual = has_residual ? residual_in->contiguous() : x;
  at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.numel() / H;
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* rp = residual.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* sp = summed.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(H);
    for (int64_t r = r0; r < r1; ++r) {
      int64_t i = 0;
      float sumsq = 0.f;
#if KVSERVE_HAS_AVX512_BF16
      __m512 sq = _mm512_setzero_ps();
      for (; i + 16 <= H; i += 16) {
        __m512 v = load16(xp + r * H + i);
        if (has_residual) {
          const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(v, load16(rp + r * H + i)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(sp + r * H + i), (__m256i)rounded);
          v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)rounded), 16));
        }
        _mm512_storeu_ps(row.data() + i, v);
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      sumsq = _mm512_reduce_add_ps(sq);
#endif
      for (; i < H; ++i) {
        float v = static_cast<float>(xp[r * H + i]);
        if (has_residual) {
          v = round_bf16(v + static_cast<float>(rp[r * H + i]));
          sp[r * H + i] = at::BFloat16(v);
        }
        row[i] = v;
        sumsq += v * v;
      }
      const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(H) + static_cast<float>(eps));
      i = 0;
#if KVSERVE_HAS_AVX512_BF16
      for (; i + 16 <= H; i += 16) {
        const __m256bh normed = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(row.data() + i), _mm512_set1_ps(inv)));
        const __m512 n = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)normed), 16));
        const __m256bh scaled = _mm512_cvtneps_pbh(_mm512_mul_ps(n, load16(wp + i)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + r * H + i), (__m256i)scaled);
      }
#endif
      for (; i < H; ++i)
        op[r * H + i] = at::BFloat16(round_bf16(row[i] * inv) * static_cast<float>(wp[i]));
    }
  });
  return {out, summed};
}

// silu(gate) * up for gate_up = [gate | up] along the last dim, bf16, as torch rounds it: silu to bf16,
// then the product to bf16.
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  TORCH_CHECK(gate_up_in.scalar_type() == at::kBFloat16, "silu_mul: bf16 only");
  at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t I = gate_up.size(-1) / 2;
  const int64_t rows = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  at::Tensor out = at::empty(sizes, gate_up.options());
  const at::BFloat16* gp = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const at::BFloat16* g_row = gp + r * 2 * I;
      const at::BFloat16* u_row = g_row + I;
      at::BFloat16* o_row = op + r * I;
      int64_t i = 0;
#if KVSERVE_HAS_AVX512_BF16
      // silu(g) = g / (1 + exp(-g)); each product rounded to bf16 (round-to-nearest-even) like torch.
      for (; i + 16 <= I; i += 16) {
        const __m512 g = load16(g_row + i);
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(
                                                              _mm512_setzero_ps(), g))));
        const __m512 silu_rounded = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(silu)), 16));
        const __m256bh prod = _mm512_cvtneps_pbh(_mm512_mul_ps(silu_rounded, load16(u_row + i)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o_row + i), (__m256i)prod);
      }
#endif
      for (; i < I; ++i) {
        const float g = static_cast<float>(g_row[i]);
        const float silu = round_bf16(g / (1.f + std::exp(-g)));
        o_row[i] = at::BFloat16(silu * static_cast<float>(u_row[i]));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvserve, m) {
  m.def("gemv_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor", &gemv_bf16);
  m.def("has_avx512_bf16() -> bool", &has_avx512_bf16);
  m.def("has_amx() -> bool", &has_amx);
  m.def("amx_pack(Tensor w) -> Tensor", &amx_pack);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &amx_linear);
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, float scale, "
        "int split_size) -> (Tensor, Tensor)",
        &paged_decode);
}
