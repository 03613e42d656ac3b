// Paged decode attention: one query token per sequence against its KV blocks, read in place from the
// paged cache (no gather copy), split along the keys so few long sequences still use every core.
// Returns fp32 output and the log-sum-exp, so partial results (cascade attention over a shared prefix)
// merge exactly.

#include "common.h"

namespace kvserve {
namespace {

// How decode attention shares out its work. On AVX-512 without AMX a work item is one KV head's share of
// a key split, and it fetches its own head's rows of the next block into L2 as it computes, so that every
// item's reads overlap its own arithmetic (Zen 4: 1.3-1.5x the layout below, the same outputs bit for bit).
// Elsewhere an item is a key split for every KV head: its first head fetches whole blocks for all of them
// into L1 and the others compute from cache, the memory idle meanwhile (on Sapphire Rapids that layout was
// measured 1.6-1.7x the per-head items of its time, which fetched nothing; AVX2 keeps it, unmeasured).
#if defined(__AVX512F__) && !KVSERVE_HAS_AMX
constexpr bool kItemPerKvHead = true;
#else
constexpr bool kItemPerKvHead = false;
#endif

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

// The same contract as attend_split for G query heads (G known at compile time), vectorised for head_dim
// == 16 * C: keys a block (<= 16 tokens) at a time, scores of a block as one vector per query head. With G
// fixed, the loops over heads unroll and the G * C output accumulators live in registers; sized at run
// time, they lived in memory, and every multiply-add of the value pass went through a load and a store.
// `prefetch`: this call fetches the next block's rows (kItemPerKvHead says whose; the first run of query
// heads does).
template <typename T, int C, int G>
void attend_split_avx512(const T* q, const T* k_cache, const T* v_cache, const int32_t* blocks,
                         int64_t block_size, int64_t kv_heads, int64_t head, int64_t key_begin, int64_t key_end,
                         float scale, float* acc, float* m, float* l, bool prefetch) {
  constexpr int64_t D = 16 * C;
  __m512 qv[G * C], av[G * C];
  alignas(64) __m512 dots[G * 16];
  alignas(64) float probs[G * 16];
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
    if (prefetch && start + n < key_end) {
      // Issued a block ahead, the misses overlap this block's arithmetic.
      const int64_t next = start + n;
      const int64_t next_blk = blocks[next / block_size], next_off = next % block_size;
      const int64_t rows = std::min<int64_t>({block_size - next_off, key_end - next, 16});
      const int64_t first = (next_blk * block_size + next_off) * token_stride;
      const char* kn = reinterpret_cast<const char*>(k_cache + first);
      const char* vn = reinterpret_cast<const char*>(v_cache + first);
      if constexpr (kItemPerKvHead) {  // this head's rows, into L2
        const int64_t row_bytes = token_stride * static_cast<int64_t>(sizeof(T));
        const int64_t head_bytes = D * static_cast<int64_t>(sizeof(T));
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t o = head * head_bytes; o < (head + 1) * head_bytes; o += 64) {
            _mm_prefetch(kn + r * row_bytes + o, _MM_HINT_T1);
            _mm_prefetch(vn + r * row_bytes + o, _MM_HINT_T1);
          }
      } else {  // every head's rows (the later heads find them in cache)
        const int64_t bytes = rows * token_stride * static_cast<int64_t>(sizeof(T));
        for (int64_t o = 0; o < bytes; o += 64) {
          _mm_prefetch(kn + o, _MM_HINT_T0);
          _mm_prefetch(vn + o, _MM_HINT_T0);
        }
      }
    }
    // Each key row is widened once and dotted with every query head of the group.
    for (int64_t t = 0; t < n; ++t) {
      const T* kt = kb + t * token_stride;
      __m512 krow[C];
      for (int c = 0; c < C; ++c) krow[c] = load16(kt + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        const __m512* qg = qv + g * C;
        __m512 dot = _mm512_mul_ps(qg[0], krow[0]);
        for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(qg[c], krow[c], dot);
        dots[g * 16 + t] = dot;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t t = n; t < 16; ++t) dots[g * 16 + t] = _mm512_setzero_ps();
      const __m512 s = _mm512_maskz_mov_ps(valid, hsum16(dots + g * 16));
      const float block_max = std::max(m[g], _mm512_mask_reduce_max_ps(valid, s));
      const float rescale = std::exp(m[g] - block_max);  // exp(-inf) = 0 on the first block
      const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(block_max))));
      l[g] = l[g] * rescale + _mm512_reduce_add_ps(p);
      m[g] = block_max;
      _mm512_storeu_ps(probs + g * 16, p);
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

