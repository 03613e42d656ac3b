// Shared by the CPU kernel files: feature macros, bf16 helpers and the op declarations.
#pragma once

// Narrow ATen headers, not <ATen/ATen.h>: that one pulls in every op's declaration and costs most of the
// build's time in each file.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
// AVX2 and FMA: the floor of the 8-lane paths (every x86-64 server CPU of the last decade has them).
#if defined(__AVX2__) && defined(__FMA__)
#define KVSERVE_HAS_AVX2 1
#else
#define KVSERVE_HAS_AVX2 0
#endif
// AVX-512 F and BW: the floor of every vector path here (bf16 widens by a shift, rounds in integer ops).
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVSERVE_HAS_AVX512 1
#else
#define KVSERVE_HAS_AVX512 0
#endif
#if KVSERVE_HAS_AVX512 && defined(__AVX512BF16__)
#define KVSERVE_HAS_AVX512_BF16 1
#else
#define KVSERVE_HAS_AVX512_BF16 0
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVSERVE_HAS_AMX 1
#else
#define KVSERVE_HAS_AMX 0
#endif

namespace kvserve {

// Runs worker(claim) once on each of torch's intra-op threads; claim() hands out the indices 0..n-1 one at
// a time and returns -1 when none is left. at::parallel_for splits a range statically, so a thread that
// loses its core to another process (the HTTP server, a client) holds up the whole region for its share;
// with claiming, the other threads take that share over.
// Parallel regions cost a wake of the other threads: ~15 us each with the server's passive OpenMP waiting,
// a few hundred of them per decode step. Work below these sizes stays on the calling thread:
constexpr int64_t kSerialWork = 256;  // (token, head) rows of 64-128 values
constexpr int64_t kSerialRows = 64;   // hidden-size rows (576-4,096 values)

// worker_pool.cpp: the threads parallel_claim runs on (see there for why not OpenMP's).
struct WorkerPool {
  using Task = void (*)(void* context, int64_t thread);
  // task(context, t) for t = 0 .. threads-1, t = 0 on the calling thread; returns when every call has.
  static void run(int64_t threads, Task task, void* context);
};
void use_worker_pool(bool enabled);  // false: OpenMP (at::parallel_for) instead, e.g. to compare the two
// The threads parallel regions use: set_kernel_threads(n) (n > 0, on the pool), else torch's intra-op count.
void set_kernel_threads(int64_t threads);
int64_t kernel_threads();

template <typename Worker>
inline void parallel_claim(int64_t n, const Worker& worker) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  auto claim = [&]() -> int64_t {
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    return i < n ? i : -1;
  };
  const int64_t threads = std::min<int64_t>(kernel_threads(), n);
  if (threads <= 1) {
    worker(claim);
    return;
  }
  auto body = [&]() { worker(claim); };
  WorkerPool::run(threads, [](void* context, int64_t) { (*static_cast<decltype(body)*>(context))(); }, &body);
}

// f(chunk_begin, chunk_end) over [begin, end) in chunks of at least `grain`, on the same threads as
// parallel_claim (at::parallel_for's contract; a range of at most `grain` runs here, on this thread).
template <typename F>
inline void parallel_range(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  grain = std::max<int64_t>(grain, 1);
  if (n <= grain) {
    if (n > 0) f(begin, end);
    return;
  }
  // Four chunks a thread, so a thread that loses its core leaves little for the other to wait on.
  const int64_t chunk = std::max<int64_t>(grain, (n + 4 * kernel_threads() - 1) / (4 * kernel_threads()));
  parallel_claim((n + chunk - 1) / chunk, [&](auto&& claim) {
    for (int64_t c; (c = claim()) >= 0;) f(begin + c * chunk, std::min(end, begin + (c + 1) * chunk));
  });
}

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float round_bf16(float v) { return static_cast<float>(at::BFloat16(v)); }

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


