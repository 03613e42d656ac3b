// Paged attention for many query rows at once on plain AVX-512 (no AMX): prefill chunks over their cached
// history, and the shared-prefix half of cascade decode. The same contract as paged_attention_amx
// (flash_attention.cpp) without its packed-key arguments, for CPUs the AMX kernel cannot run on.
//
// K/V are read from the paged cache in place. A work item is (span, KV head, up to kItemRows query rows);
// the query rows of a KV head are its (token, group head) pairs, so grouped-query attention reads each key
// once for the whole group. Keys go by 32 at a time: the item lays them out once (K transposed, so a row's
// 32 scores are two vectors over the head dimension), then every group of six rows takes an online-softmax
// step: scores, running max, weights exp2(s - max) in fp32, weights . V into the rows' accumulators.
// Scores: with AVX512-BF16, K stays bf16 in pairs of dimensions and one VDPBF16PS takes two dimensions of
// 16 keys against a row's broadcast pair of q (scaled afterwards); without it, K is widened to fp32 and
// meets the pre-scaled fp32 q in FMAs. Either way products of bf16 values are exact and sums fp32. The
// weights . V products stay fp32 FMAs: the weights are not bf16 values, and splitting them into two bf16
// halves would cost the dot-product instruction what it saves. Everything after the bf16 inputs stays fp32. Templated on the head size (64, 128, 256): the
// weights . V step goes over the head 64 dims at a time, so its accumulators fit the registers at any size.

#include "common.h"

namespace kvserve {

#if KVSERVE_HAS_AVX512

namespace {

constexpr int64_t kKeys = 32;      // keys per step: two vectors of scores per row
constexpr int kRowGroup = 6;       // rows whose scores (12 vectors) or outputs (24) sit in registers together
constexpr int64_t kItemRows = 48;  // most rows sharing one widening of the keys
// Scores on VDPBF16PS where the build has it (q and K as bf16 pairs of dimensions).
constexpr bool kDotScores = KVSERVE_HAS_AVX512_BF16;

struct Inputs {
  const at::BFloat16* q;
  int64_t q_stride;  // between tokens
  const at::BFloat16* k;
  const at::BFloat16* v;
  int64_t block_size, kv_heads, group, num_heads;
  float scale_log2;  // softmax scale times log2(e): the weights are exp2 of scaled scores
  bool causal;
};

// Per thread: the item's query rows, accumulators and softmax state, and one step's keys (head size D).
template <int64_t D>
struct alignas(64) Scratch {
  float q[kItemRows * D];         // fp32 scores: q scaled by scale * log2(e)
  uint32_t q_pairs[kItemRows * D / 2];  // dot-product scores: q's bf16 pairs of dimensions, unscaled
  float acc[kItemRows * D];
  float kt[2][D * 16];  // fp32 scores: kt[half][d * 16 + j] = K[key 16 * half + j][d]
  uint32_t kt_pairs[2][D / 2 * 16];  // dot-product scores: [half][p * 16 + j] = K[key 16 half + j][2p, 2p + 1]
  float v[kKeys * D];
  float weights[kRowGroup][kKeys];
  float m[kItemRows], l[kItemRows];
  int64_t last_key[kItemRows];  // causal: the last key each row sees
};

// Keys [start, start + n) of head h: K transposed into s.kt (widened) or s.kt_pairs (bf16 pairs), V widened
// row-major into s.v; keys past n zero.
template <int64_t D>
inline void load_keys(const Inputs& in, const RunSpan& span, int64_t h, int64_t start, int64_t n, Scratch<D>& s) {
  alignas(64) __m512i rows[16];
  const int64_t token_stride = in.kv_heads * D;
  int64_t at[kKeys];  // each key's offset in the caches (-1: past n)
  for (int64_t key = 0; key < kKeys; ++key) {
    const int64_t pos = start + key;
    at[key] = key < n ? (static_cast<int64_t>(span.blocks[pos / in.block_size]) * in.block_size +
                         pos % in.block_size) * token_stride + h * D
                      : -1;
  }
  for (int64_t key = 0; key < kKeys; ++key)
    for (int64_t c = 0; c < D / 16; ++c)
      _mm512_store_ps(s.v + key * D + 16 * c, at[key] >= 0 ? load16(in.v + at[key] + 16 * c) : _mm512_setzero_ps());
  for (int64_t half = 0; half < 2; ++half) {
    if constexpr (kDotScores) {
      for (int64_t c = 0; c < D / 32; ++c) {  // 32 dimensions: 16 pairs of each of the 16 keys
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t a = at[16 * half + j];
          rows[j] = a >= 0 ? _mm512_loadu_si512(in.k + a + 32 * c) : _mm512_setzero_si512();
        }
        transpose16_epi32(rows, s.kt_pairs[half] + 16 * c * 16);
      }
    } else {
      for (int64_t c = 0; c < D / 16; ++c) {
        for (int64_t j = 0; j < 16; ++j) {
          const int64_t a = at[16 * half + j];
          rows[j] = a >= 0 ? _mm512_castps_si512(load16(in.k + a + 16 * c)) : _mm512_setzero_si512();
        }
        transpose16_epi32(rows, reinterpret_cast<uint32_t*>(s.kt[half] + 16 * c * 16));
      }
    }
  }
}

// Rows [r, r + R)'s scores against the 32 keys in scratch (lo: keys 0-15, hi: 16-31), scaled by
// scale * log2(e).
template <int64_t D, int R>
inline void scores(const Scratch<D>& s, int64_t r, float scale_log2, __m512 (&lo)[R], __m512 (&hi)[R]) {
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
#if KVSERVE_HAS_AVX512_BF16
  if constexpr (kDotScores) {
    for (int64_t p = 0; p < D / 2; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_load_si512(s.kt_pairs[0] + p * 16);
      const __m512bh k1 = (__m512bh)_mm512_load_si512(s.kt_pairs[1] + p * 16);
      for (int i = 0; i < R; ++i) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(s.q_pairs[(r + i) * D / 2 + p]));
        lo[i] = _mm512_dpbf16_ps(lo[i], qp, k0);
        hi[i] = _mm512_dpbf16_ps(hi[i], qp, k1);
      }
    }
    const __m512 scale = _mm512_set1_ps(scale_log2);
    for (int i = 0; i < R; ++i) {
      lo[i] = _mm512_mul_ps(lo[i], scale);
      hi[i] = _mm512_mul_ps(hi[i], scale);
    }
    return;
  }
