// Paged attention on AMX tiles for many query rows at once: prefill chunks over their cached history, and
// the shared-prefix half of cascade decode (every decode's query heads against the prefix the batch shares).
//
// K/V are read from the paged cache in place. A work item is (span, KV head, up to kTilesPerItem tiles of
// 16 query rows); it packs the keys it needs once into the tile layouts, then runs an exact two-pass
// softmax per row tile: pass 1 computes every score once into a buffer and finds each row's largest;
// pass 2 turns the buffered scores into weights exp(s - max) and accumulates weights · V in four tile
// registers that stay put until the last key. The weights go to the multiply as two bf16 parts (hi + lo),
// so they keep ~16 bits; one bf16 part (8 bits) drifts greedy text on the real model. The query rows of a
// KV head are its (token, group head) pairs, so grouped-query attention reads each key once for the group.
//
// Head sizes 64, 128 and 256 (the kernel is templated on it). Four output tiles hold 64 dims, so a wider
// head runs pass 2's key loop once per 64 dims, on weights computed during the first of those loops and
// kept for the others; pass 1 sums each score over the head's 32-dim steps, loading the query tiles (from
// L1) per step where they do not all fit the tile registers alongside the keys and scores.

#include "common.h"

namespace kvserve {

#if KVSERVE_HAS_AMX && KVSERVE_HAS_AVX512_BF16

namespace {

constexpr int64_t kRows = 16;        // query rows per tile
constexpr int64_t kKeys = 32;        // keys per pass-2 step: the depth of one P·V tile multiply
constexpr int64_t kTilesPerItem = 24;  // most row tiles that share one packing of the keys

struct WorkItem {
  int64_t span, head, first_row, num_rows;
};

// Keys padded to whole pass-2 steps: the length of a packed K^T or V run.
inline int64_t packed_keys(int64_t num_keys) { return (num_keys + kKeys - 1) / kKeys * kKeys; }

// Keys [first, n) of one head of size D in the tile layouts (first a multiple of kKeys; kt and vt start at
// key first); keys from n up to the next multiple of kKeys are zero.
//   kt: per 16 keys, the B operands of S = Q·K^T for dims 0-31, 32-63, ...: D / 32 tiles of [16 dim pairs]
//       [16 keys] (bf16, bf16) pairs, i.e. the key rows transposed at 32-bit granularity.
//   vt: per 32 keys, the B operands of O += P·V for dims 16c..16c+15 (c = 0 .. D / 16 - 1): [16 key pairs]
//       [16 dims] of (key 2j, key 2j+1) pairs.
template <int64_t D>
void pack_keys(const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* blocks, int64_t block_size,
               int64_t token_stride, int64_t head, int64_t first, int64_t n, uint32_t* kt, uint32_t* vt) {
  const int64_t padded = (n + kKeys - 1) / kKeys * kKeys;
  auto row = [&](const uint16_t* cache, int64_t t) -> const uint16_t* {
    if (t >= n) return nullptr;
    return cache + (static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size) * token_stride +
           head * D;
  };
  auto load = [](const uint16_t* src, int64_t offset) {
    return src != nullptr ? _mm512_loadu_si512(src + offset) : _mm512_setzero_si512();
  };
  for (int64_t k0 = first; k0 < padded; k0 += 16) {
    const uint16_t* src[16];
    for (int64_t i = 0; i < 16; ++i) src[i] = row(k_cache, k0 + i);
    uint32_t* dst = kt + (k0 - first) * (D / 2);
    for (int64_t c = 0; c < D / 32; ++c) {
      __m512i dims[16];  // dim pairs 16c .. 16c+15 of each key
      for (int64_t i = 0; i < 16; ++i) dims[i] = load(src[i], 32 * c);
      transpose16_epi32(dims, dst + 256 * c);
    }
  }
  // Interleaves two value rows (as bf16) into (a[d], b[d]) pairs: lane d of the output.
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                          38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t k0 = first; k0 < padded; k0 += kKeys) {
    uint32_t* dst = vt + (k0 - first) * D / 2;  // 32 keys x D dims of bf16: D / 16 tiles of 256 u32
    for (int64_t j = 0; j < kKeys / 2; ++j) {
      const uint16_t* a_row = row(v_cache, k0 + 2 * j);
      const uint16_t* b_row = row(v_cache, k0 + 2 * j + 1);
      for (int64_t c = 0; c < D / 32; ++c) {  // dims 32c .. 32c+31 of both rows: tiles 2c and 2c+1
        const __m512i a = load(a_row, 32 * c), b = load(b_row, 32 * c);
        _mm512_storeu_si512(dst + (2 * c) * 256 + j * 16, _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_storeu_si512(dst + (2 * c + 1) * 256 + j * 16, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
    }
  }
}

void configure_tiles() {
  // Every tile is 16 rows x 64 bytes. Pass 1: tmm0-1 Q, tmm2-3 K^T, tmm4-7 two S pairs. Pass 2: tmm0 P hi,
  // tmm2 P lo, tmm1 and tmm3 V, tmm4-7 O.
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC drops some of the stores above as dead without this: it does not see LDTILECFG read them.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// S for keys k0..k0+31 of one row tile (their K^T tiles at k_first) into tiles SA (the first 16 keys) and
// SB, stored to s [16 rows][ld] fp32 at column k0. The query tiles of a 64-dim chunk sit in tmm0 (dims
// 0-31) and tmm1 (dims 32-63): at head size 64 they stay there for the whole pass (the caller loads them);
// wider heads load each chunk's from q (the row tile's [16][D] bf16) here. The key tiles alternate between
// tmm2 and tmm3, and callers alternate the S pair, so consecutive steps do not wait on each other. (A
// macro: the tile intrinsics take register numbers as literal tokens.)
#define KVSERVE_SCORE_TILES(NAME, SA, SB)                                                           \
  template <int64_t D>                                                                              \
  inline void NAME(const uint16_t* q, const uint32_t* k_first, int64_t k0, float* s, int64_t ld) { \
    const uint32_t* k_second = k_first + 16 * (D / 2);                                              \
    _tile_zero(SA);                                                                                 \
    _tile_zero(SB);                                                                                 \
    for (int64_t c = 0; c < D / 64; ++c) {                                                          \
      if constexpr (D > 64) {                                                                       \
        _tile_loadd(0, q + 64 * c, D * 2);                                                          \
        _tile_loadd(1, q + 64 * c + 32, D * 2);                                                     \
      }                                                                                             \
      _tile_loadd(2, k_first + 512 * c, 64);                                                        \
      _tile_dpbf16ps(SA, 0, 2);                                                                     \
      _tile_loadd(3, k_second + 512 * c, 64);                                                       \
      _tile_dpbf16ps(SB, 0, 3);                                                                     \
      _tile_loadd(2, k_first + 512 * c + 256, 64);                                                  \
      _tile_dpbf16ps(SA, 1, 2);                                                                     \
      _tile_loadd(3, k_second + 512 * c + 256, 64);                                                 \
      _tile_dpbf16ps(SB, 1, 3);                                                                     \
    }                                                                                               \
    _tile_stored(SA, s + k0, ld * 4);                                                               \
    _tile_stored(SB, s + k0 + 16, ld * 4);                                                          \
  }
KVSERVE_SCORE_TILES(score_tiles_45, 4, 5)
KVSERVE_SCORE_TILES(score_tiles_67, 6, 7)
#undef KVSERVE_SCORE_TILES

// Bit i set: key k0 + i is visible to a row at position pos (keys 0..pos are).
inline uint32_t visible(int64_t pos, int64_t k0) {
  const int64_t count = pos - k0 + 1;
  if (count >= 32) return 0xFFFFFFFFu;
  if (count <= 0) return 0u;
  return (1u << count) - 1u;
}

struct Scratch {
  std::vector<uint32_t> kt, vt;
  std::vector<float> scores;  // one row tile's scores against all its keys: [16 rows][padded keys]
  // Pass 2's weights as bf16 hi and lo parts, [16 rows][32 keys] each per key step: two steps' worth at
  // head size 64 (each step's are multiplied right after they are computed), every step's for wider heads
  // (the key loop of each later 64-dim chunk reads them again). Over-allocated by 64 bytes to align it.
  std::vector<uint16_t> weights;

  uint16_t* weights_for(int64_t steps) {
    weights.resize(steps * 2 * kRows * kKeys + 32);
    return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(weights.data()) + 63) & ~uintptr_t{63});
  }
};

// Word j of the result is the high half (the truncated bf16) of lane j of a for j < 16, of lane j - 16 of b
// after that: the hi parts of 32 weights in key order.
inline __m512i high_halves_index() {
  alignas(64) uint16_t idx[32];
  for (int j = 0; j < 32; ++j) idx[j] = static_cast<uint16_t>(j < 16 ? 2 * j + 1 : 32 + 2 * (j - 16) + 1);
  return _mm512_load_si512(idx);
}

template <int64_t D, typename Out>
void run_item(const WorkItem& item, const at::BFloat16* q, int64_t q_token_stride, int64_t num_heads, int64_t group, int64_t q_start,
              int64_t q_len, int64_t kv_len, bool causal, const uint16_t* k_cache, const uint16_t* v_cache,
              const int32_t* blocks, int64_t block_size, int64_t kv_heads, float scale, Out* out, float* lse,
              const uint32_t* packed, int64_t packed_count, Scratch& scratch) {
  // Row r of this KV head is (token r / group, query head head * group + r % group).
  auto position = [&](int64_t r) { return causal ? kv_len - q_len + r / group : kv_len - 1; };
  const int64_t last_row = item.first_row + item.num_rows - 1;
  const int64_t num_keys = position(last_row) + 1;
  const int64_t padded = packed_keys(num_keys);
  scratch.scores.resize(kRows * padded);
  // Keys below `split` come packed (pack_kv_amx's layout: per head, kt then vt, each packed_count * D / 2
  // u32); the item packs the rest itself.
  const int64_t split = packed != nullptr ? std::min(packed_count, padded) : 0;
  const uint32_t* shared_kt = packed != nullptr ? packed + item.head * 2 * packed_count * (D / 2) : nullptr;
  const uint32_t* shared_vt = packed != nullptr ? shared_kt + packed_count * (D / 2) : nullptr;
  if (split < padded) {
    scratch.kt.resize((padded - split) * D / 2);
    scratch.vt.resize((padded - split) * D / 2);
    pack_keys<D>(k_cache, v_cache, blocks, block_size, kv_heads * D, item.head, split, num_keys, scratch.kt.data(),
                 scratch.vt.data());
  }
  const uint32_t* own_kt = scratch.kt.data();
  const uint32_t* own_vt = scratch.vt.data();
  auto kt_at = [&](int64_t k0) { return k0 < split ? shared_kt + k0 * (D / 2) : own_kt + (k0 - split) * (D / 2); };
  auto vt_at = [&](int64_t k0) { return k0 < split ? shared_vt + k0 * (D / 2) : own_vt + (k0 - split) * (D / 2); };
  float* const sc = scratch.scores.data();
  const int64_t ld = padded;
  // At head size 64, two step buffers: one step's weights are computed while the previous step's
  // multiplies still run.
  const int64_t weight_steps = D == 64 ? 2 : padded / kKeys;
  uint16_t* const weight_buf = scratch.weights_for(weight_steps);
  auto p_hi = [&](int64_t k0) { return weight_buf + (k0 / kKeys) % weight_steps * 2 * kRows * kKeys; };
  auto p_lo = [&](int64_t k0) { return p_hi(k0) + kRows * kKeys; };

  alignas(64) uint16_t qbuf[kRows * D];
  alignas(64) float obuf[kRows * D];
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // exp((s - max) * scale) = 2^(s * c - max * c): one FMA per 16 scores before the exp2.
  const float c = scale * 1.44269504088896341f;
  const __m512 vc = _mm512_set1_ps(c);
  const __m512i hi_index = high_halves_index();
  const __m512 hi_bits = _mm512_castsi512_ps(_mm512_set1_epi32(0xFFFF0000));
  for (int64_t r0 = item.first_row; r0 <= last_row; r0 += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, last_row + 1 - r0);
    int64_t pos[kRows];
    for (int64_t i = 0; i < kRows; ++i) {
      const int64_t r = r0 + std::min<int64_t>(i, rows - 1);  // padding rows repeat the last real one
      pos[i] = position(r);
      const at::BFloat16* src = q + (q_start + r / group) * q_token_stride + (item.head * group + r % group) * D;
      if (i < rows)
        std::memcpy(qbuf + i * D, src, D * 2);
      else
        std::memset(qbuf + i * D, 0, D * 2);
    }
    const int64_t tile_keys = pos[kRows - 1] + 1;  // positions grow with the row
    const int64_t first_masked = pos[0] + 1;        // keys below this are visible to every row
    const int64_t last_k0 = (tile_keys - 1) / kKeys * kKeys;

    // Pass 1: every score, once, into the buffer; each row's largest visible one. The max of a step is
    // taken kLag steps behind its multiplies so the vector loads do not wait on tile stores in flight.
    constexpr int64_t kLag = 2;
    __m512 vmax[kRows];
    for (int64_t i = 0; i < kRows; ++i) vmax[i] = neg_inf;
    auto fold_max = [&](int64_t k0) {
      const bool masked = k0 + kKeys > first_masked;
      for (int64_t i = 0; i < kRows; ++i) {
        const uint32_t vis = masked ? visible(pos[i], k0) : 0xFFFFFFFFu;
        const float* row = sc + i * ld + k0;
        vmax[i] = _mm512_mask_max_ps(vmax[i], static_cast<__mmask16>(vis), vmax[i], _mm512_loadu_ps(row));
        vmax[i] = _mm512_mask_max_ps(vmax[i], static_cast<__mmask16>(vis >> 16), vmax[i], _mm512_loadu_ps(row + 16));
      }
    };
    if constexpr (D == 64) {
      _tile_loadd(0, qbuf, D * 2);
      _tile_loadd(1, qbuf + 32, D * 2);
    }
    for (int64_t k0 = 0; k0 <= last_k0; k0 += kKeys) {
      if ((k0 / kKeys) & 1)
        score_tiles_67<D>(qbuf, kt_at(k0), k0, sc, ld);
      else
        score_tiles_45<D>(qbuf, kt_at(k0), k0, sc, ld);
      if (k0 >= kLag * kKeys) fold_max(k0 - kLag * kKeys);
    }
    for (int64_t k0 = std::max<int64_t>(0, last_k0 - (kLag - 1) * kKeys); k0 <= last_k0; k0 += kKeys) fold_max(k0);
    __m512 max_c[kRows], row_sum[kRows];
    float row_max[kRows];
    for (int64_t i = 0; i < kRows; ++i) {
      row_max[i] = _mm512_reduce_max_ps(vmax[i]);
      max_c[i] = _mm512_set1_ps(row_max[i] * c);
      row_sum[i] = _mm512_setzero_ps();
    }

    // Pass 2: O = sum over keys of exp((s - max) * scale) * V, in tiles 4-7, 64 dims at a time.
    // Software-pipelined: the weights of step j + 1 are computed before step j's multiplies are issued, so
    // the tile loads never wait on vector stores still in flight, and the vector work overlaps the tile
    // multiplies. Later 64-dim chunks of a wider head multiply the weights the first one kept.
    auto weights = [&](int64_t k0) {
      const bool masked = k0 + kKeys > first_masked;
      uint16_t* hi_buf = p_hi(k0);
      uint16_t* lo_buf = p_lo(k0);
      for (int64_t i = 0; i < kRows; ++i) {
        const float* row = sc + i * ld + k0;
        __m512 p0 = exp2_512(_mm512_fmsub_ps(_mm512_loadu_ps(row), vc, max_c[i]));
        __m512 p1 = exp2_512(_mm512_fmsub_ps(_mm512_loadu_ps(row + 16), vc, max_c[i]));
        if (masked) {
          const uint32_t vis = visible(pos[i], k0);
          p0 = _mm512_maskz_mov_ps(static_cast<__mmask16>(vis), p0);
          p1 = _mm512_maskz_mov_ps(static_cast<__mmask16>(vis >> 16), p1);
        }
        // P in two bf16 parts so the P·V multiply sees the weights to ~16 bits, not 8: hi is the weight
        // truncated to bf16 (its high half), lo the exact remainder rounded to bf16.
        const __m512i hi = _mm512_permutex2var_epi16(_mm512_castps_si512(p0), hi_index, _mm512_castps_si512(p1));
        const __m512 rest0 = _mm512_sub_ps(p0, _mm512_and_ps(p0, hi_bits));
        const __m512 rest1 = _mm512_sub_ps(p1, _mm512_and_ps(p1, hi_bits));
        row_sum[i] = _mm512_add_ps(row_sum[i], _mm512_add_ps(p0, p1));
        _mm512_store_si512(hi_buf + i * kKeys, hi);
        _mm512_store_si512(lo_buf + i * kKeys, (__m512i)_mm512_cvtne2ps_pbh(rest1, rest0));
      }
    };
    for (int64_t chunk = 0; chunk < D / 64; ++chunk) {
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      if (chunk == 0) weights(0);
      for (int64_t k0 = 0; k0 <= last_k0; k0 += kKeys) {
        if (chunk == 0 && k0 < last_k0) weights(k0 + kKeys);
        const uint32_t* v = vt_at(k0) + 1024 * chunk;  // this chunk's four V tiles of the step
        // V chunks alternate between tmm1 and tmm3 so consecutive multiplies accumulate into different
        // tiles instead of waiting on each other.
        _tile_loadd(0, p_hi(k0), kKeys * 2);
        _tile_loadd(2, p_lo(k0), kKeys * 2);
        _tile_loadd(1, v, 64);
        _tile_loadd(3, v + 256, 64);
        _tile_dpbf16ps(4, 0, 1);
        _tile_dpbf16ps(5, 0, 3);
        _tile_dpbf16ps(4, 2, 1);
        _tile_dpbf16ps(5, 2, 3);
        _tile_loadd(1, v + 512, 64);
        _tile_loadd(3, v + 768, 64);
        _tile_dpbf16ps(6, 0, 1);
        _tile_dpbf16ps(7, 0, 3);
        _tile_dpbf16ps(6, 2, 1);
        _tile_dpbf16ps(7, 2, 3);
      }
      _tile_stored(4, obuf + 64 * chunk, D * 4);
      _tile_stored(5, obuf + 64 * chunk + 16, D * 4);
      _tile_stored(6, obuf + 64 * chunk + 32, D * 4);
      _tile_stored(7, obuf + 64 * chunk + 48, D * 4);
    }

    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = r0 + i;
      const int64_t index = (q_start + r / group) * num_heads + item.head * group + r % group;
      const float total = _mm512_reduce_add_ps(row_sum[i]);
      const __m512 inv = _mm512_set1_ps(1.f / total);
      for (int64_t d = 0; d < D / 16; ++d) {
        const __m512 o = _mm512_mul_ps(_mm512_load_ps(obuf + i * D + 16 * d), inv);
        if constexpr (std::is_same_v<Out, float>)
          _mm512_storeu_ps(out + index * D + 16 * d, o);
        else
          store16_bf16(out + index * D + 16 * d, o);
      }
      lse[index] = row_max[i] * scale + std::log(total);
    }
  }
}

}  // namespace

