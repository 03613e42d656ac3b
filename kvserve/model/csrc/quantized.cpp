// Projections on weights kept in their GGUF block formats: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), bf16 in
// and out, W given as row segments (a fused QKV weight may hold Q and K in one format and V in another).
//
// Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32) and Q4_K, Q5_K, Q6_K (super-blocks of 256). Every
// format is read through one decoder per 32-weight chunk that yields the chunk's weights as 32 unsigned
// bytes q and, for each half of 16, a scale d and an offset m with w = d * q + m (Q8_0's signed bytes are
// shifted by 128, Q6_K's sub-blocks of 16 are the halves). Both paths below use that decoder only:
//
// few rows (decode): the activations are quantised per chunk of 32 to int8 with one fp32 scale (as
//   llama.cpp's Q8 activation blocks), and each chunk's dot product is one VNNI dpbusd of q against them
//   (without AVX-512: AVX2's maddubs and madd, Q8_0's bytes taken signed so that no pair sum saturates);
//   the offsets are applied through the activations' per-half sums. Weights are read once, packed.
// mid widths (decode batches, up to the plan's fused limit; AVX-512 without AMX): each worker takes a panel
//   of 32 weight rows and multiplies every activation row against it while it is in cache. With
//   AVX512-BF16 the weights' integers go straight into VDPBF16PS (each chunk's scale and offset applied to
//   its partial sums: nothing is dequantised, nothing rounded to bf16); without, the panel is dequantised
//   into the packed layout and run through the widening kernel.
// many rows (prefill chunks): weight rows are dequantised a slab (~2 MB) at a time into the layout the bf16
//   projections' packed kernels read (amx_pack's tiles, which are also pack_bf16_pairs's pairs), and their
//   own matmul multiplies each slab against all the activation rows: AMX tiles, else VDPBF16PS, else
//   widening FMAs (AVX-512's, or AVX2's). Without AVX2 (or for a width not in blocks of 16) panels of rows
//   go through torch's matmul.
//
// Weights held interleaved sixteen rows at a time (quantized_interleaved.cpp, on AVX512-VNNI) take that file's
// int8 dot products up to the fused width, and the slabs below, dequantised from their groups, above it.
//
// quant_dequantize gives a tensor's values (the embedding's rows, tests, the reference path).

#include "common.h"
#include "quantized.h"
#include <ATen/TensorOperators.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/silu.h>

// The 8-lane decoders need F16C (every AVX2 CPU has it) for the fp16 scales.
#if KVSERVE_HAS_AVX2 && defined(__F16C__)
#define KVSERVE_HAS_QUANT_AVX2 1
#else
#define KVSERVE_HAS_QUANT_AVX2 0
#endif
// AVX2's int8 dot products, where there is no AVX-512 (an AVX-512 CPU without VNNI keeps the slabs: unmeasured).
#define KVSERVE_HAS_AVX2_DOTS (KVSERVE_HAS_QUANT_AVX2 && !KVSERVE_HAS_AVX512)
#define KVSERVE_HAS_INT8_DOTS (KVSERVE_HAS_VNNI || KVSERVE_HAS_AVX2_DOTS)

namespace kvserve {
namespace {

// Every format is held planar (model/quantized.py lays it out at load): per row, one part of every block
// after another, so that a chunk pair's quants, or sixteen chunks' scales, are one contiguous load.
//   blocks of 32 (nb = K / 32): every block's fp16 scale d, then (Q4_1, Q5_1) every fp16 offset m, then
//     (Q5_0, Q5_1) every 32-bit high-bit word, then every block's quants (16 bytes of nibbles, or Q8_0's 32
//     signed bytes): the file's bytes rearranged.
//   Q4_K, Q5_K (nb = K / 256): every super-block's fp16 d, every fp16 dmin, then a byte per chunk of 32 for
//     the 6-bit scales, and one for the mins (unpacked from the file's twelve bytes), (Q5_K) every 32 bytes
//     of high bits, then every 128 bytes of nibbles as in the file.
//   Q6_K: every fp16 d, every super-block's 16 signed scales (one per half chunk, in chunk order), every 128
//     bytes of low nibbles, every 64 bytes of high bit pairs.
struct Planes {
  const uint8_t* d;
  const uint8_t* m;   // blocks of 32: offsets; Q4_K, Q5_K: dmin
  const uint8_t* sc;  // K-quants: sub-block scales
  const uint8_t* mn;  // Q4_K, Q5_K: sub-block mins
  const uint8_t* qh;
  const uint8_t* qs;
};

inline Planes planes_of(int64_t type, const uint8_t* row, int64_t K) {
  Planes p{row, nullptr, nullptr, nullptr, nullptr, nullptr};
  if (type == kQ4_K || type == kQ5_K) {
    const int64_t nb = K / 256;
    p.m = row + 2 * nb;
    p.sc = row + 4 * nb;
    p.mn = row + 12 * nb;
    if (type == kQ5_K) p.qh = row + 20 * nb;
    p.qs = row + (type == kQ5_K ? 52 : 20) * nb;
    return p;
  }
  if (type == kQ6_K) {
    const int64_t nb = K / 256;
    p.sc = row + 2 * nb;
    p.qs = row + 18 * nb;
    p.qh = row + 146 * nb;
    return p;
  }
  const int64_t nb = K / 32;
  const bool offsets = type == kQ4_1 || type == kQ5_1, high = type == kQ5_0 || type == kQ5_1;
  const uint8_t* at = row + 2 * nb;
  if (offsets) { p.m = at; at += 2 * nb; }
  if (high) { p.qh = at; at += 4 * nb; }
  p.qs = at;
  return p;
}

// Chunk c of a row: its scales, and (bytes != nullptr) its 32 unsigned weight bytes. Scalar, every format;
// the vector decoders below must agree with it (the tests compare both against gguf's own dequantiser).
ChunkScales decode_chunk_scalar(int64_t type, const uint8_t* row, int64_t K, int64_t c, uint8_t* bytes) {
  ChunkScales s{};
  auto nibbles = [&](const uint8_t* qs, const uint8_t* high_bits) {  // 16 bytes: low nibbles, then high
    uint32_t qh = 0;
    if (high_bits) std::memcpy(&qh, high_bits, 4);
    for (int i = 0; i < 16; ++i) {
      bytes[i] = (qs[i] & 0xF) | (high_bits ? ((qh >> i) & 1) << 4 : 0);
      bytes[i + 16] = (qs[i] >> 4) | (high_bits ? ((qh >> (i + 16)) & 1) << 4 : 0);
    }
  };
  switch (type) {
    case kQ4_0: case kQ5_0: case kQ8_0: case kQ4_1: case kQ5_1: {
      const Planes p = planes_of(type, row, K);
      const float d = half_at(p.d + 2 * c);
      const float offset = type == kQ4_0 ? -8.f * d : type == kQ5_0 ? -16.f * d : type == kQ8_0 ? -128.f * d
                                                                                 : half_at(p.m + 2 * c);
      s = {{d, d}, {offset, offset}};
      if (!bytes) break;
      if (type == kQ8_0) {
        for (int i = 0; i < 32; ++i) bytes[i] = static_cast<uint8_t>(p.qs[32 * c + i] ^ 0x80);
      } else {
        nibbles(p.qs + 16 * c, p.qh ? p.qh + 4 * c : nullptr);
      }
      break;
    }
    case kQ4_K: case kQ5_K: {
      const Planes p = planes_of(type, row, K);
      const int64_t j = c % 8, blk = c / 8;
      const float d = half_at(p.d + 2 * blk) * p.sc[c], m = -half_at(p.m + 2 * blk) * p.mn[c];
      s = {{d, d}, {m, m}};
      if (!bytes) break;
      const uint8_t* qs = p.qs + 128 * blk + 32 * (j / 2);
      for (int i = 0; i < 32; ++i) {
        bytes[i] = (j % 2 == 0 ? qs[i] & 0xF : qs[i] >> 4);
        if (type == kQ5_K) bytes[i] |= ((p.qh[32 * blk + i] >> j) & 1) << 4;
      }
      break;
    }
    case kQ6_K: {
      const Planes p = planes_of(type, row, K);
      const int64_t j = c % 8, blk = c / 8, n = j / 4, k = j % 4;
      const float d = half_at(p.d + 2 * blk);
      const int8_t* scales = reinterpret_cast<const int8_t*>(p.sc) + 2 * c;
      s = {{d * scales[0], d * scales[1]}, {-32.f * d * scales[0], -32.f * d * scales[1]}};
      if (!bytes) break;
      const uint8_t* ql = p.qs + 128 * blk + 64 * n + 32 * (k % 2);
      const uint8_t* qh = p.qh + 64 * blk + 32 * n;
      for (int i = 0; i < 32; ++i)
        bytes[i] = static_cast<uint8_t>((k < 2 ? ql[i] & 0xF : ql[i] >> 4) | (((qh[i] >> (2 * k)) & 3) << 4));
      break;
    }
    default: TORCH_CHECK(false, "quantized: GGML type ", type, " has no kernel");
  }
  return s;
}

// A format's shape, for the vector decoders. A symmetric format's offset is -2^kOffsetShift * d (the few-row
// path applies it in the integer dot product); the others carry an offset per chunk.
template <int64_t Type>
struct Traits {
  static constexpr bool kSuper = Type == kQ4_K || Type == kQ5_K || Type == kQ6_K;  // super-blocks of 256
  static constexpr bool kSymmetric = Type == kQ4_0 || Type == kQ5_0 || Type == kQ8_0 || Type == kQ6_K;
  static constexpr int kOffsetShift = Type == kQ4_0 ? 3 : Type == kQ5_0 ? 4 : Type == kQ8_0 ? 7 : 5;
  static constexpr bool kHalfScales = Type == kQ6_K;  // a scale per half of 16 (else one per chunk)
};

#if KVSERVE_HAS_QUANT_AVX2
inline float half_bits(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// 32 bytes, byte i 0xFF where bit i of `bits` is set, else 0.
inline __m256i bytes_of_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

// The 32 weight bytes of chunk c, as decode_chunk_scalar gives them.
template <int64_t Type>
inline __m256i chunk_bytes(const Planes& p, int64_t c) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (!Traits<Type>::kSuper) {
    if constexpr (Type == kQ8_0)
      return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qs + 32 * c)),
                              _mm256_set1_epi8(static_cast<char>(0x80)));
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.qs + 16 * c));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
    if constexpr (Type == kQ5_0 || Type == kQ5_1) {
      uint32_t qh;
      std::memcpy(&qh, p.qh + 4 * c, 4);
      q = _mm256_or_si256(q, _mm256_and_si256(bytes_of_bits(qh), _mm256_set1_epi8(0x10)));
    }
    return q;
  } else {
    const int64_t j = c % 8, blk = c / 8;
    if constexpr (Type == kQ4_K || Type == kQ5_K) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qs + 128 * blk + 32 * (j / 2)));
      __m256i q = _mm256_and_si256(j % 2 == 0 ? qs : _mm256_srli_epi16(qs, 4), low4);
      if constexpr (Type == kQ5_K) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qh + 32 * blk));
        const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi64_si128(j)), _mm256_set1_epi8(1));
        q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
      }
      return q;
    } else {  // Q6_K
      const int64_t n = j / 4, k = j % 4;
      const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qs + 128 * blk + 64 * n + 32 * (k % 2)));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qh + 64 * blk + 32 * n));
      const __m256i lo = _mm256_and_si256(k < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
      const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi64_si128(2 * k)), _mm256_set1_epi8(3));
      return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
  }
}

