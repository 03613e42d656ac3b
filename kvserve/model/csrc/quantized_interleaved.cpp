// Projections on GGUF-quantised weights held interleaved: sixteen rows at a time, so that one 512-bit
// register holds four consecutive weights of each of sixteen rows, as llama.cpp's repacked AVX-512 formats
// do. A VNNI dpbusd then multiplies all sixteen rows by one broadcast group of four int8 activations, and its
// sixteen lanes are the sixteen outputs: no horizontal sums, and each half chunk's scales are applied to
// sixteen rows by one FMA, where the planar few-row kernel applies them to one row.
//
// A group (16 x row_bytes bytes, model/quantized_layout.py lays it out) is its blocks one after another
// (block-major: a group is read as one stream, which the hardware prefetchers follow; a plane per part
// read more slowly, docs/performance.md), each block holding its parts for the sixteen rows side by side,
// in this order:
//   blocks of 32 (one chunk each): fp16 d [16 rows], (Q4_1, Q5_1) fp16 m [16], (Q5_0, Q5_1) high bits
//     [8 vectors][64 bits], then the quants: 4-bit formats [4][64 bytes], byte 4r + j of the h-th 64 holding
//     weights 8h + j (low nibble) and 8h + 4 + j (high) of row r; Q8_0 [8][64 bytes], byte 4r + j of the
//     g-th 64 holding weight 4g + j of row r plus 128.
//   Q4_K, Q5_K (256 values, 8 chunks): fp16 d [16], fp16 dmin [16], 6-bit scales [8 chunks][16] and mins
//     likewise a byte each, (Q5_K) high bits [8 chunks][8 vectors][64 bits], the nibbles [8 chunks] as the
//     4-bit formats'.
//   Q6_K: fp16 d [16], signed scales [16 halves][16], low nibbles [8 chunks] as above, then the high bit
//     pairs [8 chunks][2][64 bytes]: byte 4r + j of the h-th 64 holds, in bits 2v and 2v + 1, the high bits
//     of weight 4 (4h + v) + j of row r.
// A high-bit vector's bit 4r + j is that of weight 4g + j of row r: a 64-bit mask over the register's bytes.
//
// The activations are quantised per sixteen values to int8 (finer than llama.cpp's Q8 blocks of 32 or 256).
// Wider inputs than the few-row limit (decode batches, prompt chunks) add a second int8 level, the residual
// at 1/256 of the scale: about 16 bits per value, as near the exact products as bf16 activations, for twice
// the dot products on the same unpacked weights. Or, asked for (ActivationCode::kInt8Coarse), one int8 level
// per 32 values at every width, llama.cpp's Q8_0 grain: a chunk's sum of products is converted and scaled
// once, where the finer codes take two conversions and scales per chunk.

#include "common.h"
#include "quantized.h"

namespace kvserve {
namespace {

// A group's parts for one block of the format (32 values, or a K-quant's 256), for its sixteen rows.
struct BlockParts {
  const uint8_t* d;
  const uint8_t* m;   // Q4_1, Q5_1: offsets; Q4_K, Q5_K: dmin
  const uint8_t* sc;  // K-quants: sub-block scales
  const uint8_t* mn;  // Q4_K, Q5_K: sub-block mins
  const uint8_t* qh;
  const uint8_t* qs;
};

// Where a group's blocks and their parts are: the blocks one after another (block-major, so that a group
// is one stream of reads), each block's parts in the order the header lists them.
struct GroupParts {
  const uint8_t* group;
  int64_t block_bytes;  // one block's parts, for sixteen rows
  int64_t m, sc, mn, qh, qs;  // offsets in a block; -1 where the format has no such part