// q [T, H, D] bf16 (any token stride; D = 64, 128 or 256), the query tokens of every span back to back;
// caches [num_blocks, block_size, H_kv, D]; block_tables int32 [S, max_blocks]; kv_lens int32 [S]; q_starts int32 [S + 1] (span s owns tokens
// q_starts[s] .. q_starts[s+1]-1). causal: a span's last query token sits at position kv_len - 1 and each
// token sees keys up to its own position; otherwise every token sees all kv_len keys. Returns out [T, H, D]
// (fp32 if fp32_out, else bf16) and the log-sum-exp of the scaled scores, fp32 [T, H].
// packed (from pack_kv_amx): with shared_keys == 0, all the keys of a single non-causal span (cascade
// decode's shared prefix); with shared_keys > 0 (a multiple of 32), the first shared_keys keys, held in the
// same blocks by every span (a system prompt several prefill chunks attend to): the items pack only the
// keys after them, and the packing can be kept across steps.
std::tuple<at::Tensor, at::Tensor> paged_attention_amx(const at::Tensor& q, const at::Tensor& k_cache,
                                                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                       const at::Tensor& kv_lens, const at::Tensor& q_starts,
                                                       double scale, bool causal, bool fp32_out,
                                                       const c10::optional<at::Tensor>& packed,
                                                       int64_t shared_keys) {
  TORCH_CHECK(request_amx(), "paged_attention_amx: the kernel did not grant AMX");
  const PagedRunsShape shape =
      check_paged_runs("paged_attention_amx", q, k_cache, v_cache, block_tables, kv_lens, q_starts, causal);
  const int64_t num_heads = shape.num_heads, kv_heads = shape.kv_heads, block_size = shape.block_size;
  const int64_t group = shape.group, num_spans = shape.num_spans, max_blocks = shape.max_blocks;
  const int64_t dim = shape.head_dim;
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  const int32_t* starts = q_starts.data_ptr<int32_t>();
  const bool prepacked = packed.has_value() && packed->defined();
  TORCH_CHECK(shared_keys >= 0 && shared_keys % kKeys == 0 && (shared_keys == 0 || prepacked),
              "paged_attention_amx: shared_keys must be a multiple of 32, with the packed keys");
  int64_t packed_count = 0;  // keys per head in `packed`
  if (prepacked && shared_keys == 0) {
    TORCH_CHECK(num_spans == 1 && !causal, "paged_attention_amx: packed keys serve one non-causal span");
    packed_count = packed_keys(lens[0]);
  } else if (prepacked) {
    packed_count = shared_keys;
    for (int64_t s = 0; s < num_spans; ++s) {
      TORCH_CHECK(lens[s] >= shared_keys, "paged_attention_amx: span ", s, " has fewer keys than the shared ones");
      TORCH_CHECK(std::equal(block_tables.data_ptr<int32_t>() + s * max_blocks,
                             block_tables.data_ptr<int32_t>() + s * max_blocks + (shared_keys + block_size - 1) / block_size,
                             block_tables.data_ptr<int32_t>()),
                  "paged_attention_amx: span ", s, " does not hold the shared keys' blocks");
    }
  }
  if (prepacked)
    TORCH_CHECK(packed->scalar_type() == at::kInt && packed->is_contiguous() &&
                    packed->numel() == kv_heads * 2 * packed_count * (dim / 2),
                "paged_attention_amx: packed keys must come from pack_kv_amx for these ",
                shared_keys > 0 ? shared_keys : static_cast<int64_t>(lens[0]), " keys");
  // Keys packed for the whole span cost nothing to share, so the rows then split into single tiles: more
  // items to balance.
  const int64_t tiles_per_item = prepacked && shared_keys == 0 ? 1 : kTilesPerItem;
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_spans; ++s) {
    const int64_t rows = (starts[s + 1] - starts[s]) * group;
    // The rows of a (span, head) split into near-equal items of whole tiles, at most kTilesPerItem each.
    const int64_t tiles = (rows + kRows - 1) / kRows;
    const int64_t num_items = (tiles + tiles_per_item - 1) / tiles_per_item;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t k = 0, r = 0; k < num_items; ++k) {
        const int64_t end = std::min(rows, (tiles * (k + 1) / num_items) * kRows);
        items.push_back({s, h, r, end - r});
        r = end;
      }
  }
  at::Tensor out = at::empty({q.size(0), num_heads, dim}, q.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  at::Tensor lse = at::empty({q.size(0), num_heads}, q.options().dtype(at::kFloat));
  const auto* qp = q.data_ptr<at::BFloat16>();
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  float* lp = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const uint32_t* pk = prepacked ? reinterpret_cast<const uint32_t*>(packed->data_ptr<int32_t>()) : nullptr;
  with_head_size(dim, [&](auto head_size) {
    constexpr int64_t D = decltype(head_size)::value;
    parallel_claim(static_cast<int64_t>(items.size()), [&](auto&& claim) {
      configure_tiles();
      Scratch scratch;
      for (int64_t i; (i = claim()) >= 0;) {
        const WorkItem& item = items[i];
        const int64_t s = item.span;
        const int64_t q_len = starts[s + 1] - starts[s];
        if (fp32_out)
          run_item<D, float>(item, qp, q.stride(0), num_heads, group, starts[s], q_len, lens[s], causal, kp, vp,
                             tables + s * max_blocks, block_size, kv_heads, fscale, out.data_ptr<float>(), lp, pk,
                             packed_count, scratch);
        else
          run_item<D, at::BFloat16>(item, qp, q.stride(0), num_heads, group, starts[s], q_len, lens[s], causal, kp,
                                    vp, tables + s * max_blocks, block_size, kv_heads, fscale,
                                    out.data_ptr<at::BFloat16>(), lp, pk, packed_count, scratch);
      }
      _tile_release();
    });
  });
  return {out, lse};
}