// Eight scale slots at a time, as Format's sixteen below: the scales of eight chunks, or (Q6_K) the half
// scales of four.
template <int64_t Type>
struct Slots8 {
  static constexpr int64_t kChunks = Traits<Type>::kHalfScales ? 4 : 8;

  // The slots from chunk c0 (a multiple of kChunks) on, `live` of them in the row (a super-block format's
  // rows hold whole super-blocks, so only the blocks of 32 have a short last group): d and (asymmetric
  // formats) m; a symmetric format's m is its offset, -2^kOffsetShift * d.
  static inline void scales(const Planes& p, int64_t c0, int live, __m256* d, __m256* m) {
    using T = Traits<Type>;
    if constexpr (!T::kSuper) {
      auto halves = [&](const uint8_t* at) {  // eight fp16 values, the ones past `live` zero
        if (live == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
        alignas(16) uint16_t h[8] = {};
        std::memcpy(h, at, 2 * live);
        return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
      };
      *d = halves(p.d + 2 * c0);
      if constexpr (!T::kSymmetric) *m = halves(p.m + 2 * c0);
    } else if constexpr (Type == kQ4_K || Type == kQ5_K) {  // one super-block's eight chunks
      const int64_t blk = c0 / 8;
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.sc + c0))));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.mn + c0))));
      *d = _mm256_mul_ps(_mm256_set1_ps(half_bits(p.d + 2 * blk)), sc);
      *m = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(half_bits(p.m + 2 * blk)), mn));
    } else {  // Q6_K: half a super-block's eight signed half scales
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.sc + 2 * c0))));
      *d = _mm256_mul_ps(_mm256_set1_ps(half_bits(p.d + 2 * (c0 / 8))), sc);
    }
    if constexpr (T::kSymmetric) *m = _mm256_mul_ps(_mm256_set1_ps(-static_cast<float>(1 << T::kOffsetShift)), *d);
  }

  // The row's K values, a chunk of 32 at a time, handed to store(chunk, four runs of 8) as floats.
  template <typename Store>
  static inline void for_each_chunk(const uint8_t* row, int64_t K, const Store& store) {
    const Planes p = planes_of(Type, row, K);
    const int64_t chunks = K / 32;
    constexpr int64_t S = Traits<Type>::kHalfScales ? 2 : 1;
    alignas(32) float d[8], m[8];
    for (int64_t c0 = 0; c0 < chunks; c0 += kChunks) {
      const int64_t n = std::min(kChunks, chunks - c0);
      __m256 dv, mv;
      scales(p, c0, static_cast<int>(S * n), &dv, &mv);
      _mm256_store_ps(d, dv);
      _mm256_store_ps(m, mv);
      for (int64_t i = 0; i < n; ++i) {
        const __m256i q = chunk_bytes<Type>(p, c0 + i);
        __m256 v[4];
#pragma GCC unroll 4
        for (int e = 0; e < 4; ++e) {
          const int64_t h = S * i + (S == 2 ? e / 2 : 0);  // the slot of values 8e .. 8e + 7
          const __m128i lane = e < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
          const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e % 2 == 0 ? lane : _mm_srli_si128(lane, 8)));
          v[e] = _mm256_fmadd_ps(qf, _mm256_set1_ps(d[h]), _mm256_set1_ps(m[h]));
        }
        store(c0 + i, v);
      }
    }
  }
};
#endif

#if KVSERVE_HAS_AVX512
// One format, vectorised: its chunks' scales, and the weight bytes of one chunk (32) or of a chunk pair
// (64, chunks c and c + 1 for an even c).
template <int64_t Type>
struct Format : Traits<Type> {
  using Traits<Type>::kSuper;
  using Traits<Type>::kSymmetric;
  using Traits<Type>::kOffsetShift;
  using Traits<Type>::kHalfScales;
  // Scales come sixteen at a time: sixteen chunks' scales, or (Q6_K) the half scales of eight chunks.
  static constexpr int64_t kSlotChunks = kHalfScales ? 8 : 16;

