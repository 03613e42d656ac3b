// GGUF block formats as the quantised kernels hold them: shared by quantized.cpp (rows held planar) and
// quantized_interleaved.cpp (sixteen rows held interleaved).
#pragma once

#include "common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && KVSERVE_HAS_AVX512
#define KVSERVE_HAS_VNNI 1
#else
#define KVSERVE_HAS_VNNI 0
#endif

namespace kvserve {

// ggml's type ids.
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// Set in a segment's type id when its rows are held interleaved (model/quantized_layout.py), sixteen at a time.
constexpr int64_t kInterleavedFlag = 0x100;
constexpr int64_t kInterleavedRows = 16;

struct BlockShape {
  int64_t values;  // weights per block
  int64_t bytes;   // bytes per block, as held
};

inline bool known_type(int64_t type) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: return true;
    default: return false;
  }
}

inline BlockShape block_shape(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 148};  // held: the file's 144 with the 6-bit scales and mins unpacked
    case kQ5_K: return {256, 180};  // held: the file's 176, likewise
    case kQ6_K: return {256, 210};
    default: TORCH_CHECK(false, "quantized: GGML type ", type, " has no kernel");
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// A 32-weight chunk: w[i] = d[i / 16] * q[i] + m[i / 16].
struct ChunkScales {
  float d[2];
  float m[2];
};

// f(std::integral_constant<int64_t, Type>) for a runtime type id.
template <typename F>
inline void with_type(int64_t type, const F& f) {
  switch (type) {
    case kQ4_0: f(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: f(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ5_0: f(std::integral_constant<int64_t, kQ5_0>{}); break;
    case kQ5_1: f(std::integral_constant<int64_t, kQ5_1>{}); break;
    case kQ8_0: f(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_K: f(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ5_K: f(std::integral_constant<int64_t, kQ5_K>{}); break;
    case kQ6_K: f(std::integral_constant<int64_t, kQ6_K>{}); break;
    default: TORCH_CHECK(false, "quantized: GGML type ", type, " has no kernel");
  }
}

// The weight's row segments: which segment holds global row n, and where. Either every segment is held
// interleaved (in whole groups of sixteen rows) or none is.
struct Segments {
  std::vector<const uint8_t*> data;
  std::vector<int64_t> types, starts, row_bytes;  // starts: first global row of each segment, then N
  int64_t K = 0;
  bool interleaved = false;

  Segments(at::TensorList tensors, at::IntArrayRef type_ids, int64_t cols, const char* op) : K(cols) {
    TORCH_CHECK(!tensors.empty() && tensors.size() == type_ids.size(), op, ": one type per weight segment");
    TORCH_CHECK(cols > 0 && cols % 32 == 0, op, ": the inner size must be a multiple of 32, got ", cols);
    interleaved = (type_ids[0] & kInterleavedFlag) != 0;
    int64_t rows = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor& t = tensors[i];
      TORCH_CHECK(((type_ids[i] & kInterleavedFlag) != 0) == interleaved, op,
                  ": the segments of a weight are all interleaved or none is");
      const int64_t type = type_ids[i] & ~kInterleavedFlag;
      TORCH_CHECK(known_type(type), op, ": GGML type ", type, " has no kernel");
      const BlockShape shape = block_shape(type);
      TORCH_CHECK(cols % shape.values == 0, op, ": ", cols, " columns are not whole blocks of ", shape.values);
      TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 2 && t.is_contiguous() &&
                      t.size(1) == cols / shape.values * shape.bytes,
                  op, ": segment ", i, " must be contiguous uint8 [rows, ", cols / shape.values * shape.bytes, "]");
      TORCH_CHECK(!interleaved || t.size(0) % kInterleavedRows == 0, op, ": segment ", i,
                  " is interleaved but its rows are not whole groups of ", kInterleavedRows);
      data.push_back(t.data_ptr<uint8_t>());
      types.push_back(type);
      starts.push_back(rows);
      row_bytes.push_back(t.size(1));
      rows += t.size(0);
    }
    starts.push_back(rows);
  }
  int64_t rows() const { return starts.back(); }
  int64_t segment_of(int64_t n) const {
    int64_t s = 0;
    while (n >= starts[s + 1]) ++s;
    return s;
  }
  // Planar: row n. Interleaved: the group of sixteen rows that starts at row n (a multiple of sixteen).
  const uint8_t* row(int64_t s, int64_t n) const { return data[s] + (n - starts[s]) * row_bytes[s]; }
};

#if KVSERVE_HAS_AVX512
// silu(gate) * up for sixteen outputs of fp32 products, rounded at every step as silu_mul(linear(...)) rounds:
// gate and up to bf16, silu to bf16, then the product.
inline void store16_silu_mul(at::BFloat16* dst, __m512 gate_products, __m512 up_products) {
  const __m512 gate = round16_bf16(gate_products), up = round16_bf16(up_products);
  const __m512 silu =
      _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
  store16_bf16(dst, _mm512_mul_ps(round16_bf16(silu), up));
}
#endif

// How the interleaved kernels quantise the activations: one int8 level per sixteen values; two levels, an int8
// value and an int8 residual (about 16 bits, as near the exact products as bf16 activations, for twice the dot
// products); or one int8 level per 32 values, a weight chunk's (llama.cpp's Q8_0 grain: a chunk's products are
// converted and scaled once, where the finer codes take two conversions and scales per chunk).
enum class ActivationCode { kInt8, kInt16, kInt8Coarse };

// quantized_interleaved.cpp. A group: sixteen rows' blocks interleaved, 16 x row_bytes bytes.
// Whether this build has the interleaved kernels (AVX-512 with VNNI); the layout is only made where it does.
constexpr bool kHasInterleavedKernels = KVSERVE_HAS_VNNI;
// Row r (0-15) of a group as floats, exactly as the planar layout's dequantiser gives it.
void interleaved_dequantize_row(int64_t type, const uint8_t* group, int64_t r, int64_t K, float* out);
#if KVSERVE_HAS_VNNI
// y = x W^T (+ bias) on int8 dot products, or (silu_mul, W = [gate | up]) silu(x G^T) * (x U^T); out is
// [M, ld] bf16, the activations coded as `code`.
void interleaved_linear(const at::BFloat16* x, int64_t M, const Segments& w, const at::BFloat16* bias, bool silu_mul,
                        ActivationCode code, at::BFloat16* out, int64_t ld);
// A group's sixteen rows dequantised to bf16 into the packed projections' tiles (K / 32 tiles of 512 values,
// a tile's sixteen pairs of k for each row side by side), as the slabs' planar dequantiser writes them.
void interleaved_dequantize_tiles(int64_t type, const uint8_t* group, int64_t K, at::BFloat16* tiles);
#endif

}  // namespace kvserve