  BlockParts block(int64_t b) const {
    const uint8_t* at = group + b * block_bytes;
    auto part = [&](int64_t offset) { return offset < 0 ? nullptr : at + offset; };
    return {at, part(m), part(sc), part(mn), part(qh), part(qs)};
  }
};

GroupParts group_parts(int64_t type, const uint8_t* g) {
  switch (type) {  // d first in every format, 32 bytes (sixteen fp16)
    case kQ4_K: return {g, 2368, 32, 64, 192, -1, 320};
    case kQ5_K: return {g, 2880, 32, 64, 192, 320, 832};
    case kQ6_K: return {g, 3360, -1, 32, -1, 2336, 288};
    case kQ4_0: return {g, 288, -1, -1, -1, -1, 32};
    case kQ4_1: return {g, 320, 32, -1, -1, -1, 64};
    case kQ5_0: return {g, 352, -1, -1, -1, 32, 96};
    case kQ5_1: return {g, 384, 32, -1, -1, 64, 128};
    case kQ8_0: return {g, 544, -1, -1, -1, -1, 32};
    default: TORCH_CHECK(false, "quantized: GGML type ", type, " has no interleaved kernel");
  }
}

constexpr int64_t chunks_per_block(int64_t type) {
  return type == kQ4_K || type == kQ5_K || type == kQ6_K ? 8 : 1;
}

// Chunk c of row r: its scales and 32 unsigned weight bytes, as quantized.cpp's decode_chunk_scalar gives
// the same row held planar (the same products, in the same order).
ChunkScales decode_chunk(int64_t type, const GroupParts& parts, int64_t r, int64_t c, uint8_t* bytes) {
  const int64_t j = c % chunks_per_block(type);  // the chunk within its block
  const BlockParts p = parts.block(c / chunks_per_block(type));
  auto nibble = [&](int i) {
    const uint8_t b = p.qs[256 * j + 64 * (i / 8) + 4 * r + i % 4];
    return static_cast<uint8_t>(i % 8 < 4 ? b & 0xF : b >> 4);
  };
  auto high_bit = [&](int i) {
    const int64_t bit = 4 * r + i % 4;
    return static_cast<uint8_t>((p.qh[64 * j + 8 * (i / 4) + bit / 8] >> (bit % 8)) & 1);
  };
  const bool high = type == kQ5_0 || type == kQ5_1 || type == kQ5_K;
  switch (type) {
    case kQ4_0: case kQ5_0: case kQ8_0: case kQ4_1: case kQ5_1: {
      const float d = half_at(p.d + 2 * r);
      const float offset = type == kQ4_0 ? -8.f * d : type == kQ5_0 ? -16.f * d : type == kQ8_0 ? -128.f * d
                                                                                 : half_at(p.m + 2 * r);
      for (int i = 0; i < 32; ++i)
        bytes[i] = type == kQ8_0 ? p.qs[64 * (i / 4) + 4 * r + i % 4]
                                 : static_cast<uint8_t>(nibble(i) | (high ? high_bit(i) << 4 : 0));
      return {{d, d}, {offset, offset}};
    }
    case kQ4_K: case kQ5_K: {
      const float d = half_at(p.d + 2 * r) * p.sc[16 * j + r];
      const float m = -half_at(p.m + 2 * r) * p.mn[16 * j + r];
      for (int i = 0; i < 32; ++i) bytes[i] = static_cast<uint8_t>(nibble(i) | (high ? high_bit(i) << 4 : 0));
      return {{d, d}, {m, m}};
    }
    case kQ6_K: {
      const float d = half_at(p.d + 2 * r);
      const int8_t* scales = reinterpret_cast<const int8_t*>(p.sc) + r;
      const int8_t s0 = scales[16 * (2 * j)], s1 = scales[16 * (2 * j + 1)];
      for (int i = 0; i < 32; ++i) {
        const uint8_t pairs = p.qh[128 * j + 64 * (i / 16) + 4 * r + i % 4];
        bytes[i] = static_cast<uint8_t>(nibble(i) | (((pairs >> (2 * ((i / 4) % 4))) & 3) << 4));
      }
      return {{d * s0, d * s1}, {-32.f * d * s0, -32.f * d * s1}};
    }
    default: TORCH_CHECK(false, "quantized: GGML type ", type, " has no kernel");
  }
}

#if KVSERVE_HAS_VNNI
// One format's chunk over a group's sixteen rows: eight registers of unsigned weight bytes (register g:
// weights 4g .. 4g + 3 of each row, row r in bytes 4r ..), and each half's per-row scale d and offset m,
// w = d q + m. A symmetric format's offset is -kOffset d (the dot products apply it in integers).
template <int64_t Type>
struct Interleaved {
  static constexpr bool kSuper = Type == kQ4_K || Type == kQ5_K || Type == kQ6_K;
  static constexpr bool kSymmetric = Type == kQ4_0 || Type == kQ5_0 || Type == kQ8_0 || Type == kQ6_K;
  static constexpr int kOffset = Type == kQ4_0 ? 8 : Type == kQ5_0 ? 16 : Type == kQ8_0 ? 128 : 32;