// The query heads of a KV head in runs of at most four through attend_split_avx512 (a later run finds the
// keys in cache); four heads' accumulators and a key row fit the 32 vector registers at head_dim 64. At
// head_dim 256 a single head's accumulators take 16 of them: runs of one.
template <typename T, int C>
void attend_groups_avx512(const T* q, int64_t G, const T* k_cache, const T* v_cache, const int32_t* blocks,
                          int64_t block_size, int64_t kv_heads, int64_t head, int64_t key_begin, int64_t key_end,
                          float scale, float* acc, float* m, float* l) {
  constexpr int64_t D = 16 * C;
  constexpr int64_t kRun = C >= 16 ? 1 : 4;
  for (int64_t g0 = 0; g0 < G; g0 += kRun) {
    const bool prefetch = (kItemPerKvHead || head == 0) && g0 == 0;
    const T* qg = q + g0 * D;
    float *ag = acc + g0 * D, *mg = m + g0, *lg = l + g0;
    switch (std::min<int64_t>(kRun, G - g0)) {
      case 1:
        attend_split_avx512<T, C, 1>(qg, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin, key_end,
                                     scale, ag, mg, lg, prefetch);
        break;
      case 2:
        attend_split_avx512<T, C, 2>(qg, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin, key_end,
                                     scale, ag, mg, lg, prefetch);
        break;
      case 3:
        attend_split_avx512<T, C, 3>(qg, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin, key_end,
                                     scale, ag, mg, lg, prefetch);
        break;
      default:
        attend_split_avx512<T, C, 4>(qg, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin, key_end,
                                     scale, ag, mg, lg, prefetch);
        break;
    }
  }
}
#endif

#if KVSERVE_HAS_AVX2 && !defined(__AVX512F__)
// r[i] = sum of the lanes of v[i], for 8 vectors at once: pairwise adds within 128-bit lanes, then the
// lanes' halves added.
inline __m256 hsum8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hadd8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// attend_split's contract for G query heads (G known at compile time) on AVX2, for head_dim == 8 * C:
// keys 8 tokens at a time, a block's scores as one vector per query head. With 16 vector registers the
// query and the output stay in memory (L1) and each pass keeps only what it multiplies in registers: the
// score pass a key chunk and G dot products, the value pass one 8-wide column chunk of the G outputs.
// `prefetch`: this call fetches the next keys' rows for every KV head (the first head's call does).
template <typename T, int C, int G>
void attend_split_avx2(const T* q, const T* k_cache, const T* v_cache, const int32_t* blocks, int64_t block_size,
                       int64_t kv_heads, int64_t head, int64_t key_begin, int64_t key_end, float scale, float* acc,
                       float* m, float* l, bool prefetch) {
  constexpr int64_t D = 8 * C;
  alignas(32) float qs[G * D];
  alignas(32) __m256 dots[G][8];
  alignas(32) float probs[G][8];
  float rescale[G];
  for (int64_t g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) {
      _mm256_store_ps(qs + g * D + 8 * c, _mm256_mul_ps(load8(q + g * D + 8 * c), _mm256_set1_ps(scale)));
      _mm256_storeu_ps(acc + g * D + 8 * c, _mm256_setzero_ps());
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t token_stride = kv_heads * D;
  for (int64_t start = key_begin; start < key_end;) {
    const int64_t blk = blocks[start / block_size];
    const int64_t off = start % block_size;
    const int64_t n = std::min<int64_t>({block_size - off, key_end - start, 8});
    const T* kb = k_cache + (blk * block_size + off) * token_stride + head * D;
    const T* vb = v_cache + (blk * block_size + off) * token_stride + head * D;
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
    if (prefetch && start + n < key_end) {
      const int64_t next = start + n;
      const int64_t next_blk = blocks[next / block_size], next_off = next % block_size;
      const int64_t rows = std::min<int64_t>({block_size - next_off, key_end - next, 8});
      const char* kn = reinterpret_cast<const char*>(k_cache + (next_blk * block_size + next_off) * token_stride);
      const char* vn = reinterpret_cast<const char*>(v_cache + (next_blk * block_size + next_off) * token_stride);
      const int64_t bytes = rows * token_stride * static_cast<int64_t>(sizeof(T));
      for (int64_t o = 0; o < bytes; o += 64) {
        _mm_prefetch(kn + o, _MM_HINT_T0);
        _mm_prefetch(vn + o, _MM_HINT_T0);
      }
    }
    // Scores: each key chunk is widened once and dotted with every query head of the run.
    for (int64_t t = 0; t < 8; ++t) {
      __m256 dot[G];
      for (int g = 0; g < G; ++g) dot[g] = _mm256_setzero_ps();
      if (t < n) {
        const T* kt = kb + t * token_stride;
        for (int c = 0; c < C; ++c) {
          const __m256 kv = load8(kt + 8 * c);
          for (int g = 0; g < G; ++g) dot[g] = _mm256_fmadd_ps(_mm256_load_ps(qs + g * D + 8 * c), kv, dot[g]);
        }
      }
      for (int g = 0; g < G; ++g) dots[g][t] = dot[g];
    }
    for (int g = 0; g < G; ++g) {
      const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), hsum8(dots[g]),
                                        valid);
      const float block_max = std::max(m[g], hmax8(s));
      rescale[g] = std::exp(m[g] - block_max);  // exp(-inf) = 0 on the first block
      const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(s, _mm256_set1_ps(block_max))), valid);
      l[g] = l[g] * rescale[g] + hadd8(p);
      m[g] = block_max;
      _mm256_store_ps(probs[g], p);
    }
    // Values: one column chunk of the run's outputs at a time, in registers across the block's tokens.
    for (int c = 0; c < C; ++c) {
      __m256 out[G];
      for (int g = 0; g < G; ++g)
        out[g] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + 8 * c), _mm256_set1_ps(rescale[g]));
      for (int64_t t = 0; t < n; ++t) {
        const __m256 vv = load8(vb + t * token_stride + 8 * c);
        for (int g = 0; g < G; ++g) out[g] = _mm256_fmadd_ps(_mm256_set1_ps(probs[g][t]), vv, out[g]);
      }
      for (int g = 0; g < G; ++g) _mm256_storeu_ps(acc + g * D + 8 * c, out[g]);
    }
    start += n;
  }
}