  // The sixteen scale slots from chunk c0 (a multiple of kSlotChunks) on, `live` of them in the row: each
  // slot's d and (asymmetric formats) its chunk's offset m.
  static inline void slot_scales(const Planes& p, int64_t c0, __mmask16 live, __m512* d, __m512* m) {
    if constexpr (!kSuper) {
      *d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, p.d + 2 * c0));
      if constexpr (!kSymmetric) *m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, p.m + 2 * c0));
    } else if constexpr (Type == kQ4_K || Type == kQ5_K) {
      // Chunks c0 .. c0 + 15 are super-blocks c0 / 8 and c0 / 8 + 1: their d (dmin) spread over 8 lanes each.
      const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
      const __mmask8 blocks = live > 0xFF ? 0x3 : 0x1;
      const __m512 dd = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_cvtph_ps(
          _mm_maskz_loadu_epi16(blocks, p.d + c0 / 4))));
      const __m512 dmin = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_cvtph_ps(
          _mm_maskz_loadu_epi16(blocks, p.m + c0 / 4))));
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, p.sc + c0)));
      const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, p.mn + c0)));
      *d = _mm512_mul_ps(dd, sc);
      *m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, mn));
    } else {  // Q6_K: super-block c0 / 8's sixteen signed half scales
      const __m512 dd = _mm512_set1_ps(half_bits(p.d + c0 / 4));
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.sc + 2 * c0))));
      *d = _mm512_mul_ps(dd, sc);
    }
  }

  static inline __m256i bytes(const Planes& p, int64_t c) { return chunk_bytes<Type>(p, c); }

  // 64 weight bytes of chunks c and c + 1 (c even): each format's pair is one or two contiguous loads.
  static inline __m512i pair_bytes(const Planes& p, int64_t c) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    // 128-bit lanes [a, a, b, b] of a 256-bit v = [a, b], the odd lanes' 16-bit words shifted right by 4:
    // the low then the high nibbles of each half of v.
    auto nibble_halves = [&](__m256i v) {
      const __m512i wide = _mm512_castsi256_si512(v);
      const __m512i lanes = _mm512_shuffle_i64x2(wide, wide, _MM_SHUFFLE(1, 1, 0, 0));
      return _mm512_and_si512(_mm512_mask_srli_epi16(lanes, 0xFF00FF00u, lanes, 4), low4);
    };
    // [v, v] with the upper copy's 16-bit words shifted right by `upper`: two chunks from one plane.
    auto twice = [](__m256i v, unsigned lower, unsigned upper) {
      const __m512i wide = _mm512_inserti64x4(_mm512_castsi256_si512(v), v, 1);
      return _mm512_srlv_epi16(wide, _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(lower)),
                                                        _mm256_set1_epi16(static_cast<short>(upper)), 1));
    };
    if constexpr (!kSuper) {
      if constexpr (Type == kQ8_0)
        return _mm512_xor_si512(_mm512_loadu_si512(p.qs + 32 * c), _mm512_set1_epi8(static_cast<char>(0x80)));
      __m512i q = nibble_halves(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qs + 16 * c)));
      if constexpr (Type == kQ5_0 || Type == kQ5_1) {
        uint64_t qh;
        std::memcpy(&qh, p.qh + 4 * c, 8);
        q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(qh, _mm512_set1_epi8(0x10)));
      }
      return q;
    } else {
      const int64_t j = c % 8, blk = c / 8;
      if constexpr (Type == kQ4_K || Type == kQ5_K) {
        const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qs + 128 * blk + 32 * (j / 2)));
        __m512i q = _mm512_and_si512(twice(qs, 0, 4), low4);
        if constexpr (Type == kQ5_K) {
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qh + 32 * blk));
          const __m512i bits = _mm512_and_si512(twice(qh, j, j + 1), _mm512_set1_epi8(1));
          q = _mm512_or_si512(q, _mm512_slli_epi16(bits, 4));
        }
        return q;
      } else {  // Q6_K: chunks 4n + k and 4n + k + 1, k even
        const int64_t n = j / 4, k = j % 4;
        __m512i lo = _mm512_loadu_si512(p.qs + 128 * blk + 64 * n);
        if (k == 2) lo = _mm512_srli_epi16(lo, 4);
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qh + 64 * blk + 32 * n));
        const __m512i hi = _mm512_and_si512(twice(qh, 2 * k, 2 * k + 2), _mm512_set1_epi8(3));
        return _mm512_or_si512(_mm512_and_si512(lo, low4), _mm512_slli_epi16(hi, 4));
      }
    }
  }

  // The row's K values, a chunk of 32 at a time, handed to store(chunk, first 16, last 16) as floats.
  template <typename Store>
  static inline void for_each_chunk(const uint8_t* row, int64_t K, const Store& store) {
    const Planes p = planes_of(Type, row, K);
    const int64_t chunks = K / 32;
    const __m512 shift = _mm512_set1_ps(-static_cast<float>(1 << kOffsetShift));
    alignas(64) float d[16], m[16];
    for (int64_t c0 = 0; c0 < chunks; c0 += kSlotChunks) {
      const int64_t n = std::min(kSlotChunks, chunks - c0);
      const __mmask16 live = static_cast<__mmask16>((1u << (kHalfScales ? 2 * n : n)) - 1);
      __m512 dv, mv = _mm512_setzero_ps();
      slot_scales(p, c0, live, &dv, &mv);
      _mm512_store_ps(d, dv);
      _mm512_store_ps(m, kSymmetric ? _mm512_mul_ps(shift, dv) : mv);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t lo = kHalfScales ? 2 * i : i, hi = kHalfScales ? 2 * i + 1 : i;
        const __m256i q = bytes(p, c0 + i);
        const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
        const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
        store(c0 + i, _mm512_fmadd_ps(q0, _mm512_set1_ps(d[lo]), _mm512_set1_ps(m[lo])),
              _mm512_fmadd_ps(q1, _mm512_set1_ps(d[hi]), _mm512_set1_ps(m[hi])));
      }
    }
  }
};
#endif

// One row of K weights as floats.
void dequantize_row(int64_t type, const uint8_t* row, int64_t K, float* out) {
#if KVSERVE_HAS_AVX512
  with_type(type, [&](auto tag) {
    Format<decltype(tag)::value>::for_each_chunk(row, K, [&](int64_t c, __m512 lo, __m512 hi) {
      _mm512_storeu_ps(out + 32 * c, lo);
      _mm512_storeu_ps(out + 32 * c + 16, hi);
    });
  });
#elif KVSERVE_HAS_QUANT_AVX2
  with_type(type, [&](auto tag) {
    Slots8<decltype(tag)::value>::for_each_chunk(row, K, [&](int64_t c, const __m256* v) {
      for (int e = 0; e < 4; ++e) _mm256_storeu_ps(out + 32 * c + 8 * e, v[e]);
    });
  });
#else
  uint8_t q[32];
  for (int64_t c = 0; c < K / 32; ++c) {
    const ChunkScales s = decode_chunk_scalar(type, row, K, c, q);
    for (int i = 0; i < 32; ++i) out[32 * c + i] = s.d[i / 16] * q[i] + s.m[i / 16];
  }
#endif
}

// One row of K weights as bf16.
void dequantize_row_bf16(int64_t type, const uint8_t* row, int64_t K, at::BFloat16* out) {
#if KVSERVE_HAS_AVX512
  with_type(type, [&](auto tag) {
    Format<decltype(tag)::value>::for_each_chunk(row, K, [&](int64_t c, __m512 lo, __m512 hi) {
#if KVSERVE_HAS_AVX512_BF16
      _mm512_storeu_si512(out + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
      store16_bf16(out + 32 * c, lo);
      store16_bf16(out + 32 * c + 16, hi);
#endif
    });
  });
#elif KVSERVE_HAS_QUANT_AVX2
  with_type(type, [&](auto tag) {
    Slots8<decltype(tag)::value>::for_each_chunk(row, K, [&](int64_t c, const __m256* v) {
      for (int e = 0; e < 4; ++e) store8_bf16(out + 32 * c + 8 * e, v[e]);
    });
  });
#else
  std::vector<float> values(K);
  dequantize_row(type, row, K, values.data());
  for (int64_t k = 0; k < K; ++k) out[k] = at::BFloat16(values[k]);
#endif
}

// ------------------------------------------------------------------------------------------------------
// Few rows: int8 activations, VNNI (or AVX2) dot products.
// ------------------------------------------------------------------------------------------------------
#if KVSERVE_HAS_INT8_DOTS
constexpr int64_t kGemvTile = 4;  // activation rows per pass over the weight rows
constexpr int kGemvRows = 4;  // weight rows per pass, at most
constexpr int64_t kMaxChunks = 1024;  // the few-row path's widest input: 32K values
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the row in hand the few-row path fetches

// x rows quantised per chunk of 32: q = round(x / scale), scale = max|x| / 127. Per chunk also: sums, the
// negated sums of q over each half of 16 in lanes 0 and 4 of 8 (a symmetric format's offset enters the
// integer dot product through them), and scale * sum(q) (what an asymmetric format's offset multiplies).
struct QuantizedActivations {
  std::vector<int8_t> q;
  std::vector<int32_t> neg_half_sums;  // [M, chunks, 8]
  std::vector<float> scale, scaled_sums;
  int64_t chunks;

  QuantizedActivations(const at::BFloat16* x, int64_t M, int64_t K)
      : q(M * K), neg_half_sums(M * K / 4, 0), scale(M * (K / 32)), scaled_sums(M * (K / 32)), chunks(K / 32) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < chunks; ++c) {
        const at::BFloat16* xc = x + m * K + 32 * c;
#if KVSERVE_HAS_AVX2_DOTS
        __m256 v[4];
        __m256 amax8 = _mm256_setzero_ps();
        for (int e = 0; e < 4; ++e) {
          v[e] = load8(xc + 8 * e);
          amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[e]));
        }
        const float amax = hmax8(amax8);
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        __m256i qi[4];
        for (int e = 0; e < 4; ++e) qi[e] = _mm256_cvtps_epi32(_mm256_mul_ps(v[e], _mm256_set1_ps(inv)));
        // Saturating packs work within 128-bit lanes: the dwords come out as 0, 2, 4, 6 | 1, 3, 5, 7 of the
        // order wanted.
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + m * K + 32 * c),
                            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const int32_t sa = reduce_add8_epi32(_mm256_add_epi32(qi[0], qi[1]));
        const int32_t sb = reduce_add8_epi32(_mm256_add_epi32(qi[2], qi[3]));
#else
        const __m512 a = load16(xc), b = load16(xc + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        int8_t* dst = q.data() + m * K + 32 * c;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qb));
        const int32_t sa = _mm512_reduce_add_epi32(qa), sb = _mm512_reduce_add_epi32(qb);
#endif
        const int64_t i = m * chunks + c;
        scale[i] = d;
        scaled_sums[i] = d * static_cast<float>(sa + sb);
        neg_half_sums[8 * i] = -sa;
        neg_half_sums[8 * i + 4] = -sb;
      }
  }
};