  static constexpr int64_t kChunks = chunks_per_block(Type);

  // Chunk j of block p.
  static inline void weights(const BlockParts& p, int64_t j, __m512i w[8]) {
    if constexpr (Type == kQ8_0) {
      for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(p.qs + 64 * g);
      return;
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int h = 0; h < 4; ++h) {
      const __m512i v = _mm512_loadu_si512(p.qs + 256 * j + 64 * h);
      w[2 * h] = _mm512_and_si512(v, low4);
      w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    if constexpr (Type == kQ5_0 || Type == kQ5_1 || Type == kQ5_K) {
      const __m512i sixteen = _mm512_set1_epi8(0x10);
      for (int g = 0; g < 8; ++g) {
        uint64_t bits;
        std::memcpy(&bits, p.qh + 64 * j + 8 * g, 8);
        w[g] = _mm512_mask_add_epi8(w[g], bits, w[g], sixteen);
      }
    }
    if constexpr (Type == kQ6_K) {
      const __m512i top2 = _mm512_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        const __m512i pairs = _mm512_loadu_si512(p.qh + 128 * j + 64 * h);
        // Bits 2v, 2v + 1 of each byte to bits 4, 5 (the 16-bit shifts' spill across bytes is masked off).
        const __m512i at4[4] = {_mm512_slli_epi16(pairs, 4), _mm512_slli_epi16(pairs, 2), pairs,
                                _mm512_srli_epi16(pairs, 2)};
        for (int v = 0; v < 4; ++v) w[4 * h + v] = _mm512_ternarylogic_epi32(w[4 * h + v], at4[v], top2, 0xF8);
      }
    }
  }

  // Chunk j's per-row scales for its two halves, and (asymmetric formats) its offset.
  static inline void scales(const BlockParts& p, int64_t j, __m512* d0, __m512* d1, __m512* m) {
    auto halves16 = [](const uint8_t* at) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    };
    if constexpr (!kSuper) {
      *d0 = *d1 = halves16(p.d);
      if constexpr (!kSymmetric) *m = halves16(p.m);
    } else if constexpr (Type == kQ4_K || Type == kQ5_K) {
      auto bytes16 = [](const uint8_t* at) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
      };
      *d0 = *d1 = _mm512_mul_ps(halves16(p.d), bytes16(p.sc + 16 * j));
      *m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(halves16(p.m), bytes16(p.mn + 16 * j)));
    } else {  // Q6_K
      auto signed16 = [](const uint8_t* at) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
      };
      const __m512 d = halves16(p.d);
      *d0 = _mm512_mul_ps(d, signed16(p.sc + 16 * (2 * j)));
      *d1 = _mm512_mul_ps(d, signed16(p.sc + 16 * (2 * j + 1)));
    }
  }
};