// 2^x on 16 lanes for x <= 0 (attention weights): 2^n * 2^r with |r| <= 1/2 and a degree-5 polynomial
// (relative error ~3e-6, below the ~16 bits a hi + lo bf16 pair keeps). No clamp is needed: scalef
// flushes a very negative n to 0.
inline __m512 exp2_512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);  // ln2^k / k!, k = 5 .. 0
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if KVSERVE_HAS_AVX512
// 16 floats to bf16 bits, rounded to nearest even: the BF16 instruction where the CPU has it, else the same
// rounding in integer ops (add 0x7FFF plus the kept lowest bit, drop the low half; NaN stays a quiet NaN).
inline __m256i cvt16_bf16(__m512 v) {
#if KVSERVE_HAS_AVX512_BF16
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
#endif
}
// 16 bf16 values (as cvt16_bf16 gives them) widened back to floats.
inline __m512 widen16_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
// dst[j * 16 + i] = in[i][j] for a 16 x 16 matrix of 32-bit values: pairs, then quads within 128-bit
// lanes, then the lanes themselves.
inline void transpose16_epi32(const __m512i* in, uint32_t* dst) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c]: rows i..i+3 of column 4L + c, in lane L
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v_hi = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i w_lo = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i w_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    _mm512_storeu_si512(dst + (0 + c) * 16, _mm512_shuffle_i32x4(v_lo, w_lo, 0x88));
    _mm512_storeu_si512(dst + (4 + c) * 16, _mm512_shuffle_i32x4(v_lo, w_lo, 0xDD));
    _mm512_storeu_si512(dst + (8 + c) * 16, _mm512_shuffle_i32x4(v_hi, w_hi, 0x88));
    _mm512_storeu_si512(dst + (12 + c) * 16, _mm512_shuffle_i32x4(v_hi, w_hi, 0xDD));
  }
}

// 16 floats rounded to bf16 and stored; and rounded but kept as floats.
inline void store16_bf16(at::BFloat16* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), cvt16_bf16(v));
}
inline __m512 round16_bf16(__m512 v) { return widen16_bf16(cvt16_bf16(v)); }
#endif

#if KVSERVE_HAS_AVX2
// 8 floats from T (bf16 widens by a shift; fp32 loads as is).
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

// 8 floats to bf16 bits, rounded to nearest even as cvt16_bf16 rounds (NaN stays a quiet NaN).
inline __m128i cvt8_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // Eight 32-bit values below 2^16 to eight 16-bit ones: pack within each 128-bit lane, then join the lanes.
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
inline void store8_bf16(at::BFloat16* dst, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), cvt8_bf16(v));
}
inline __m256 round8_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(cvt8_bf16(v)), 16));
}

inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline int32_t reduce_add8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// exp on 8 lanes, as exp512 computes it (the same clamp, reduction and polynomial). 2^n is built in exponent
// bits as 2^(n/2) * 2^(n - n/2), each a normal float, where exp512 scales by 2^n in one instruction.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(89.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i n_all = _mm256_cvtps_epi32(n), n_half = _mm256_srai_epi32(n_all, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 scale_a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n_half, bias), 23));
  const __m256 scale_b =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(n_all, n_half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, scale_a), scale_b);
}

// silu(g) = g / (1 + exp(-g)), as silu_mul and the fused gate/up kernels compute it on 8 lanes.
inline __m256 silu8(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}
#endif

#if KVSERVE_HAS_AMX
// The 64-byte operand of LDTILECFG (palette 1): rows and bytes per row of each tile register.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif

// projections.cpp
bool request_amx();  // asks Linux for the AMX tile state once per process; false if refused or absent
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
bool has_avx512_bf16();
at::Tensor amx_pack(const at::Tensor& w);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor amx_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed);
// x [M, K] (contiguous) times NB blocks of 16 weight rows packed as amx_pack packs them (KB = K / 32) into
// out (row stride ld): plus bias, or (silu_mul) silu(gate) * up of gate/up blocks in pairs, as amx_linear
// and amx_linear_silu_mul write them. The quantised projections' many-row path calls it on dequantised slabs.
void amx_matmul_packed(const at::BFloat16* x, int64_t M, const at::BFloat16* packed, int64_t NB, int64_t KB,
                       at::BFloat16* out, int64_t ld, const at::BFloat16* bias, bool silu_mul);