#if KVSERVE_HAS_AVX2_DOTS
// out[i][j] = dot(weight row j, activation row m0 + i) for MT activation rows and NT consecutive weight rows
// (`stride` bytes apart), as the VNNI tile below computes it, a chunk per step: maddubs multiplies the
// unsigned weight bytes by the signed activations and adds neighbours (no pair can saturate: below 64 for
// every format but Q8_0, whose bytes are taken as the signed values they are, with the signs moved onto the
// activations), madd sums them into the chunk's halves.
template <int64_t Type, int MT, int NT>
inline void dot_tile(const uint8_t* row0, int64_t stride, int64_t ahead, const QuantizedActivations& xq, int64_t m0,
                     int64_t K, float out[kGemvTile][kGemvRows]) {
  using F = Traits<Type>;
  constexpr bool kSigned = Type == kQ8_0;
  constexpr int64_t S = F::kHalfScales ? 2 : 1;
  constexpr int64_t kSlotChunks = Slots8<Type>::kChunks;
  const int64_t chunks = xq.chunks;
  alignas(32) float scales[MT][NT][kMaxChunks * 2 + 8];
  Planes p[NT];
  __m256 acc[MT][NT];
#pragma GCC unroll 4
  for (int j = 0; j < NT; ++j) {
    p[j] = planes_of(Type, row0 + j * stride, K);
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) acc[i][j] = _mm256_setzero_ps();
  }
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t c0 = 0; c0 < chunks; c0 += kSlotChunks) {
    const int live = static_cast<int>(S * std::min(kSlotChunks, chunks - c0));
    const __m256i live_mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), lanes);
    __m256 xs[MT];
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) {
      const float* at = xq.scale.data() + (m0 + i) * chunks + c0;
      if constexpr (S == 2)  // four chunks, each scale over its two halves
        xs[i] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(at)), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
      else
        xs[i] = _mm256_maskload_ps(at, live_mask);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) {
      __m256 d, m;
      Slots8<Type>::scales(p[j], c0, live, &d, &m);
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) {
        _mm256_storeu_ps(scales[i][j] + S * c0, _mm256_mul_ps(d, xs[i]));
        if constexpr (!F::kSymmetric)
          acc[i][j] = _mm256_fmadd_ps(m, _mm256_maskload_ps(xq.scaled_sums.data() + (m0 + i) * chunks + c0, live_mask),
                                      acc[i][j]);
      }
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  // The next rows stream in as this tile's are read: a line or so of each per chunk.
  const int64_t fetch_step = (stride + chunks - 1) / chunks;
  const uint8_t* fetch = row0 + ahead;
  for (int64_t c = 0; c < chunks; ++c, fetch += fetch_step) {
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(fetch + j * stride), _MM_HINT_T0);
      __m256i q;
      if constexpr (kSigned) q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[j].qs + 32 * c));
      else q = chunk_bytes<Type>(p[j], c);
      const __m256i magnitudes = kSigned ? _mm256_sign_epi8(q, q) : q;
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) {
        const int64_t r = (m0 + i) * chunks + c;
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + (m0 + i) * K + 32 * c));
        if constexpr (kSigned) xv = _mm256_sign_epi8(xv, q);
        __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, xv), ones);
        if constexpr (F::kSymmetric && !kSigned)
          dot = _mm256_add_epi32(dot, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                            xq.neg_half_sums.data() + 8 * r)), F::kOffsetShift));
        const float* sc = scales[i][j] + S * c;
        const __m256 scale = S == 2 ? _mm256_setr_m128(_mm_set1_ps(sc[0]), _mm_set1_ps(sc[S - 1]))
                                    : _mm256_broadcast_ss(sc);
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i][j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) out[i][j] = reduce_add8(acc[i][j]);
}
#else
// out[i][j] = dot(weight row j, activation row m0 + i) for MT activation rows and NT consecutive weight rows
// (`stride` bytes apart). A first pass over each weight row's scales gathers each chunk's (half's) weight
// scale times the activation chunk's, and the asymmetric offsets' products; the second runs two chunks per
// 512-bit dpbusd, the NT rows side by side so that their loads are in flight together, and fetches the
// rows `ahead` bytes on as it goes.
template <int64_t Type, int MT, int NT>
inline void dot_tile(const uint8_t* row0, int64_t stride, int64_t ahead, const QuantizedActivations& xq, int64_t m0,
                     int64_t K, float out[kGemvTile][kGemvRows]) {
  using F = Format<Type>;
  const int64_t chunks = xq.chunks;
  // scales[i][j][S * c + h]: chunk c's (half h's) weight scale times activation row i's chunk scale.
  constexpr int64_t S = F::kHalfScales ? 2 : 1;
  alignas(64) float scales[MT][NT][kMaxChunks * 2];
  Planes p[NT];
  __m512 acc[MT][NT];  // lane sums of the dot products, and of the asymmetric offsets' products
#pragma GCC unroll 4
  for (int j = 0; j < NT; ++j) {
    p[j] = planes_of(Type, row0 + j * stride, K);
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) acc[i][j] = _mm512_setzero_ps();
  }
  // Chunk i of a slot group's activation scales in slots 2i and 2i + 1 (Q6_K's halves).
  const __m512i halves = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  for (int64_t c0 = 0; c0 < chunks; c0 += F::kSlotChunks) {
    const int64_t n = std::min(F::kSlotChunks, chunks - c0);
    const __mmask16 live = static_cast<__mmask16>((1u << (S * n)) - 1);
    __m512 xs[MT];
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) {
      const int64_t r = (m0 + i) * chunks + c0;
      if constexpr (S == 2) xs[i] = _mm512_permutexvar_ps(halves, _mm512_castps256_ps512(_mm256_loadu_ps(xq.scale.data() + r)));
      else xs[i] = _mm512_maskz_loadu_ps(live, xq.scale.data() + r);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) {
      __m512 d, m = _mm512_setzero_ps();
      F::slot_scales(p[j], c0, live, &d, &m);
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) {
        _mm512_mask_storeu_ps(scales[i][j] + S * c0, live, _mm512_mul_ps(d, xs[i]));
        if constexpr (!F::kSymmetric) {
          const __m512 sums = _mm512_maskz_loadu_ps(live, xq.scaled_sums.data() + (m0 + i) * chunks + c0);
          acc[i][j] = _mm512_fmadd_ps(m, sums, acc[i][j]);
        }
      }
    }
  }
  // The scales of a chunk pair over its 16 dot lanes: S == 2, lanes 4h .. 4h + 3 <- element h of 4; S == 1,
  // lanes 8h .. 8h + 7 <- element h of 2.
  const __m512i spread = S == 2 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  auto pair_scales = [&](const float* at) {
    if constexpr (S == 2) return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(at)));
    else return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(at)))));
  };
  // The next rows stream in as this tile's are read: a line or so of each per chunk pair.
  const int64_t fetch_step = (2 * stride + chunks - 1) / chunks;
  const uint8_t* fetch = row0 + ahead;
  int64_t c = 0;
  for (; c + 2 <= chunks; c += 2) {
    __m512i init[MT];
#pragma GCC unroll 4
    for (int i = 0; i < MT; ++i) {
      init[i] = _mm512_setzero_si512();
      if constexpr (F::kSymmetric)
        init[i] = _mm512_slli_epi32(_mm512_loadu_si512(xq.neg_half_sums.data() + 8 * ((m0 + i) * chunks + c)), F::kOffsetShift);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(fetch + j * stride), _MM_HINT_T0);
      const __m512i q = F::pair_bytes(p[j], c);
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) {
        const __m512i dot = _mm512_dpbusd_epi32(init[i], q, _mm512_loadu_si512(xq.q.data() + (m0 + i) * K + 32 * c));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), pair_scales(scales[i][j] + S * c), acc[i][j]);
      }
    }
    fetch += fetch_step;
  }
  if (c < chunks) {  // an odd last chunk
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) {
      const __m512i q = _mm512_castsi256_si512(F::bytes(p[j], c));
#pragma GCC unroll 4
      for (int i = 0; i < MT; ++i) {
        const int64_t r = (m0 + i) * chunks + c;
        __m512i init = _mm512_setzero_si512();
        if constexpr (F::kSymmetric)
          init = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(0xFF, xq.neg_half_sums.data() + 8 * r), F::kOffsetShift);
        const __m512i xv = _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xq.q.data() + (m0 + i) * K + 32 * c);
        const __m512i dot = _mm512_dpbusd_epi32(init, q, xv);
        const __m512 scale = _mm512_permutexvar_ps(
            spread, _mm512_castps128_ps512(_mm_setr_ps(scales[i][j][S * c], scales[i][j][S * c + S - 1], 0.f, 0.f)));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i][j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

#endif

template <int64_t Type, int NT>
inline void dot_tiles(const uint8_t* row0, int64_t stride, int64_t ahead, const QuantizedActivations& xq,
                      int64_t m0, int64_t mt, int64_t K, float out[kGemvTile][kGemvRows]) {
  switch (mt) {
    case 1: dot_tile<Type, 1, NT>(row0, stride, ahead, xq, m0, K, out); break;
    case 2: dot_tile<Type, 2, NT>(row0, stride, ahead, xq, m0, K, out); break;
    case 3: dot_tile<Type, 3, NT>(row0, stride, ahead, xq, m0, K, out); break;
    default: dot_tile<Type, 4, NT>(row0, stride, ahead, xq, m0, K, out); break;
  }
}

void gemv_quantized(const at::BFloat16* x, int64_t M, const Segments& w, const at::BFloat16* bias, at::BFloat16* out) {
  const int64_t K = w.K, N = w.rows();
  const QuantizedActivations xq(x, M, K);
  // AVX2 has 16 vector registers: four weight rows at a time for up to two activation rows, else two.
  const int64_t rows_per_pass = KVSERVE_HAS_AVX2_DOTS && M > 2 ? 2 : kGemvRows;
  parallel_range(0, N, 16, [&](int64_t n0, int64_t n1) {
    float res[kGemvTile][kGemvRows];
    // Segment by segment, so that the format is dispatched once per run of rows, not per row.
    for (int64_t s = w.segment_of(n0), n = n0; n < n1; ++s) {
      const int64_t end = std::min(n1, w.starts[s + 1]);
      const int64_t stride = w.row_bytes[s];
      // The rows stream from memory (a model's weights do not fit in cache): the tiles fetch a few KB
      // ahead as they compute; the hardware prefetcher alone left much of the bandwidth unused.
      const int64_t ahead = std::max<int64_t>(1, (kPrefetchBytes + rows_per_pass * stride - 1) / (rows_per_pass * stride)) *
                            rows_per_pass * stride;
      with_type(w.types[s], [&](auto tag) {
        constexpr int64_t Type = decltype(tag)::value;
        for (; n < end;) {
          const int64_t nt = end - n >= rows_per_pass ? rows_per_pass : 1;
          const uint8_t* row = w.row(s, n);
          for (int64_t m0 = 0; m0 < M; m0 += kGemvTile) {
            const int64_t mt = std::min<int64_t>(kGemvTile, M - m0);
            if (nt == kGemvRows) dot_tiles<Type, kGemvRows>(row, stride, ahead, xq, m0, mt, K, res);
#if KVSERVE_HAS_AVX2_DOTS
            else if (nt == 2) dot_tiles<Type, 2>(row, stride, ahead, xq, m0, mt, K, res);
#endif
            else dot_tiles<Type, 1>(row, stride, ahead, xq, m0, mt, K, res);
            for (int64_t i = 0; i < mt; ++i)
              for (int64_t j = 0; j < nt; ++j)
                out[(m0 + i) * N + n + j] =
                    at::BFloat16(res[i][j] + (bias ? static_cast<float>(bias[n + j]) : 0.f));
          }
          n += nt;
        }
      });
    }
  });
}
#endif

// ------------------------------------------------------------------------------------------------------
// Many rows: weight slabs dequantised to bf16, multiplied by the packed projections' kernels (or by torch).
// ------------------------------------------------------------------------------------------------------
constexpr int64_t kPanelRows = 32;
constexpr int64_t kSlabBytes = 2 * 1024 * 1024;  // the many-row path's dequantised weight rows at a time

// Rows of the panel, [rows][K]: panel row r holds global weight row row_of(r) (-1: zeros, past the end).
template <typename RowOf>
void fill_panel(const Segments& w, const RowOf& row_of, int64_t rows, at::BFloat16* panel) {
  const int64_t K = w.K;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = row_of(r);
    if (n < 0) {
      std::memset(panel + r * K, 0, K * sizeof(at::BFloat16));
      continue;
    }
    const int64_t s = w.segment_of(n);
    dequantize_row_bf16(w.types[s], w.row(s, n), K, panel + r * K);
  }
}