// x rows quantised to int8, q = round(x / scale), scale = max|x| / 127: kInt8 and kInt16 per sixteen values,
// kInt16 with the residual r = round(256 (x / scale - q)) beside, so x = scale (q + r / 256) to about 16 bits;
// kInt8Coarse per 32 values (a weight chunk's). Per scale: the scale (divided by 256 with two levels, as the
// products are then 256 q + r); per sixteen values: minus the sum of q (and of r); per chunk: the sum over its
// halves of the values' sums (what an offset multiplies).
struct ChunkActivations {
  ActivationCode code;
  std::vector<int8_t> q, r;           // [M, K]
  std::vector<float> scale;           // [M, K / 16], kInt8Coarse [M, K / 32]
  std::vector<int32_t> neg_sums;      // [M, K / 16]
  std::vector<int32_t> neg_residual_sums;  // [M, K / 16]
  std::vector<float> scaled_sums;     // [M, K / 32]

  ChunkActivations(const at::BFloat16* x, int64_t M, int64_t K, ActivationCode code)
      : code(code), q(M * K), r(code == ActivationCode::kInt16 ? M * K : 0),
        scale(code == ActivationCode::kInt8Coarse ? M * K / 32 : M * K / 16), neg_sums(M * K / 16),
        neg_residual_sums(code == ActivationCode::kInt16 ? M * K / 16 : 0), scaled_sums(M * K / 32) {
    // Rows split between the workers where there are enough of them to pay for the hand-off (prompt chunks).
    parallel_range(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
      for (int64_t c = m0 * K / 32; c < m1 * K / 32; ++c) {
        if (this->code == ActivationCode::kInt8Coarse) quantize_chunk(x, c);
        else for (int64_t h = 2 * c; h < 2 * c + 2; ++h) quantize_half(x, h);
      }
    });
  }

 private:
  void quantize_half(const at::BFloat16* x, int64_t h) {
    const __m512 v = load16(x + 16 * h);
    const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 scaled = _mm512_mul_ps(v, _mm512_set1_ps(inv));
    const __m512i qi = _mm512_cvtps_epi32(scaled);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + 16 * h), _mm512_cvtsepi32_epi8(qi));
    const int32_t sum = _mm512_reduce_add_epi32(qi);
    neg_sums[h] = -sum;
    float value_sum = d * static_cast<float>(sum);
    scale[h] = d;
    if (code == ActivationCode::kInt16) {
      const __m512 rest = _mm512_mul_ps(_mm512_sub_ps(scaled, _mm512_cvtepi32_ps(qi)), _mm512_set1_ps(256.f));
      const __m128i ri = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rest));  // |rest| <= 128: 128 saturates
      _mm_storeu_si128(reinterpret_cast<__m128i*>(r.data() + 16 * h), ri);
      const int32_t rest_sum = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(ri));
      neg_residual_sums[h] = -rest_sum;
      value_sum = d * (static_cast<float>(sum) + static_cast<float>(rest_sum) / 256.f);
      scale[h] = d / 256.f;
    }
    if (h % 2 == 0) scaled_sums[h / 2] = value_sum;
    else scaled_sums[h / 2] += value_sum;
  }

  void quantize_chunk(const at::BFloat16* x, int64_t c) {
    const __m512 v[2] = {load16(x + 32 * c), load16(x + 32 * c + 16)};
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int half = 0; half < 2; ++half) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[half], _mm512_set1_ps(inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + 32 * c + 16 * half), _mm512_cvtsepi32_epi8(qi));
      const int32_t half_sum = _mm512_reduce_add_epi32(qi);
      neg_sums[2 * c + half] = -half_sum;
      sum += half_sum;
    }
    scale[c] = d;
    scaled_sums[c] = d * static_cast<float>(sum);
  }
};

inline __m512i broadcast4(const int8_t* at) {
  int32_t v;
  std::memcpy(&v, at, 4);
  return _mm512_set1_epi32(v);
}