// The query heads of a KV head in runs of at most four through attend_split_avx2 (a later run finds the keys
// in cache).
template <typename T, int C>
void attend_groups_avx2(const T* q, int64_t G, const T* k_cache, const T* v_cache, const int32_t* blocks,
                        int64_t block_size, int64_t kv_heads, int64_t head, int64_t key_begin, int64_t key_end,
                        float scale, float* acc, float* m, float* l) {
  constexpr int64_t D = 8 * C;
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const bool prefetch = head == 0 && g0 == 0;
    const T* qg = q + g0 * D;
    float *ag = acc + g0 * D, *mg = m + g0, *lg = l + g0;
    switch (std::min<int64_t>(4, G - g0)) {
      case 1:
        attend_split_avx2<T, C, 1>(qg, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin, key_end,
                                   scale, ag, mg, lg, prefetch);
        break;
      case 2:
        attend_split_avx2<T, C, 2>(qg, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin, key_end,
                                   scale, ag, mg, lg, prefetch);
        break;
      case 3:
        attend_split_avx2<T, C, 3>(qg, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin, key_end,
                                   scale, ag, mg, lg, prefetch);
        break;
      default:
        attend_split_avx2<T, C, 4>(qg, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin, key_end,
                                   scale, ag, mg, lg, prefetch);
        break;
    }
  }
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
        return attend_groups_avx512<T, 4>(q, G, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin,
                                         key_end, scale, acc, m, l);
      case 128:
        return attend_groups_avx512<T, 8>(q, G, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin,
                                         key_end, scale, acc, m, l);
      case 256:
        return attend_groups_avx512<T, 16>(q, G, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin,
                                          key_end, scale, acc, m, l);
      default:
        break;
    }
  }