bool has_amx();

// pack_pairs.cpp: w [N, K] bf16 in the layout the AVX-512 and AVX2 projection families read.
at::Tensor pack_bf16_pairs(const at::Tensor& w);

// linear_avx512.cpp
at::Tensor avx512_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor avx512_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed);
// The same products and layout on VDPBF16PS (AVX512-BF16 CPUs without AMX).
at::Tensor bf16dot_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor bf16dot_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed);
// x [M, K] times NB blocks of 16 weight rows packed as pack_bf16_pairs packs them into out (row stride ld), plus
// bias or (silu_mul) silu(gate) * up of gate/up blocks in pairs: on VDPBF16PS where the build has it, else
// widening FMAs on x_wide (x in fp32). The quantised projections' many-row path calls it on dequantised slabs.
void avx512_matmul_packed(const at::BFloat16* x, const float* x_wide, int64_t M, const at::BFloat16* packed,
                          int64_t NB, int64_t K, at::BFloat16* out, int64_t ld, const at::BFloat16* bias,
                          bool silu_mul);
// The same on the calling thread alone, for a few blocks a worker has just dequantised (the quantised
// projections' mid-width path). A row's result is the same bits as avx512_matmul_packed's.
void avx512_matmul_packed_here(const at::BFloat16* x, const float* x_wide, int64_t M, const at::BFloat16* packed,
                               int64_t NB, int64_t K, at::BFloat16* out, int64_t ld, const at::BFloat16* bias,
                               bool silu_mul);
bool has_avx512();

// linear_avx2.cpp: the same products and layout on AVX2 and FMA (CPUs without AVX-512).
at::Tensor avx2_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor avx2_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed);
bool has_avx2();
// x_wide [M, K] (fp32) times NB blocks packed as pack_bf16_pairs packs them, as avx512_matmul_packed's widening
// kernel computes it; the quantised projections' many-row path calls it on dequantised slabs.
void avx2_matmul_packed(const float* x_wide, int64_t M, const at::BFloat16* packed, int64_t NB, int64_t K,
                        at::BFloat16* out, int64_t ld, const at::BFloat16* bias, bool silu_mul);

// quantized.cpp
at::Tensor quant_linear(const at::Tensor& x, at::TensorList data, at::IntArrayRef types, int64_t cols,
                        const c10::optional<at::Tensor>& bias, int64_t gemv_max_rows, int64_t fused_max_rows,
                        bool int8_activations = false);
at::Tensor quant_linear_silu_mul(const at::Tensor& x, at::TensorList data, at::IntArrayRef types, int64_t cols,
                                 int64_t gemv_max_rows, int64_t fused_max_rows, bool int8_activations = false);
at::Tensor quant_dequantize(const at::Tensor& data, int64_t type, int64_t cols, const at::Tensor& rows,
                            at::ScalarType dtype);
bool has_quantized_gemv();
// Rows per group of the interleaved layout the quantised kernels take here (0: they take none).
int64_t quant_interleaved_rows();

// attention.cpp
std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache, const at::Tensor& block_table,
                                                const at::Tensor& seq_lens, double scale, int64_t split_size);
at::Tensor merge_attention(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                           const at::Tensor& lse_b, bool bf16_out);

// The head sizes the many-row attention kernels (and the fused decode stack, which calls one) take:
// whole 64-wide chunks of the head dimension, templated on the size. plan_kernels
// (backends/cpu_kernels.py) names the same sizes.
inline bool many_row_head_size(int64_t d) { return d == 64 || d == 128 || d == 256; }

// f(std::integral_constant<int64_t, D>) for a head size many_row_head_size takes; refuses any other.
template <typename F>
inline void with_head_size(int64_t d, const F& f) {
  switch (d) {
    case 64: return f(std::integral_constant<int64_t, 64>{});
    case 128: return f(std::integral_constant<int64_t, 128>{});
    case 256: return f(std::integral_constant<int64_t, 256>{});
    default: TORCH_CHECK(false, "head size ", d, " has no many-row kernel (64, 128 or 256)");
  }
}