// Chunk c's products for MT activation rows coded kInt8Coarse, added to acc: one scale per chunk, so a chunk
// is one sum of products converted once (Q6_K, whose halves have their own weight scales: one per half). The
// rows' sums advance together, a weight register at a time, so that MT independent chains of dot products
// are in flight.
template <typename F, int MT>
inline void coarse_products(const ChunkActivations& xa, int64_t m0, int64_t c, int64_t chunks, int64_t K,
                            const __m512i w[8], __m512 d0, __m512 d1, __m512 m, __m512 acc[MT]) {
  // Weight registers g0 .. g1 - 1 (half: 0 or 1 for one half's four, -1 for the chunk's eight) at scale d.
  auto products = [&](int g0, int g1, int half, __m512 d) {
    __m512i s[MT];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const int32_t* neg = xa.neg_sums.data() + ((m0 + i) * chunks + c) * 2;
      s[i] = F::kSymmetric ? _mm512_set1_epi32(F::kOffset * (half < 0 ? neg[0] + neg[1] : neg[half]))
                           : _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int g = g0; g < g1; ++g)
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i)
        s[i] = _mm512_dpbusd_epi32(s[i], w[g], broadcast4(xa.q.data() + (m0 + i) * K + 32 * c + 4 * g));
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m512 scale = _mm512_set1_ps(xa.scale[(m0 + i) * chunks + c]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(d, scale), acc[i]);
    }
  };
  if constexpr (std::is_same_v<F, Interleaved<kQ6_K>>) {
    products(0, 4, 0, d0);
    products(4, 8, 1, d1);
  } else {
    products(0, 8, -1, d0);
  }
  if constexpr (!F::kSymmetric)
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xa.scaled_sums[(m0 + i) * chunks + c]), acc[i]);
}

// acc[i] (16 rows' outputs) for activation rows m0 .. m0 + MT - 1 against one group, the activations coded
// as Code. The next group (the worker's next, `fetch`) is fetched as this one is read, a chunk's share at a
// time.
template <int64_t Type, int MT, ActivationCode Code>
inline void group_tile(const GroupParts& p, int64_t K, const ChunkActivations& xa, int64_t m0,
                       const uint8_t* fetch, int64_t fetch_step, __m512 acc[MT]) {
  using F = Interleaved<Type>;
  const int64_t chunks = K / 32;
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  BlockParts block{};
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t b = 0; b < fetch_step; b += 64) _mm_prefetch(reinterpret_cast<const char*>(fetch + b), _MM_HINT_T0);
    fetch += fetch_step;
    const int64_t j = c % F::kChunks;  // the chunk in its block
    if (j == 0) block = p.block(c / F::kChunks);
    __m512i w[8];
    F::weights(block, j, w);
    __m512 d0, d1, m = _mm512_setzero_ps();
    F::scales(block, j, &d0, &d1, &m);
    // Each half's integer products of one level's activations (`x`, minus sums `neg`), offsets included.
    auto half_products = [&](const int8_t* x, const int32_t* neg, __m512i* s0, __m512i* s1) {
      *s0 = F::kSymmetric ? _mm512_set1_epi32(F::kOffset * neg[0]) : _mm512_setzero_si512();
      *s1 = F::kSymmetric ? _mm512_set1_epi32(F::kOffset * neg[1]) : _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        *s0 = _mm512_dpbusd_epi32(*s0, w[g], broadcast4(x + 4 * g));
        *s1 = _mm512_dpbusd_epi32(*s1, w[g + 4], broadcast4(x + 16 + 4 * g));
      }
    };
    if constexpr (Code == ActivationCode::kInt8Coarse) {
      coarse_products<F, MT>(xa, m0, c, chunks, K, w, d0, d1, m, acc);
      continue;
    }
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const int64_t h = ((m0 + i) * chunks + c) * 2;  // the chunk's first half
      const int64_t at = (m0 + i) * K + 32 * c;
      __m512i s0, s1;
      half_products(xa.q.data() + at, xa.neg_sums.data() + h, &s0, &s1);
      if constexpr (Code == ActivationCode::kInt16) {  // 256 sum(w q) + sum(w r): within int32 for every format
        __m512i r0, r1;
        half_products(xa.r.data() + at, xa.neg_residual_sums.data() + h, &r0, &r1);
        s0 = _mm512_add_epi32(_mm512_slli_epi32(s0, 8), r0);
        s1 = _mm512_add_epi32(_mm512_slli_epi32(s1, 8), r1);
      }
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d0, _mm512_set1_ps(xa.scale[h])), acc[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(d1, _mm512_set1_ps(xa.scale[h + 1])), acc[i]);
      if constexpr (!F::kSymmetric) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xa.scaled_sums[h / 2]), acc[i]);
    }
  }
}