// Output column n of panel row r for the plain projection, and the gate row of the fused gate/up one: the
// panel holds gate rows j0..j0+15 in its first half and the matching up rows in its second.
struct PanelRows {
  int64_t N;      // weight rows
  bool silu_mul;  // [gate | up]: panel p covers gate and up rows of output columns 16p .. 16p + 15
  int64_t panels() const { return silu_mul ? (N / 2 + 15) / 16 : (N + kPanelRows - 1) / kPanelRows; }
  int64_t row_of(int64_t p, int64_t r) const {
    if (!silu_mul) {
      const int64_t n = p * kPanelRows + r;
      return n < N ? n : -1;
    }
    const int64_t j = p * 16 + r % 16;
    return j < N / 2 ? j + (r < 16 ? 0 : N / 2) : -1;
  }
};


#if KVSERVE_HAS_AVX512
// A chunk's 32 values as bf16 pairs: values 0-15 from lo, 16-31 from hi, rounded as dequantize_row_bf16 rounds.
inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
#if KVSERVE_HAS_AVX512_BF16
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
#else
  return _mm512_inserti64x4(_mm512_castsi256_si512(cvt16_bf16(lo)), cvt16_bf16(hi), 1);
#endif
}

// 16 consecutive weight rows of one format (`stride` bytes apart) dequantised straight into packed tiles: a
// chunk's 16 rows become bf16 pairs in registers and one transpose writes the chunk's tile, with no row
// buffer between (the values of dequantize_row_bf16, computed the same way). The 16 rows after them (what
// the worker takes next) are fetched as it goes: read 16 at once, the rows' planes are more streams than the
// hardware prefetcher follows.
template <int64_t Type>
void dequantize_rows16_packed(const uint8_t* row0, int64_t stride, int64_t K, at::BFloat16* tiles) {
  using F = Format<Type>;
  const int64_t chunks = K / 32;
  const int64_t fetch_step = (16 * stride + chunks - 1) / chunks;
  const uint8_t* fetch = row0 + 16 * stride;
  const __m512 shift = _mm512_set1_ps(-static_cast<float>(1 << F::kOffsetShift));
  Planes p[16];
  for (int n = 0; n < 16; ++n) p[n] = planes_of(Type, row0 + n * stride, K);
  alignas(64) float d[16][16], m[16][16];  // per row, the slot group's scales and offsets
  for (int64_t c0 = 0; c0 < chunks; c0 += F::kSlotChunks) {
    const int64_t nc = std::min(F::kSlotChunks, chunks - c0);
    const __mmask16 live = static_cast<__mmask16>((1u << (F::kHalfScales ? 2 * nc : nc)) - 1);
    for (int n = 0; n < 16; ++n) {
      __m512 dv, mv = _mm512_setzero_ps();
      F::slot_scales(p[n], c0, live, &dv, &mv);
      _mm512_store_ps(d[n], dv);
      _mm512_store_ps(m[n], F::kSymmetric ? _mm512_mul_ps(shift, dv) : mv);
    }
    for (int64_t i = 0; i < nc; ++i) {
      for (int64_t b = 0; b < fetch_step; b += 64) _mm_prefetch(reinterpret_cast<const char*>(fetch + b), _MM_HINT_T0);
      fetch += fetch_step;
      const int64_t lo = F::kHalfScales ? 2 * i : i, hi = F::kHalfScales ? 2 * i + 1 : i;
      __m512i pairs[16];
      for (int n = 0; n < 16; ++n) {
        const __m256i q = F::bytes(p[n], c0 + i);
        const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
        const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
        pairs[n] = bf16_pairs(_mm512_fmadd_ps(q0, _mm512_set1_ps(d[n][lo]), _mm512_set1_ps(m[n][lo])),
                              _mm512_fmadd_ps(q1, _mm512_set1_ps(d[n][hi]), _mm512_set1_ps(m[n][hi])));
      }
      transpose16_epi32(pairs, reinterpret_cast<uint32_t*>(tiles + (c0 + i) * 512));
    }
  }
}
#endif

#if KVSERVE_HAS_AVX512 || KVSERVE_HAS_QUANT_AVX2
// n-block b (16 weight rows) of panel p, rows 16 (b % 2) .. of it, dequantised into the layout amx_pack gives
// bf16 weights (a block's 16 rows as pairs of k side by side, which pack_bf16_pairs's kernels read too): KB
// tiles of 512 values at `tiles`. `rows` is a scratch of 16 x K values.
void dequantize_block(const Segments& w, const PanelRows& layout, int64_t p, int64_t half, at::BFloat16* rows,
                      at::BFloat16* tiles) {
  const int64_t K = w.K, KB = K / 32;
#if KVSERVE_HAS_AVX512
  // 16 consecutive rows of one segment (every block of the models' weights): straight into the tiles.
  const int64_t first = layout.row_of(p, 16 * half), last = layout.row_of(p, 16 * half + 15);
#if KVSERVE_HAS_VNNI
  if (w.interleaved) {  // every block is a group: whole groups per segment, N and N / 2 multiples of 16
    const int64_t s = w.segment_of(first);
    interleaved_dequantize_tiles(w.types[s], w.row(s, first), K, tiles);
    return;
  }
#endif
  if (first >= 0 && last == first + 15) {
    const int64_t s = w.segment_of(first);
    if (last < w.starts[s + 1]) {
      with_type(w.types[s], [&](auto tag) {
        dequantize_rows16_packed<decltype(tag)::value>(w.row(s, first), w.row_bytes[s], K, tiles);
      });
      return;
    }
  }
#endif
  fill_panel(w, [&](int64_t r) { return layout.row_of(p, 16 * half + r); }, 16, rows);
  for (int64_t kb = 0; kb < KB; ++kb) {
#if KVSERVE_HAS_AVX512
    __m512i pairs[16];  // row n's 16 column pairs of this block; transposed, the tile's 16 pair rows
    for (int64_t n = 0; n < 16; ++n) pairs[n] = _mm512_loadu_si512(rows + n * K + kb * 32);
    transpose16_epi32(pairs, reinterpret_cast<uint32_t*>(tiles + kb * 512));
#else
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(rows) + kb * 16;
    uint32_t* tile = reinterpret_cast<uint32_t*>(tiles + kb * 512);
    for (int64_t n = 0; n < 16; ++n)
      for (int64_t q = 0; q < 16; ++q) tile[q * 16 + n] = pairs[n * (K / 2) + q];
#endif
  }
}

