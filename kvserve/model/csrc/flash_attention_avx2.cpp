// Paged attention for many query rows at once on AVX2 and FMA: prefill chunks over their cached history, and
// the shared-prefix half of cascade decode. The contract of paged_attention_avx512 (flash_attention_avx512.cpp)
// at half its width, for CPUs without AVX-512.
//
// K/V are read from the paged cache in place. A work item is (span, KV head, up to kItemRows query rows); the
// query rows of a KV head are its (token, group head) pairs, so grouped-query attention reads each key once
// for the whole group. Keys go by 16 at a time: the item widens them to fp32 once (K transposed by 8x8 blocks,
// so a row's 16 scores are two vectors over the head dimension), then every group of six rows takes an
// online-softmax step: scores against the pre-scaled q in FMAs, running max, weights exp(s - max), weights . V
// into the rows' accumulators. Products of bf16 values are exact and sums fp32; everything after the bf16
// inputs stays fp32. Templated on the head size (64, 128, 256): the weights . V step goes over the head 16
// dims at a time, so six rows' accumulators and a value row fit the sixteen registers at any size.

#include "common.h"

namespace kvserve {

#if KVSERVE_HAS_AVX2

namespace {

constexpr int64_t kKeys = 16;      // keys per step: two vectors of scores per row
constexpr int kRowGroup = 6;       // rows whose scores (12 vectors) or outputs (12) sit in registers together
constexpr int64_t kItemRows = 48;  // most rows sharing one widening of the keys

struct Inputs {
  const at::BFloat16* q;
  int64_t q_stride;  // between tokens
  const at::BFloat16* k;
  const at::BFloat16* v;
  int64_t block_size, kv_heads, group, num_heads;
  float scale;
  bool causal;
};

// Per thread: the item's query rows, accumulators and softmax state, and one step's keys (head size D).
template <int64_t D>
struct alignas(32) Scratch {
  float q[kItemRows * D];  // q scaled by the softmax scale
  float acc[kItemRows * D];
  float kt[2][D * 8];  // kt[half][d * 8 + j] = K[key 8 * half + j][d]
  float v[kKeys * D];
  float scores[kRowGroup][kKeys];
  float weights[kRowGroup][kKeys];
  float m[kItemRows], l[kItemRows];
  int64_t last_key[kItemRows];  // causal: the last key each row sees
};

// Eight rows of eight floats transposed in place: rows[i][j] becomes rows[j][i].
inline void transpose8_ps(__m256 (&rows)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(rows[0], rows[1]), t1 = _mm256_unpackhi_ps(rows[0], rows[1]);
  const __m256 t2 = _mm256_unpacklo_ps(rows[2], rows[3]), t3 = _mm256_unpackhi_ps(rows[2], rows[3]);
  const __m256 t4 = _mm256_unpacklo_ps(rows[4], rows[5]), t5 = _mm256_unpackhi_ps(rows[4], rows[5]);
  const __m256 t6 = _mm256_unpacklo_ps(rows[6], rows[7]), t7 = _mm256_unpackhi_ps(rows[6], rows[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  rows[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  rows[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  rows[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  rows[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  rows[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  rows[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  rows[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  rows[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Keys [start, start + n) of head h: K transposed and widened into s.kt, V widened row-major into s.v; keys
// past n zero.
template <int64_t D>
inline void load_keys(const Inputs& in, const RunSpan& span, int64_t h, int64_t start, int64_t n, Scratch<D>& s) {
  const int64_t token_stride = in.kv_heads * D;
  int64_t at[kKeys];  // each key's offset in the caches (-1: past n)
  for (int64_t key = 0; key < kKeys; ++key) {
    const int64_t pos = start + key;
    at[key] = key < n ? (static_cast<int64_t>(span.blocks[pos / in.block_size]) * in.block_size +
                         pos % in.block_size) * token_stride + h * D
                      : -1;
  }
  for (int64_t key = 0; key < kKeys; ++key)
    for (int64_t c = 0; c < D / 8; ++c)
      _mm256_store_ps(s.v + key * D + 8 * c, at[key] >= 0 ? load8(in.v + at[key] + 8 * c) : _mm256_setzero_ps());
  for (int64_t half = 0; half < 2; ++half) {
    for (int64_t c = 0; c < D / 8; ++c) {  // 8 dimensions of the half's 8 keys
      __m256 rows[8];
      for (int64_t j = 0; j < 8; ++j) {
        const int64_t a = at[8 * half + j];
        rows[j] = a >= 0 ? load8(in.k + a + 8 * c) : _mm256_setzero_ps();
      }
      transpose8_ps(rows);
      for (int64_t i = 0; i < 8; ++i) _mm256_store_ps(s.kt[half] + (8 * c + i) * 8, rows[i]);
    }
  }
}

// Rows [r, r + R)'s scores against the 16 keys in scratch, into s.scores (a function of its own so that its
// accumulators are all it keeps in registers).
template <int64_t D, int R>
inline void score_rows(Scratch<D>& s, int64_t r) {
  __m256 lo[R], hi[R];  // keys 0-7 and 8-15
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  const float* q = s.q + r * D;
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_load_ps(s.kt[0] + d * 8), k1 = _mm256_load_ps(s.kt[1] + d * 8);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 qd = _mm256_broadcast_ss(q + i * D + d);
      lo[i] = _mm256_fmadd_ps(qd, k0, lo[i]);
      hi[i] = _mm256_fmadd_ps(qd, k1, hi[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    _mm256_store_ps(s.scores[i], lo[i]);
    _mm256_store_ps(s.scores[i] + 8, hi[i]);
  }
}

// One online-softmax step for rows [r, r + R) of the item against the keys in scratch.
template <int64_t D, int R>
inline void step_rows(Scratch<D>& s, int64_t r, int64_t start, int64_t n) {
  score_rows<D, R>(s, r);
  const __m256i index_lo = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(start)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i index_hi = _mm256_add_epi32(index_lo, _mm256_set1_epi32(8));
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 alpha[R];
  for (int i = 0; i < R; ++i) {
    const int64_t last = std::min(s.last_key[r + i], start + n - 1);
    if (last < start) {  // this row sees none of these keys (causal): nothing changes
      alpha[i] = _mm256_set1_ps(1.f);
      _mm256_store_ps(s.weights[i], _mm256_setzero_ps());
      _mm256_store_ps(s.weights[i] + 8, _mm256_setzero_ps());
      continue;
    }
    const __m256 lo = _mm256_load_ps(s.scores[i]), hi = _mm256_load_ps(s.scores[i] + 8);
    const __m256i last_v = _mm256_set1_epi32(static_cast<int>(last));
    const __m256 hide_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(index_lo, last_v));
    const __m256 hide_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(index_hi, last_v));
    const float old_max = s.m[r + i];
    const float new_max = std::max(old_max, hmax8(_mm256_max_ps(_mm256_blendv_ps(lo, minus_inf, hide_lo),
                                                                 _mm256_blendv_ps(hi, minus_inf, hide_hi))));
    const __m256 top = _mm256_set1_ps(new_max);
    const __m256 p_lo = _mm256_andnot_ps(hide_lo, exp256(_mm256_sub_ps(lo, top)));
    const __m256 p_hi = _mm256_andnot_ps(hide_hi, exp256(_mm256_sub_ps(hi, top)));
    // exp256, not a call to expf: a call spills every vector register.
    const float a = old_max == -std::numeric_limits<float>::infinity()
                        ? 0.f
                        : _mm256_cvtss_f32(exp256(_mm256_set1_ps(old_max - new_max)));
    s.l[r + i] = s.l[r + i] * a + reduce_add8(_mm256_add_ps(p_lo, p_hi));
    s.m[r + i] = new_max;
    alpha[i] = _mm256_set1_ps(a);
    _mm256_store_ps(s.weights[i], p_lo);
    _mm256_store_ps(s.weights[i] + 8, p_hi);
  }
  // 16 dims at a time: R rows' two accumulators each and a value row's two vectors stay in registers.
  constexpr int64_t kChunk = 2;
  for (int64_t c0 = 0; c0 < D / 8; c0 += kChunk) {
    __m256 acc[R][kChunk];
    for (int i = 0; i < R; ++i)
      for (int64_t c = 0; c < kChunk; ++c)
        acc[i][c] = _mm256_mul_ps(_mm256_load_ps(s.acc + (r + i) * D + 8 * (c0 + c)), alpha[i]);
    for (int64_t j = 0; j < n; ++j) {
      __m256 vj[kChunk];
      for (int64_t c = 0; c < kChunk; ++c) vj[c] = _mm256_load_ps(s.v + j * D + 8 * (c0 + c));
      for (int i = 0; i < R; ++i) {
        const __m256 w = _mm256_broadcast_ss(&s.weights[i][j]);
        for (int64_t c = 0; c < kChunk; ++c) acc[i][c] = _mm256_fmadd_ps(w, vj[c], acc[i][c]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int64_t c = 0; c < kChunk; ++c) _mm256_store_ps(s.acc + (r + i) * D + 8 * (c0 + c), acc[i][c]);
  }
}

template <int64_t D, int R = kRowGroup>
inline void step_tail(Scratch<D>& s, int64_t r, int64_t rows, int64_t start, int64_t n) {
  if constexpr (R > 1) {
    if (rows < R) return step_tail<D, R - 1>(s, r, rows, start, n);
  }
  step_rows<D, R>(s, r, start, n);
}

template <int64_t D, typename Out>
void run_item(const Inputs& in, const RunSpan& span, int64_t h, int64_t first_row, int64_t num_rows, Out* out,
              float* lse, Scratch<D>& s) {
  int64_t key_end = 0;
  const __m256 scale = _mm256_set1_ps(in.scale);
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t row = first_row + i, token = row / in.group, head = h * in.group + row % in.group;
    const at::BFloat16* qr = in.q + (span.q_start + token) * in.q_stride + head * D;
    for (int64_t c = 0; c < D / 8; ++c) {
      _mm256_store_ps(s.q + i * D + 8 * c, _mm256_mul_ps(load8(qr + 8 * c), scale));
      _mm256_store_ps(s.acc + i * D + 8 * c, _mm256_setzero_ps());
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
      step_tail(s, i, std::min<int64_t>(kRowGroup, num_rows - i), start, n);
  }
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t row = first_row + i, token = span.q_start + row / in.group, head = h * in.group + row % in.group;
    const __m256 inv = _mm256_set1_ps(1.f / s.l[i]);
    Out* o = out + (token * in.num_heads + head) * D;
    for (int64_t c = 0; c < D / 8; ++c) {
      const __m256 value = _mm256_mul_ps(_mm256_load_ps(s.acc + i * D + 8 * c), inv);
      if constexpr (std::is_same_v<Out, float>)
        _mm256_storeu_ps(o + 8 * c, value);
      else
        store8_bf16(o + 8 * c, value);
    }
    lse[token * in.num_heads + head] = s.m[i] + std::log(s.l[i]);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> paged_attention_avx2(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                        const at::Tensor& kv_lens, const at::Tensor& q_starts,
                                                        double scale, bool causal, bool fp32_out) {
  const PagedRunsShape shape =
      check_paged_runs("paged_attention_avx2", q, k_cache, v_cache, block_tables, kv_lens, q_starts, causal);
  const int64_t num_heads = shape.num_heads;
  const RowItems work = split_row_items(shape, block_tables, kv_lens, q_starts, kRowGroup, kItemRows);
  at::Tensor out = at::empty({q.size(0), num_heads, shape.head_dim}, q.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  at::Tensor lse = at::empty({q.size(0), num_heads}, q.options().dtype(at::kFloat));
  const Inputs in{q.data_ptr<at::BFloat16>(), q.stride(0), k_cache.data_ptr<at::BFloat16>(),
                  v_cache.data_ptr<at::BFloat16>(), shape.block_size, shape.kv_heads, shape.group, num_heads,
                  static_cast<float>(scale), causal};
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

std::tuple<at::Tensor, at::Tensor> paged_attention_avx2(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        double, bool, bool) {
  TORCH_CHECK(false, "paged_attention_avx2: this build has no AVX2 and FMA");
}

#endif

}  // namespace kvserve