#elif KVSERVE_HAS_AVX2
  if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, float>) {
    switch (D) {
      case 64:
        return attend_groups_avx2<T, 8>(q, G, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin,
                                        key_end, scale, acc, m, l);
      case 128:
        return attend_groups_avx2<T, 16>(q, G, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin,
                                         key_end, scale, acc, m, l);
      case 256:
        return attend_groups_avx2<T, 32>(q, G, k_cache, v_cache, blocks, block_size, kv_heads, head, key_begin,
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
  split_size = std::max<int64_t>(block_size, split_size / block_size * block_size);
  // A work item is a key split of a sequence, for one KV head or for all (kItemPerKvHead). A sequence's
  // splits are shortened until it has one for each thread, or they are one block long. They depend on its
  // own length only, never on the batch, so that its attention is the same whatever runs beside it (a
  // request's drafts verified beside it, other requests): the splits' partial results merge in a fixed order.
  auto splits = [](int64_t len, int64_t size) { return std::max<int64_t>(1, (len + size - 1) / size); };
  std::vector<int64_t> sizes(B), num_splits(B), first_item(B + 1, 0);
  int64_t S = 1;
  for (int64_t b = 0; b < B; ++b) {
    int64_t size = split_size;
    while (size > block_size && splits(lens[b], size) < kernel_threads())
      size = std::max<int64_t>(block_size, size / 2 / block_size * block_size);
    sizes[b] = size;
    num_splits[b] = splits(lens[b], size);
    S = std::max(S, num_splits[b]);
    first_item[b + 1] = first_item[b] + (kItemPerKvHead ? H : 1) * num_splits[b];
  }
  // Partials: [B, H, S, G, D] outputs and [B, H, S, G] running max / sum.
  std::vector<float> part_acc(B * H * S * G * D), part_m(B * H * S * G), part_l(B * H * S * G);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // A sequence's unused partial slots (fewer splits than S) are empty: the merge skips them.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t split = num_splits[b]; split < S; ++split) {
        const int64_t i = (b * H + h) * S + split;
        std::fill(part_m.data() + i * G, part_m.data() + (i + 1) * G, neg_inf);
        std::fill(part_l.data() + i * G, part_l.data() + (i + 1) * G, 0.f);
      }
  parallel_claim(first_item[B], [&](auto&& claim) {
    for (int64_t item; (item = claim()) >= 0;) {
      const int64_t b = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      // A split's heads are neighbours in the claim order: their rows share the blocks' memory pages.
      const int64_t items_per_split = kItemPerKvHead ? H : 1;
      const int64_t split = (item - first_item[b]) / items_per_split;
      const int64_t first_head = kItemPerKvHead ? (item - first_item[b]) % H : 0;
      const int64_t begin = split * sizes[b], end = std::min<int64_t>(lens[b], begin + sizes[b]);
      for (int64_t h = first_head; h < (kItemPerKvHead ? first_head + 1 : H); ++h) {
        const int64_t i = (b * H + h) * S + split;
        float* acc = part_acc.data() + i * G * D;
        float* m = part_m.data() + i * G;
        float* l = part_l.data() + i * G;
        if (begin >= end) {  // an empty sequence
          std::fill(m, m + G, neg_inf);
          std::fill(l, l + G, 0.f);
          std::fill(acc, acc + G * D, 0.f);
          continue;
        }
        attend<T>(qp + (b * H + h) * G * D, G, D, kp, vp, table + b * max_blocks, block_size, H, h, begin, end,
                  fscale, acc, m, l);
      }
    }
  });

  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  // A few microseconds of work per hundred (sequence, head) pairs: a decode batch combines on this thread.
  parallel_range(0, B * H, kSerialWork, [&](int64_t i0, int64_t i1) {
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

}  // namespace

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

// Attention over keys A ∪ B from its halves over A and over B: out_x fp32 [..., D], lse_x fp32 [...] (the
// log-sum-exp of the scaled scores; -inf for a half with no keys). Each half is weighted by its share of
// the softmax mass, exp(lse_x - lse_total), in one pass instead of the five torch ops it replaces.
at::Tensor merge_attention(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                           const at::Tensor& lse_b, bool bf16_out) {
  TORCH_CHECK(out_a.scalar_type() == at::kFloat && out_b.scalar_type() == at::kFloat &&
                  lse_a.scalar_type() == at::kFloat && lse_b.scalar_type() == at::kFloat,
              "merge_attention: fp32 inputs");
  TORCH_CHECK(out_a.sizes() == out_b.sizes() && lse_a.sizes() == lse_b.sizes() && out_a.dim() == lse_a.dim() + 1 &&
                  out_a.sizes().slice(0, lse_a.dim()) == lse_a.sizes(),
              "merge_attention: shapes differ");
  const at::Tensor a = out_a.contiguous(), b = out_b.contiguous(), la = lse_a.contiguous(), lb = lse_b.contiguous();
  const int64_t rows = la.numel(), D = a.size(-1);
  at::Tensor out = at::empty(a.sizes(), a.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  const float *lap = la.data_ptr<float>(), *lbp = lb.data_ptr<float>();
  at::BFloat16* out_bf16 = bf16_out ? out.data_ptr<at::BFloat16>() : nullptr;
  float* out_f32 = bf16_out ? nullptr : out.data_ptr<float>();
  // A decode batch's rows (a few hundred) merge in one claim, on this thread: cheaper than waking another.
  const int64_t rows_per_claim = rows <= kSerialWork ? std::max<int64_t>(rows, 1) : 64;
  parallel_claim((rows + rows_per_claim - 1) / rows_per_claim, [&](auto&& claim) {
    for (int64_t c; (c = claim()) >= 0;) {
      for (int64_t r = c * rows_per_claim; r < std::min(rows, (c + 1) * rows_per_claim); ++r) {
        const float m = std::max(lap[r], lbp[r]);
        float wa = 0.f, wb = 0.f;
        if (m != -std::numeric_limits<float>::infinity()) {  // both halves empty: the output is 0
          const float ea = std::exp(lap[r] - m), eb = std::exp(lbp[r] - m);
          wa = ea / (ea + eb);
          wb = eb / (ea + eb);
        }
        for (int64_t d = 0; d < D; ++d) {
          const float v = wa * ap[r * D + d] + wb * bp[r * D + d];
          if (out_bf16)
            out_bf16[r * D + d] = at::BFloat16(v);
          else
            out_f32[r * D + d] = v;
        }
      }
    }
  });
  return out;
}

}  // namespace kvserve