// A worker's 16 dequantised rows, kept from call to call: a fresh buffer per slab cost as much as the
// dequantisation (its zero fill and page faults).
at::BFloat16* row_scratch(int64_t K) {
  static thread_local std::vector<at::BFloat16> rows;
  if (static_cast<int64_t>(rows.size()) < 16 * K) rows.resize(16 * K);
  return rows.data();
}

// The n-blocks of panel p that hold weight rows (a plain projection's last panel may hold one).
int64_t panel_blocks(const PanelRows& layout, int64_t p) {
  return layout.silu_mul ? 2 : std::min<int64_t>(2, (layout.N - p * kPanelRows + 15) / 16);
}

// The weight a slab at a time: each slab's rows dequantised into the packed layout (in parallel), then the
// bf16 projections' own matmul over all the activation rows: on the AMX tiles when `amx`, else on
// pack_bf16_pairs's kernels. x_wide is x in fp32 for the widening kernels (AVX-512 without AVX512-BF16, AVX2;
// else unused). A slab is sized to stay in L2 / L3, so the matmul reads it as fast as it reads a packed bf16
// weight from memory. Needs whole blocks of 16 output columns (N % 16 == 0; N / 2 for the fused gate/up).
void matmul_slabs(const at::BFloat16* x, const float* x_wide, int64_t M, const Segments& w, const PanelRows& layout,
                  const at::BFloat16* bias, at::BFloat16* out, int64_t ld, bool amx) {
  const int64_t K = w.K, KB = K / 32, panels = layout.panels();
  // A slab is ~2 MB of rows, but at least four panels a thread: the matmul shares a slab out in tasks of four
  // pairs of n-blocks (a panel's two), so a slab of fewer left a thread idle.
  const int64_t per_slab = std::max<int64_t>(4 * kernel_threads(), kSlabBytes / (kPanelRows * K * 2));
  static thread_local std::vector<at::BFloat16> slab;
  if (static_cast<int64_t>(slab.size()) < per_slab * kPanelRows * K) slab.resize(per_slab * kPanelRows * K);
  at::BFloat16* const slab_data = slab.data();  // the calling thread's buffer (the workers fill it)
  for (int64_t p0 = 0; p0 < panels; p0 += per_slab) {
    const int64_t np = std::min(per_slab, panels - p0);
    // n-block b of the slab: panel p0 + b / 2, its rows 16 (b % 2) ..; past the end of N it is not used.
    const int64_t first_row = layout.silu_mul ? 0 : p0 * kPanelRows;
    const int64_t blocks = layout.silu_mul ? 2 * np : std::min<int64_t>(2 * np, (layout.N - first_row + 15) / 16);
    parallel_range(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      at::BFloat16* const rows = row_scratch(K);
      for (int64_t b = b0; b < b1; ++b) dequantize_block(w, layout, p0 + b / 2, b % 2, rows, slab_data + b * KB * 512);
    });
    const int64_t col0 = layout.silu_mul ? p0 * 16 : first_row;
#if !KVSERVE_HAS_AVX512
    avx2_matmul_packed(x_wide, M, slab_data, blocks, K, out + col0, ld, bias ? bias + col0 : nullptr, layout.silu_mul);
    (void)amx;
    (void)x;
#else
    if (amx)
      amx_matmul_packed(x, M, slab_data, blocks, KB, out + col0, ld, bias ? bias + col0 : nullptr, layout.silu_mul);
    else
      avx512_matmul_packed(x, x_wide, M, slab_data, blocks, K, out + col0, ld, bias ? bias + col0 : nullptr,
                           layout.silu_mul);
#endif
  }
}
#endif

#if KVSERVE_HAS_AVX512
// Mid widths (a decode batch) where matmul_int_weights does not apply (AVX-512 without AVX512-BF16, or a
// block across two segments): each worker dequantises one panel (two n-blocks: 32 weight rows, or 16 gate
// rows with their up rows) into its own packed buffer and at once multiplies every activation row against
// it, so the dequantised weight stays in the worker's L1 / L2; the slabs write it out and read it back in a
// second parallel pass, which at a few rows costs more than the products. The same kernel as the slabs' on
// the same bytes: the same results, bit for bit.
void matmul_fused(const at::BFloat16* x, const float* x_wide, int64_t M, const Segments& w, const PanelRows& layout,
                  const at::BFloat16* bias, at::BFloat16* out, int64_t ld) {
  const int64_t K = w.K, KB = K / 32;
  parallel_range(0, layout.panels(), 1, [&](int64_t p0, int64_t p1) {
    static thread_local std::vector<at::BFloat16> panel;
    if (static_cast<int64_t>(panel.size()) < 2 * KB * 512) panel.resize(2 * KB * 512);
    at::BFloat16* const rows = row_scratch(K);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t blocks = panel_blocks(layout, p);
      for (int64_t b = 0; b < blocks; ++b) dequantize_block(w, layout, p, b, rows, panel.data() + b * KB * 512);
      const int64_t col0 = layout.silu_mul ? p * 16 : p * kPanelRows;
      avx512_matmul_packed_here(x, x_wide, M, panel.data(), blocks, K, out + col0, ld, bias ? bias + col0 : nullptr,
                                layout.silu_mul);
    }
  });
}
#endif

#if KVSERVE_HAS_AVX512_BF16
// ------------------------------------------------------------------------------------------------------
// Mid widths on AVX512-BF16 (the plan sends them here where there is no AMX): the weights' integers meet
// bf16 activations on VDPBF16PS, and each chunk's scale and offset are applied to its partial sums, so no
// weight is ever dequantised to floats.
// ------------------------------------------------------------------------------------------------------
// Every format's unsigned quant q is below 128, and 0x4300 | q is exactly the bf16 value 128 + q: one
// widening op and an OR make a chunk's 32 weights bf16, where dequantising takes eight float ops. Products
// of two bf16 values are exact in fp32, so a slot's sum S = sum (128 + q) x is as exact as fp32 sums are,
// and its weights' share d sum q x + m sum x is d S + (m - 128 d) sum x: per slot (a chunk, or Q6_K's half
// chunk) one FMA with d and one with the offset times the activations' sum over the slot. Q8_0's signed
// bytes are exact in bf16 as they are (offset 0). The weights are not rounded to bf16 at all: the results
// are nearer the exact products than the dequantising paths'.
constexpr int kIntTileRows = 12;  // activation rows x blocks per micro-tile: as many sums and accumulators

// A block of 16 weight rows made ready for the products: per chunk a tile of 16 pairs x 16 rows of bf16
// integer weights (the packed layout), and per slot each row's scale and offset.
struct IntBlock {
  std::vector<uint32_t> tiles;  // [chunks][16 pairs][16 rows]
  std::vector<float> d, off;    // [slots (+ a group's spare)][16 rows]
};

template <int64_t Type>
void prepare_int_block(const uint8_t* row0, int64_t stride, int64_t K, IntBlock& block) {
  using F = Format<Type>;
  constexpr int64_t S = F::kHalfScales ? 2 : 1;
  const int64_t chunks = K / 32;
  block.tiles.resize(chunks * 256);
  block.d.resize((S * chunks + 16) * 16);
  block.off.resize((S * chunks + 16) * 16);
  const __m512 shift = _mm512_set1_ps(-static_cast<float>(1 << F::kOffsetShift));
  const __m512 bias128 = _mm512_set1_ps(-128.f);
  const __m512i magic = _mm512_set1_epi16(0x4300);
  // The next rows (the worker's next block) are fetched as these are read, as dequantize_rows16_packed does.
  const int64_t fetch_step = (16 * stride + chunks - 1) / chunks;
  const uint8_t* fetch = row0 + 16 * stride;
  Planes p[16];
  for (int n = 0; n < 16; ++n) p[n] = planes_of(Type, row0 + n * stride, K);
  for (int64_t c0 = 0; c0 < chunks; c0 += F::kSlotChunks) {
    const int64_t nc = std::min(F::kSlotChunks, chunks - c0);
    const __mmask16 live = static_cast<__mmask16>((1u << (S * nc)) - 1);
    __m512i d_rows[16], off_rows[16];  // row n's sixteen slots; transposed, each slot's sixteen rows
    for (int n = 0; n < 16; ++n) {
      __m512 dv, mv = _mm512_setzero_ps();
      F::slot_scales(p[n], c0, live, &dv, &mv);
      const __m512 m = F::kSymmetric ? _mm512_mul_ps(shift, dv) : mv;
      d_rows[n] = _mm512_castps_si512(dv);
      off_rows[n] = _mm512_castps_si512(Type == kQ8_0 ? _mm512_setzero_ps() : _mm512_fmadd_ps(bias128, dv, m));
    }
    transpose16_epi32(d_rows, reinterpret_cast<uint32_t*>(block.d.data() + S * c0 * 16));
    transpose16_epi32(off_rows, reinterpret_cast<uint32_t*>(block.off.data() + S * c0 * 16));
    for (int64_t i = 0; i < nc; ++i) {
      for (int64_t b = 0; b < fetch_step; b += 64) _mm_prefetch(reinterpret_cast<const char*>(fetch + b), _MM_HINT_T0);
      fetch += fetch_step;
      __m512i pairs[16];
      for (int n = 0; n < 16; ++n) {
        if constexpr (Type == kQ8_0) {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[n].qs + 32 * (c0 + i)));
          const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
          const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
          pairs[n] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        } else {
          pairs[n] = _mm512_or_si512(_mm512_cvtepu8_epi16(F::bytes(p[n], c0 + i)), magic);
        }
      }
      transpose16_epi32(pairs, block.tiles.data() + (c0 + i) * 256);
    }
  }
}