#endif
  (void)scale_log2;  // q is scaled already
  for (int64_t d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_load_ps(s.kt[0] + d * 16), k1 = _mm512_load_ps(s.kt[1] + d * 16);
    for (int i = 0; i < R; ++i) {
      const __m512 qd = _mm512_set1_ps(s.q[(r + i) * D + d]);
      lo[i] = _mm512_fmadd_ps(qd, k0, lo[i]);
      hi[i] = _mm512_fmadd_ps(qd, k1, hi[i]);
    }
  }
}

// One online-softmax step for rows [r, r + R) of the item against the keys in scratch.
template <int64_t D, int R>
inline void step_rows(Scratch<D>& s, int64_t r, int64_t start, int64_t n, float scale_log2) {
  __m512 lo[R], hi[R];  // scores of keys 0-15 and 16-31
  scores<D, R>(s, r, scale_log2, lo, hi);
  const __m512i index_lo = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(start)),
                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i index_hi = _mm512_add_epi32(index_lo, _mm512_set1_epi32(16));
  __m512 alpha[R];
  for (int i = 0; i < R; ++i) {
    const __m512i last = _mm512_set1_epi32(static_cast<int>(std::min(s.last_key[r + i], start + n - 1)));
    const __mmask16 see_lo = _mm512_cmple_epi32_mask(index_lo, last), see_hi = _mm512_cmple_epi32_mask(index_hi, last);
    if ((see_lo | see_hi) == 0) {  // this row sees none of these keys (causal): nothing changes
      alpha[i] = _mm512_set1_ps(1.f);
      _mm512_store_ps(s.weights[i], _mm512_setzero_ps());
      _mm512_store_ps(s.weights[i] + 16, _mm512_setzero_ps());
      continue;
    }
    const float old_max = s.m[r + i];
    const float new_max = std::max({old_max, _mm512_mask_reduce_max_ps(see_lo, lo[i]),
                                    _mm512_mask_reduce_max_ps(see_hi, hi[i])});
    const __m512 top = _mm512_set1_ps(new_max);
    const __m512 p_lo = _mm512_maskz_mov_ps(see_lo, exp2_512(_mm512_sub_ps(lo[i], top)));
    const __m512 p_hi = _mm512_maskz_mov_ps(see_hi, exp2_512(_mm512_sub_ps(hi[i], top)));
    const float a = old_max == -std::numeric_limits<float>::infinity() ? 0.f : std::exp2(old_max - new_max);
    s.l[r + i] = s.l[r + i] * a + _mm512_reduce_add_ps(_mm512_add_ps(p_lo, p_hi));
    s.m[r + i] = new_max;
    alpha[i] = _mm512_set1_ps(a);
    _mm512_store_ps(s.weights[i], p_lo);
    _mm512_store_ps(s.weights[i] + 16, p_hi);
  }
  // 64 dims at a time: R rows' four accumulators each and a value row's four vectors stay in registers.
  constexpr int64_t kChunk = 4;
  for (int64_t c0 = 0; c0 < D / 16; c0 += kChunk) {
    __m512 acc[R][kChunk];
    for (int i = 0; i < R; ++i)
      for (int64_t c = 0; c < kChunk; ++c)
        acc[i][c] = _mm512_mul_ps(_mm512_load_ps(s.acc + (r + i) * D + 16 * (c0 + c)), alpha[i]);
    for (int64_t j = 0; j < n; ++j) {
      __m512 vj[kChunk];
      for (int64_t c = 0; c < kChunk; ++c) vj[c] = _mm512_load_ps(s.v + j * D + 16 * (c0 + c));
      for (int i = 0; i < R; ++i) {
        const __m512 w = _mm512_set1_ps(s.weights[i][j]);
        for (int64_t c = 0; c < kChunk; ++c) acc[i][c] = _mm512_fmadd_ps(w, vj[c], acc[i][c]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int64_t c = 0; c < kChunk; ++c) _mm512_store_ps(s.acc + (r + i) * D + 16 * (c0 + c), acc[i][c]);
  }
}

template <int64_t D, int R = kRowGroup>
inline void step_tail(Scratch<D>& s, int64_t r, int64_t rows, int64_t start, int64_t n, float scale_log2) {
  if constexpr (R > 1) {
    if (rows < R) return step_tail<D, R - 1>(s, r, rows, start, n, scale_log2);
  }
  step_rows<D, R>(s, r, start, n, scale_log2);
}

template <int64_t D, typename Out>
void run_item(const Inputs& in, const RunSpan& span, int64_t h, int64_t first_row, int64_t num_rows, Out* out,
              float* lse, Scratch<D>& s) {
  const float log2_scale = in.scale_log2;
  int64_t key_end = 0;
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t row = first_row + i, token = row / in.group, head = h * in.group + row % in.group;
    const at::BFloat16* qr = in.q + (span.q_start + token) * in.q_stride + head * D;
    if constexpr (kDotScores)
      std::memcpy(s.q_pairs + i * D / 2, qr, D * sizeof(at::BFloat16));
    for (int64_t c = 0; c < D / 16; ++c) {
      if constexpr (!kDotScores)
        _mm512_store_ps(s.q + i * D + 16 * c, _mm512_mul_ps(load16(qr + 16 * c), _mm512_set1_ps(log2_scale)));
      _mm512_store_ps(s.acc + i * D + 16 * c, _mm512_setzero_ps());
    }
    s.m[i] = -std::numeric_limits<float>::infinity();
    s.l[i] = 0.f;
    s.last_key[i] = in.causal ? span.kv_len - span.q_len + token : span.kv_len - 1;
    key_end = std::max(key_end, s.last_key[i] + 1);
  }
  for (int64_t start = 0; start < key_end; start += kKeys) {
    const int64_t n = std::min(kKeys, key_end - start);
    load_keys(in, span, h, start, n, s);
    for (int64_t i = 0; i < num_rows; i += kRowGroup)
      step_tail(s, i, std::min<int64_t>(kRowGroup, num_rows - i), start, n, log2_scale);
  }
  constexpr float kLn2 = 0.693147180559945f;
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t row = first_row + i, token = span.q_start + row / in.group, head = h * in.group + row % in.group;
    const __m512 inv = _mm512_set1_ps(1.f / s.l[i]);
    Out* o = out + (token * in.num_heads + head) * D;
    for (int64_t c = 0; c < D / 16; ++c) {
      const __m512 value = _mm512_mul_ps(_mm512_load_ps(s.acc + i * D + 16 * c), inv);
      if constexpr (std::is_same_v<Out, float>)
        _mm512_storeu_ps(o + 16 * c, value);
      else
        store16_bf16(o + 16 * c, value);
    }
    lse[token * in.num_heads + head] = (s.m[i] + std::log2(s.l[i])) * kLn2;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> paged_attention_avx512(const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                          const at::Tensor& kv_lens, const at::Tensor& q_starts,
                                                          double scale, bool causal, bool fp32_out) {
  const PagedRunsShape shape =
      check_paged_runs("paged_attention_avx512", q, k_cache, v_cache, block_tables, kv_lens, q_starts, causal);
  const int64_t num_heads = shape.num_heads;
  const RowItems work = split_row_items(shape, block_tables, kv_lens, q_starts, kRowGroup, kItemRows);
  at::Tensor out = at::empty({q.size(0), num_heads, shape.head_dim}, q.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  at::Tensor lse = at::empty({q.size(0), num_heads}, q.options().dtype(at::kFloat));
  const Inputs in{q.data_ptr<at::BFloat16>(), q.stride(0), k_cache.data_ptr<at::BFloat16>(),
                  v_cache.data_ptr<at::BFloat16>(), shape.block_size, shape.kv_heads, shape.group, num_heads,
                  static_cast<float>(scale) * 1.44269504088896341f, causal};
  float* lp = lse.data_ptr<float>();
  with_head_size(shape.head_dim, [&](auto head_size) {
    constexpr int64_t D = decltype(head_size)::value;
    parallel_claim(static_cast<int64_t>(work.items.size()), [&](auto&& claim) {
      auto scratch = std::make_unique<Scratch<D>>();
      for (int64_t i; (i = claim()) >= 0;) {
        const RowItem& item = work.items[i];
        if (fp32_out)
          run_item<D>(in, work.spans[item.span], item.head, item.first_row, item.num_rows, out.data_ptr<float>(), lp,
                      *scratch);
        else
          run_item<D>(in, work.spans[item.span], item.head, item.first_row, item.num_rows, out.data_ptr<at::BFloat16>(),
                      lp, *scratch);
      }
    });
  });
  return {out, lse};
}

#else

std::tuple<at::Tensor, at::Tensor> paged_attention_avx512(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                          const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                          double, bool, bool) {
  TORCH_CHECK(false, "paged_attention_avx512: this build has no AVX-512");
}

#endif

}  // namespace kvserve