// The keys and values of one run of blocks (block_table int32 [num_blocks], the first kv_len tokens) in the
// tile layouts paged_attention_amx multiplies with: int32 [H_kv, 2, padded keys * D / 2], per KV head its
// K^T tiles then its V tiles. Passed back as `packed`, they spare the kernel packing them again: cascade
// decode asks for the same shared prefix every step.
at::Tensor pack_kv_amx(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                       int64_t kv_len) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
                  many_row_head_size(k_cache.size(3)) && k_cache.sizes() == v_cache.sizes(),
              "pack_kv_amx: caches must be contiguous bf16 [num_blocks, block_size, H_kv, D], D = 64, 128 or 256");
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1), dim = k_cache.size(3);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 1 && block_table.is_contiguous() &&
                  kv_len >= 1 && kv_len <= block_table.numel() * block_size,
              "pack_kv_amx: block_table must be contiguous int32 [num_blocks] covering kv_len tokens");
  const int32_t* blocks = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < block_table.numel(); ++b)
    TORCH_CHECK(blocks[b] >= 0 && blocks[b] < k_cache.size(0), "pack_kv_amx: block id out of range");
  const int64_t padded = packed_keys(kv_len);
  at::Tensor packed = at::empty({kv_heads, 2, padded * (dim / 2)}, block_table.options());
  auto* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  with_head_size(dim, [&](auto head_size) {
    constexpr int64_t D = decltype(head_size)::value;
    parallel_claim(kv_heads, [&](auto&& claim) {
      for (int64_t h; (h = claim()) >= 0;) {
        uint32_t* kt = dst + h * 2 * padded * (D / 2);
        pack_keys<D>(kp, vp, blocks, block_size, kv_heads * D, h, 0, kv_len, kt, kt + padded * (D / 2));
      }
    });
  });
  return packed;
}

#else

std::tuple<at::Tensor, at::Tensor> paged_attention_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       double, bool, bool, const c10::optional<at::Tensor>&,
                                                       int64_t) {
  TORCH_CHECK(false, "paged_attention_amx: this build has no AMX");
}
at::Tensor pack_kv_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "pack_kv_amx: this build has no AMX");
}

#endif

}  // namespace kvserve