// Rows m0 .. m0 + MR - 1 against NT blocks of one slot shape: out[j][i * 16 ..] in fp32. xp: the activations
// as bf16 pairs [M, K / 2]; xsum: their sums per slot [M, slots]. Two blocks share each broadcast activation
// pair, as the bf16 projections' tiles do.
template <int MR, int64_t S, int NT>
inline void int_block_tile(const uint32_t* xp, const float* xsum, int64_t m0, int64_t K, const IntBlock* const* blocks,
                           float* const* out) {
  constexpr int64_t kPairs = 16 / S;  // pairs of k per slot
  const int64_t half_k = K / 2, slots = S * (K / 32);
  __m512 acc[MR][NT];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint32_t* x = xp + m0 * half_k;
  const float* xs = xsum + m0 * slots;
  for (int64_t slot = 0; slot < slots; ++slot) {
    __m512 sum[MR][NT];
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
      for (int j = 0; j < NT; ++j) sum[i][j] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int64_t q = 0; q < kPairs; ++q) {
      __m512bh wv[NT];
#pragma GCC unroll 2
      for (int j = 0; j < NT; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(blocks[j]->tiles.data() + (slot * kPairs + q) * 16);
#pragma GCC unroll 12
      for (int i = 0; i < MR; ++i) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * half_k + slot * kPairs + q]));
#pragma GCC unroll 2
        for (int j = 0; j < NT; ++j) sum[i][j] = _mm512_dpbf16_ps(sum[i][j], xv, wv[j]);
      }
    }
#pragma GCC unroll 2
    for (int j = 0; j < NT; ++j) {
      const __m512 d = _mm512_loadu_ps(blocks[j]->d.data() + slot * 16);
      const __m512 off = _mm512_loadu_ps(blocks[j]->off.data() + slot * 16);
#pragma GCC unroll 12
      for (int i = 0; i < MR; ++i)
        acc[i][j] = _mm512_fmadd_ps(off, _mm512_set1_ps(xs[i * slots + slot]), _mm512_fmadd_ps(sum[i][j], d, acc[i][j]));
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int j = 0; j < NT; ++j) _mm512_storeu_ps(out[j] + (m0 + i) * 16, acc[i][j]);
}

template <int64_t S, int NT, int MR = kIntTileRows / NT>
inline void int_block_rows(const uint32_t* xp, const float* xsum, int64_t m0, int64_t rows, int64_t K,
                           const IntBlock* const* blocks, float* const* out) {
  if constexpr (MR > 1) {
    if (rows < MR) return int_block_rows<S, NT, MR - 1>(xp, xsum, m0, rows, K, blocks, out);
  }
  int_block_tile<MR, S, NT>(xp, xsum, m0, K, blocks, out);
}

// Every activation row against NT (1 or 2) prepared blocks of one slot shape (S slots a chunk): out[j][M][16]
// in fp32, in even tiles of rows.
template <int NT>
void int_block_products(const uint32_t* xp, const float* xsum, int64_t M, int64_t K, int64_t S,
                        const IntBlock* const* blocks, float* const* out) {
  constexpr int64_t kRows = kIntTileRows / NT;
  const int64_t tiles = (M + kRows - 1) / kRows, tile_rows = (M + tiles - 1) / tiles;
  for (int64_t m = 0; m < M; m += tile_rows) {
    const int64_t rows = std::min(tile_rows, M - m);
    if (S == 2) int_block_rows<2, NT>(xp, xsum, m, rows, K, blocks, out);
    else int_block_rows<1, NT>(xp, xsum, m, rows, K, blocks, out);
  }
}

// The mid-width projection: each worker takes panels (two blocks of 16 weight rows, or a gate block and its
// up block), prepares each block in its own buffers and multiplies every activation row against it. Needs
// every block inside one segment (rows in whole blocks of 16 per segment); else the caller dequantises.
void matmul_int_weights(const at::BFloat16* x, int64_t M, const Segments& w, const PanelRows& layout,
                        const at::BFloat16* bias, at::BFloat16* out, int64_t ld) {
  const int64_t K = w.K, chunks = K / 32;
  // The activations' sums per half chunk (Q6_K's slots); a chunk's sum is its two halves'.
  std::vector<float> half_sums(M * 2 * chunks), chunk_sums(M * chunks);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < chunks; ++c) {
      const at::BFloat16* xc = x + m * K + 32 * c;
      const float a = _mm512_reduce_add_ps(load16(xc)), b = _mm512_reduce_add_ps(load16(xc + 16));
      half_sums[(m * chunks + c) * 2] = a;
      half_sums[(m * chunks + c) * 2 + 1] = b;
      chunk_sums[m * chunks + c] = a + b;
    }
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  parallel_range(0, layout.panels(), 1, [&](int64_t p0, int64_t p1) {
    static thread_local IntBlock prepared[2];
    static thread_local std::vector<float> results;  // [2 blocks][M][16]
    if (static_cast<int64_t>(results.size()) < 2 * M * 16) results.resize(2 * M * 16);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t blocks = panel_blocks(layout, p);
      int64_t slots[2] = {1, 1};  // per block, its format's slots per chunk
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t first = layout.row_of(p, 16 * b), s = w.segment_of(first);
        with_type(w.types[s], [&](auto tag) {
          constexpr int64_t Type = decltype(tag)::value;
          prepare_int_block<Type>(w.row(s, first), w.row_bytes[s], K, prepared[b]);
          slots[b] = Format<Type>::kHalfScales ? 2 : 1;
        });
      }
      const IntBlock* const block_of[2] = {&prepared[0], &prepared[1]};
      float* const out_of[2] = {results.data(), results.data() + M * 16};
      auto sums = [&](int64_t S) { return S == 2 ? half_sums.data() : chunk_sums.data(); };
      if (blocks == 2 && slots[0] == slots[1]) {
        int_block_products<2>(xp, sums(slots[0]), M, K, slots[0], block_of, out_of);
      } else {
        for (int64_t b = 0; b < blocks; ++b) int_block_products<1>(xp, sums(slots[b]), M, K, slots[b], block_of + b, out_of + b);
      }
      if (layout.silu_mul) {
        for (int64_t m = 0; m < M; ++m)
          store16_silu_mul(out + m * ld + p * 16, _mm512_loadu_ps(results.data() + m * 16),
                           _mm512_loadu_ps(results.data() + (M + m) * 16));
        continue;
      }
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t col = p * kPanelRows + 16 * b;
        const __m512 bv = bias ? load16(bias + col) : _mm512_setzero_ps();
        for (int64_t m = 0; m < M; ++m)
          store16_bf16(out + m * ld + col, _mm512_add_ps(_mm512_loadu_ps(results.data() + (b * M + m) * 16), bv));
      }
    }
  });
}

// Whether every block of 16 rows lies inside one segment (the models' weights: segments of whole blocks).
bool blocks_within_segments(const Segments& w) {
  for (size_t s = 0; s + 1 < w.starts.size(); ++s)
    if (w.starts[s] % 16 != 0) return false;
  return true;
}
#endif