// Every activation row against one group: out[m * 16 ..] in fp32, in tiles of 8, 4, 2 and 1 rows.
template <int64_t Type>
void group_products(const uint8_t* group, int64_t stride, int64_t K, const ChunkActivations& xa, int64_t M,
                    float* out) {
  const GroupParts p = group_parts(Type, group);
  const int64_t group_bytes = kInterleavedRows * stride, chunks = K / 32;
  const int64_t fetch_step = (group_bytes + chunks - 1) / chunks;
  auto tile = [&](auto rows, int64_t m0, const uint8_t* fetch, int64_t step) {
    constexpr int MT = decltype(rows)::value;
    __m512 acc[MT];
    switch (xa.code) {
      case ActivationCode::kInt8: group_tile<Type, MT, ActivationCode::kInt8>(p, K, xa, m0, fetch, step, acc); break;
      case ActivationCode::kInt16: group_tile<Type, MT, ActivationCode::kInt16>(p, K, xa, m0, fetch, step, acc); break;
      case ActivationCode::kInt8Coarse:
        group_tile<Type, MT, ActivationCode::kInt8Coarse>(p, K, xa, m0, fetch, step, acc);
        break;
    }
    for (int i = 0; i < MT; ++i) _mm512_storeu_ps(out + (m0 + i) * 16, acc[i]);
  };
  int64_t m0 = 0;
  // The first tile fetches the next group; the others find this one in cache.
  auto fetch = [&](int64_t m) { return m == 0 ? fetch_step : 0; };
  for (; M - m0 >= 8; m0 += 8) tile(std::integral_constant<int, 8>{}, m0, group + group_bytes, fetch(m0));
  if (M - m0 >= 4) { tile(std::integral_constant<int, 4>{}, m0, group + group_bytes, fetch(m0)); m0 += 4; }
  if (M - m0 >= 2) { tile(std::integral_constant<int, 2>{}, m0, group + group_bytes, fetch(m0)); m0 += 2; }
  if (M - m0 >= 1) tile(std::integral_constant<int, 1>{}, m0, group + group_bytes, fetch(m0));
}

void products_of_rows(const Segments& w, int64_t n, const ChunkActivations& xa, int64_t M, float* out) {
  const int64_t s = w.segment_of(n);
  with_type(w.types[s], [&](auto tag) {
    group_products<decltype(tag)::value>(w.row(s, n), w.row_bytes[s], w.K, xa, M, out);
  });
}

// A pair of k's values as one dword of two bf16, rounded as the planar dequantiser rounds.
inline __m512i bf16_pair_dwords(__m512 even, __m512 odd) {
#if KVSERVE_HAS_AVX512_BF16
  // [even's 16 | odd's 16] as bf16, then word i of each half side by side.
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
#else
  return _mm512_or_si512(_mm512_cvtepu16_epi32(cvt16_bf16(even)),
                         _mm512_slli_epi32(_mm512_cvtepu16_epi32(cvt16_bf16(odd)), 16));
#endif
}