// paged_runs.cpp: the many-row attention kernels' arguments (q [T, H, D], the paged caches, one run of
// query tokens per row of block_tables), checked; their shape.
struct PagedRunsShape {
  int64_t num_heads, kv_heads, head_dim, block_size, group, num_spans, max_blocks;
};
PagedRunsShape check_paged_runs(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& kv_lens,
                                const at::Tensor& q_starts, bool causal);
// One run of query tokens and its keys, and a work item of the plain-vector many-row kernels: rows
// [first_row, first_row + num_rows) of one KV head's (token, group head) pairs in one run.
struct RunSpan {
  int64_t q_start, q_len, kv_len;
  const int32_t* blocks;
};
struct RowItem {
  int64_t span, head, first_row, num_rows;
};
struct RowItems {
  std::vector<RunSpan> spans;
  std::vector<RowItem> items;
};
// The runs (checked by check_paged_runs) cut into items of at most max_rows rows, a multiple of row_group:
// fewer rows where that leaves too few items to keep every thread busy (cascade decode: 16 decodes x 3 heads
// per KV head).
RowItems split_row_items(const PagedRunsShape& shape, const at::Tensor& block_tables, const at::Tensor& kv_lens,
                         const at::Tensor& q_starts, int64_t row_group, int64_t max_rows);

// flash_attention_avx2.cpp: paged_attention_avx512's contract on AVX2 and FMA.
std::tuple<at::Tensor, at::Tensor> paged_attention_avx2(const at::Tensor& q, const at::Tensor& k_cache,
                                                        const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                        const at::Tensor& kv_lens, const at::Tensor& q_starts,
                                                        double scale, bool causal, bool fp32_out);

// flash_attention_avx512.cpp
std::tuple<at::Tensor, at::Tensor> paged_attention_avx512(const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                          const at::Tensor& kv_lens, const at::Tensor& q_starts,
                                                          double scale, bool causal, bool fp32_out);

// flash_attention.cpp
std::tuple<at::Tensor, at::Tensor> paged_attention_amx(const at::Tensor& q, const at::Tensor& k_cache,
                                                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                       const at::Tensor& kv_lens, const at::Tensor& q_starts,
                                                       double scale, bool causal, bool fp32_out,
                                                       const c10::optional<at::Tensor>& packed,
                                                       int64_t shared_keys = 0);
at::Tensor pack_kv_amx(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
                       int64_t kv_len);

// decode_stack.cpp
std::tuple<at::Tensor, at::Tensor> decode_stack(
    const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& signed_sin, at::TensorList input_norms,
    at::TensorList post_norms, at::TensorList qkv_packed, at::TensorList o_packed, at::TensorList gate_up_packed,
    at::TensorList down_packed, at::TensorList kv_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const c10::optional<at::Tensor>& prefix_block_tables,
    const c10::optional<at::Tensor>& prefix_kv_lens, const c10::optional<at::Tensor>& prefix_q_starts,
    at::TensorList prefix_packed, at::TensorList single_row_weights, at::TensorList qkv_biases,
    at::TensorList q_norms, at::TensorList k_norms, at::IntArrayRef unrotated_layers, double residual_multiplier,
    int64_t num_heads, int64_t num_kv_heads, double eps, double scale, int64_t split_size, at::TensorList quant_data,
    at::IntArrayRef quant_types,
    at::IntArrayRef quant_segments, at::IntArrayRef quant_cols, int64_t quant_gemv_max_rows,
    int64_t quant_fused_max_rows, bool quant_int8_activations, c10::string_view projections,
    c10::string_view attention);

// sampling.cpp
// lora.cpp: out[rows] += (x[rows] @ a^T) @ bt in place (x, out bf16 or float32; a, bt float32; bt zero
// outside parts).
void lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& parts, const c10::optional<at::Tensor>& rows);
at::Tensor argmax_rows(const at::Tensor& x);
void mask_logits(at::Tensor logits, const at::Tensor& rows, const at::Tensor& bitmask);

// elementwise.cpp
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin);

}  // namespace kvserve