// Without AVX2 (or for a width not in blocks of 16): panels of weight rows dequantised, then torch's matmul.
void matmul_panels_torch(const at::Tensor& x, const Segments& w, const PanelRows& layout, const at::Tensor& bias,
                         const at::Tensor& out) {
  const int64_t K = w.K;
  const int64_t group = std::max<int64_t>(1, 2048 / kPanelRows);  // panels dequantised per matmul
  const int64_t panels = layout.panels();
  for (int64_t p0 = 0; p0 < panels; p0 += group) {
    const int64_t np = std::min(group, panels - p0);
    at::Tensor weights = at::empty({np * kPanelRows, K}, x.options());
    at::BFloat16* wp = weights.data_ptr<at::BFloat16>();
    parallel_range(0, np, 1, [&](int64_t a, int64_t b) {
      for (int64_t p = a; p < b; ++p)
        fill_panel(w, [&](int64_t r) { return layout.row_of(p0 + p, r); }, kPanelRows, wp + p * kPanelRows * K);
    });
    const at::Tensor y = at::matmul(x, weights.t()).view({x.size(0), np, kPanelRows});  // [M, np, 32]
    if (layout.silu_mul) {
      const int64_t j0 = p0 * 16, width = std::min<int64_t>(np * 16, layout.N / 2 - j0);
      const at::Tensor gate = y.narrow(2, 0, 16).reshape({x.size(0), np * 16}).narrow(1, 0, width);
      const at::Tensor up = y.narrow(2, 16, 16).reshape({x.size(0), np * 16}).narrow(1, 0, width);
      out.narrow(1, j0, width).copy_((at::silu(gate) * up));
      continue;
    }
    const int64_t n0 = p0 * kPanelRows, width = std::min<int64_t>(np * kPanelRows, layout.N - n0);
    at::Tensor part = y.reshape({x.size(0), np * kPanelRows}).narrow(1, 0, width);
    if (bias.defined()) part = part + bias.narrow(0, n0, width);
    out.narrow(1, n0, width).copy_(part);
  }
}

at::Tensor quant_forward(const at::Tensor& x_in, at::TensorList data, at::IntArrayRef types, int64_t cols,
                         const c10::optional<at::Tensor>& bias_in, bool fused_silu, int64_t gemv_max_rows,
                         int64_t fused_max_rows, bool int8_activations, const char* op) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, op, ": bf16 activations only");
  const Segments w(data, types, cols, op);
  const int64_t K = cols, N = w.rows();
  TORCH_CHECK(x_in.size(-1) == K, op, ": inner dimensions differ (", x_in.size(-1), " vs ", K, ")");
  TORCH_CHECK(!fused_silu || N % 2 == 0, op, ": a [gate | up] weight has an even number of rows");
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0), width = fused_silu ? N / 2 : N;
  auto out_sizes = x_in.sizes().vec();
  out_sizes.back() = width;
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) {
    TORCH_CHECK(!fused_silu, op, ": no bias on a fused gate/up weight");
    TORCH_CHECK(bias_in->scalar_type() == at::kBFloat16 && bias_in->numel() == N, op, ": the bias must be bf16 with ",
                N, " values");
    bias = bias_in->contiguous();
  }
  const at::BFloat16* bp = bias.defined() ? bias.data_ptr<at::BFloat16>() : nullptr;
  at::Tensor out = at::empty({M, width}, x.options());
  if (M == 0) return out.view(out_sizes);
  if (w.interleaved) {
    TORCH_CHECK(kHasInterleavedKernels, op, ": interleaved weights need the AVX-512 VNNI kernels");
    TORCH_CHECK(!fused_silu || width % kInterleavedRows == 0, op,
                ": an interleaved [gate | up] weight has whole groups of gate rows");
#if KVSERVE_HAS_VNNI
    // Up to the fused width the int8 dot products (past the few-row limit with the activations' residuals,
    // unless int8_activations asks for one int8 level per chunk at every width); wider inputs (prefill
    // chunks) the slabs, dequantised.
    if (M <= std::max(gemv_max_rows, fused_max_rows)) {
      const ActivationCode code = int8_activations  ? ActivationCode::kInt8Coarse
                                  : M > gemv_max_rows ? ActivationCode::kInt16
                                                      : ActivationCode::kInt8;
      interleaved_linear(x.data_ptr<at::BFloat16>(), M, w, bp, fused_silu, code, out.data_ptr<at::BFloat16>(),
                         width);
    } else {
      const bool amx = KVSERVE_HAS_AMX && request_amx();
      const at::Tensor x_wide = amx || KVSERVE_HAS_AVX512_BF16 ? at::Tensor() : x.to(at::kFloat);
      matmul_slabs(x.data_ptr<at::BFloat16>(), x_wide.defined() ? x_wide.data_ptr<float>() : nullptr, M, w,
                   PanelRows{N, fused_silu}, bp, out.data_ptr<at::BFloat16>(), width, amx);
    }
#endif
    return out.view(out_sizes);
  }
#if KVSERVE_HAS_INT8_DOTS
  if (M <= gemv_max_rows && K / 32 <= kMaxChunks) {
    if (!fused_silu) {
      gemv_quantized(x.data_ptr<at::BFloat16>(), M, w, bp, out.data_ptr<at::BFloat16>());
      return out.view(out_sizes);
    }
    at::Tensor gate_up = at::empty({M, N}, x.options());
    gemv_quantized(x.data_ptr<at::BFloat16>(), M, w, nullptr, gate_up.data_ptr<at::BFloat16>());
    return silu_mul(gate_up).view(out_sizes);
  }
#endif
  const PanelRows layout{N, fused_silu};
#if KVSERVE_HAS_AVX512
  if (width % 16 == 0) {
    const bool fused = M <= fused_max_rows;
    const bool amx = !fused && KVSERVE_HAS_AMX && request_amx();
    // The widening kernel reads fp32 activations; the others read the bf16 ones as they are.
    const at::Tensor x_wide = amx || KVSERVE_HAS_AVX512_BF16 ? at::Tensor() : x.to(at::kFloat);
    if (fused) {
#if KVSERVE_HAS_AVX512_BF16
      if (blocks_within_segments(w)) {
        matmul_int_weights(x.data_ptr<at::BFloat16>(), M, w, layout, bp, out.data_ptr<at::BFloat16>(), width);
        return out.view(out_sizes);
      }
#endif
      matmul_fused(x.data_ptr<at::BFloat16>(), x_wide.defined() ? x_wide.data_ptr<float>() : nullptr, M, w, layout,
                   bp, out.data_ptr<at::BFloat16>(), width);
      return out.view(out_sizes);
    }
    matmul_slabs(x.data_ptr<at::BFloat16>(), x_wide.defined() ? x_wide.data_ptr<float>() : nullptr, M, w, layout,
                 bp, out.data_ptr<at::BFloat16>(), width, amx);
    return out.view(out_sizes);
  }
#elif KVSERVE_HAS_QUANT_AVX2
  if (width % 16 == 0) {
    const at::Tensor x_wide = x.to(at::kFloat);
    matmul_slabs(x.data_ptr<at::BFloat16>(), x_wide.data_ptr<float>(), M, w, layout, bp, out.data_ptr<at::BFloat16>(),
                 width, false);
    return out.view(out_sizes);
  }
#endif
  matmul_panels_torch(x, w, layout, bias, out);
  return out.view(out_sizes);
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x, at::TensorList data, at::IntArrayRef types, int64_t cols,
                        const c10::optional<at::Tensor>& bias, int64_t gemv_max_rows, int64_t fused_max_rows,
                        bool int8_activations) {
  return quant_forward(x, data, types, cols, bias, false, gemv_max_rows, fused_max_rows, int8_activations,
                       "quant_linear");
}

at::Tensor quant_linear_silu_mul(const at::Tensor& x, at::TensorList data, at::IntArrayRef types, int64_t cols,
                                 int64_t gemv_max_rows, int64_t fused_max_rows, bool int8_activations) {
  return quant_forward(x, data, types, cols, c10::nullopt, true, gemv_max_rows, fused_max_rows, int8_activations,
                       "quant_linear_silu_mul");
}

// Rows `rows` (int64) of one quantised segment [N, row_bytes] as `dtype` (float32 or bf16) [len(rows), cols].
at::Tensor quant_dequantize(const at::Tensor& data, int64_t type, int64_t cols, const at::Tensor& rows,
                            at::ScalarType dtype) {
  const Segments w({data}, {type}, cols, "quant_dequantize");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_dequantize: float32 or bf16 out");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "quant_dequantize: rows must be int64 [R]");
  const at::Tensor ids = rows.contiguous();
  const int64_t R = ids.size(0), N = w.rows();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(id[r] >= 0 && id[r] < N, "quant_dequantize: row ", id[r], " of ", N);
  at::Tensor out = at::empty({R, cols}, data.options().dtype(dtype));
  float* const out_f = dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  at::BFloat16* const out_b = dtype == at::kBFloat16 ? out.data_ptr<at::BFloat16>() : nullptr;
  parallel_range(0, R, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> values(w.interleaved && out_b ? cols : 0);  // an interleaved row before its rounding
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = id[r];
      if (w.interleaved) {  // the row's values read from its group, one at a time (lookups take few rows)
        float* const dst = out_f ? out_f + r * cols : values.data();
        interleaved_dequantize_row(w.types[0], w.row(0, n - n % kInterleavedRows), n % kInterleavedRows, cols, dst);
        if (out_b)
          for (int64_t k = 0; k < cols; ++k) out_b[r * cols + k] = at::BFloat16(values[k]);
      } else if (out_f) {
        dequantize_row(type, w.row(0, n), cols, out_f + r * cols);
      } else {
        dequantize_row_bf16(type, w.row(0, n), cols, out_b + r * cols);
      }
    }
  });
  return out;
}

bool has_quantized_gemv() { return KVSERVE_HAS_INT8_DOTS; }

int64_t quant_interleaved_rows() { return kHasInterleavedKernels ? kInterleavedRows : 0; }

}  // namespace kvserve