template <int64_t Type>
void dequantize_tiles(const uint8_t* group, int64_t K, at::BFloat16* tiles) {
  using F = Interleaved<Type>;
  const GroupParts p = group_parts(Type, group);
  const __m512i byte = _mm512_set1_epi32(0xFF);
  BlockParts block{};
  for (int64_t c = 0; c < K / 32; ++c) {
    const int64_t j = c % F::kChunks;  // the chunk in its block
    if (j == 0) block = p.block(c / F::kChunks);
    __m512i w[8];
    F::weights(block, j, w);
    __m512 d[2], m[2];
    m[0] = _mm512_setzero_ps();
    F::scales(block, j, &d[0], &d[1], &m[0]);
    if constexpr (F::kSymmetric) {
      for (int h = 0; h < 2; ++h) m[h] = _mm512_mul_ps(_mm512_set1_ps(-static_cast<float>(F::kOffset)), d[h]);
    } else {
      m[1] = m[0];
    }
    uint32_t* tile = reinterpret_cast<uint32_t*>(tiles + 512 * c);
    for (int g = 0; g < 8; ++g) {
      auto value = [&](__m512i q) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d[g / 4], m[g / 4]); };
      const __m512 v0 = value(_mm512_and_si512(w[g], byte));
      const __m512 v1 = value(_mm512_and_si512(_mm512_srli_epi32(w[g], 8), byte));
      const __m512 v2 = value(_mm512_and_si512(_mm512_srli_epi32(w[g], 16), byte));
      const __m512 v3 = value(_mm512_srli_epi32(w[g], 24));
      _mm512_storeu_si512(tile + 16 * (2 * g), bf16_pair_dwords(v0, v1));
      _mm512_storeu_si512(tile + 16 * (2 * g + 1), bf16_pair_dwords(v2, v3));
    }
  }
}
#endif

}  // namespace

void interleaved_dequantize_row(int64_t type, const uint8_t* group, int64_t r, int64_t K, float* out) {
  const GroupParts p = group_parts(type, group);
  uint8_t q[32];
  for (int64_t c = 0; c < K / 32; ++c) {
    const ChunkScales s = decode_chunk(type, p, r, c, q);
    for (int i = 0; i < 32; ++i) out[32 * c + i] = s.d[i / 16] * q[i] + s.m[i / 16];
  }
}

#if KVSERVE_HAS_VNNI
void interleaved_linear(const at::BFloat16* x, int64_t M, const Segments& w, const at::BFloat16* bias, bool silu_mul,
                        ActivationCode code, at::BFloat16* out, int64_t ld) {
  const int64_t N = w.rows(), width = silu_mul ? N / 2 : N;
  const ChunkActivations xa(x, M, w.K, code);
  parallel_range(0, width / 16, 1, [&](int64_t g0, int64_t g1) {
    static thread_local std::vector<float> results;  // [2 (gate, up)][M][16]
    if (static_cast<int64_t>(results.size()) < 2 * M * 16) results.resize(2 * M * 16);
    float* const first = results.data();
    float* const second = results.data() + M * 16;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = 16 * g;
      products_of_rows(w, n, xa, M, first);
      if (!silu_mul) {
        const __m512 b = bias ? load16(bias + n) : _mm512_setzero_ps();
        for (int64_t i = 0; i < M; ++i) store16_bf16(out + i * ld + n, _mm512_add_ps(_mm512_loadu_ps(first + 16 * i), b));
        continue;
      }
      products_of_rows(w, N / 2 + n, xa, M, second);
      for (int64_t i = 0; i < M; ++i)
        store16_silu_mul(out + i * ld + n, _mm512_loadu_ps(first + 16 * i), _mm512_loadu_ps(second + 16 * i));
    }
  });
}

void interleaved_dequantize_tiles(int64_t type, const uint8_t* group, int64_t K, at::BFloat16* tiles) {
  with_type(type, [&](auto tag) { dequantize_tiles<decltype(tag)::value>(group, K, tiles); });
}
#endif

}  // namespace kvserve
