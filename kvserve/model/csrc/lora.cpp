// LoRA's low-rank update added to a projection's output in place: out[row] += (x[row] @ a^T) @ bt for the
// given rows (every row when rows is undefined). x and out bf16 or float32, a [rank, in] and bt [rank, out]
// float32 (the adapter's scale folded into bt). ``parts`` [P, 4] lists where bt is not zero: output columns
// [c0, c1) take ranks [r0, r1) (a fused projection's parts, each with ranks of its own). One call per projection and adapter where torch takes five
// ops (two matmuls, two casts, an add), each costing more in dispatch than the update's arithmetic at decode
// widths (benchmarks/lora.py).

#include "common.h"

namespace kvserve {

namespace {

inline float dot_f32(const float* x, const float* y, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if KVSERVE_HAS_AVX512
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(y + i + 16), acc1);
  }
  for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), acc0);
  sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

#if KVSERVE_HAS_AVX512
template <typename T>
inline void store16(T* dst, __m512 v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    store16_bf16(dst, v);
  } else {
    _mm512_storeu_ps(reinterpret_cast<float*>(dst), v);
  }
}
#endif

// Up to kRowBlock rows at a time, so that each of bt's rows is read once per block, not once per row.
constexpr int64_t kRowBlock = 4;

// out[row_ids[b]][c0:c1] += h[b][r0:r1] @ bt[r0:r1, c0:c1] for B rows at once (B fixed, so that the
// accumulators stay in registers).
template <int B, typename T>
void expand_rows(T* out, const float* bt, const int64_t* row_ids, int64_t out_size, int64_t rank, const float* h,
                 int64_t c0, int64_t c1, int64_t r0, int64_t r1) {
  int64_t j = c0;
#if KVSERVE_HAS_AVX512
  for (; j + 16 <= c1; j += 16) {
    __m512 acc[B];
    for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps();
    for (int64_t r = r0; r < r1; ++r) {
      const __m512 w = _mm512_loadu_ps(bt + r * out_size + j);
      for (int b = 0; b < B; ++b) acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(h[b * rank + r]), w, acc[b]);
    }
    for (int b = 0; b < B; ++b) {
      T* o = out + row_ids[b] * out_size + j;
      store16(o, _mm512_add_ps(load16(o), acc[b]));
    }
  }
#endif
  for (; j < c1; ++j) {
    for (int b = 0; b < B; ++b) {
      float sum = 0.f;
      for (int64_t r = r0; r < r1; ++r) sum += h[b * rank + r] * bt[r * out_size + j];
      T* o = out + row_ids[b] * out_size + j;
      *o = static_cast<T>(to_float(*o) + sum);
    }
  }
}

template <typename T>
void lora_block(T* out, const T* x, const float* a, const float* bt, const int64_t* parts, int64_t num_parts,
                const int64_t* row_ids, int64_t count, int64_t in, int64_t out_size, int64_t rank, float* xf,
                float* h) {
  for (int64_t b = 0; b < count; ++b) {
    const T* xr = x + row_ids[b] * in;
    int64_t k = 0;
#if KVSERVE_HAS_AVX512
    for (; k + 16 <= in; k += 16) _mm512_storeu_ps(xf + k, load16(xr + k));
#endif
    for (; k < in; ++k) xf[k] = to_float(xr[k]);
    for (int64_t r = 0; r < rank; ++r) h[b * rank + r] = dot_f32(xf, a + r * in, in);
  }
  for (int64_t p = 0; p < num_parts; ++p) {
    const int64_t* part = parts + 4 * p;  // its output columns [c0, c1) and its ranks [r0, r1)
    switch (count) {
      case 1: expand_rows<1>(out, bt, row_ids, out_size, rank, h, part[0], part[1], part[2], part[3]); break;
      case 2: expand_rows<2>(out, bt, row_ids, out_size, rank, h, part[0], part[1], part[2], part[3]); break;
      case 3: expand_rows<3>(out, bt, row_ids, out_size, rank, h, part[0], part[1], part[2], part[3]); break;
      default: expand_rows<kRowBlock>(out, bt, row_ids, out_size, rank, h, part[0], part[1], part[2], part[3]);
    }
  }
}

template <typename T>
void lora_rows(T* out, const T* x, const float* a, const float* bt, const int64_t* parts, int64_t num_parts,
               const int64_t* rows, int64_t num_rows, int64_t in, int64_t out_size, int64_t rank) {
  // Chunks of rows worth about half a million multiply-adds: a decode step's rows stay on this thread.
  const int64_t work = std::max<int64_t>(1, rank * (in + out_size));
  parallel_range(0, num_rows, std::max<int64_t>(1, (int64_t{1} << 19) / work), [&](int64_t r0, int64_t r1) {
    std::vector<float> xf(in), h(kRowBlock * rank);
    int64_t ids[kRowBlock];
    for (int64_t i = r0; i < r1; i += kRowBlock) {
      const int64_t count = std::min(kRowBlock, r1 - i);
      for (int64_t b = 0; b < count; ++b) ids[b] = rows ? rows[i + b] : i + b;
      lora_block(out, x, a, bt, parts, num_parts, ids, count, in, out_size, rank, xf.data(), h.data());
    }
  });
}

}  // namespace

void lora_add(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
              const at::Tensor& parts_in, const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && a.dim() == 2 && bt.dim() == 2, "lora_add: 2-d tensors only");
  TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && a.is_contiguous() && bt.is_contiguous(),
              "lora_add: contiguous tensors only");
  TORCH_CHECK(a.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat, "lora_add: a and bt float32");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "lora_add: x and out of one dtype");
  const int64_t n = x.size(0), in = x.size(1), out_size = out.size(1), rank = a.size(0);
  TORCH_CHECK(out.size(0) == n && a.size(1) == in && bt.size(0) == rank && bt.size(1) == out_size,
              "lora_add: shapes differ");
  const int64_t* row_ids = nullptr;
  int64_t num_rows = n;
  at::Tensor row_tensor;
  if (rows.has_value() && rows->defined()) {
    row_tensor = rows->contiguous();
    TORCH_CHECK(row_tensor.scalar_type() == at::kLong && row_tensor.dim() == 1, "lora_add: rows int64, 1-d");
    row_ids = row_tensor.data_ptr<int64_t>();
    num_rows = row_tensor.numel();
    for (int64_t i = 0; i < num_rows; ++i) TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < n, "lora_add: row out of range");
  }
  const at::Tensor parts = parts_in.contiguous();
  TORCH_CHECK(parts.scalar_type() == at::kLong && parts.dim() == 2 && parts.size(1) == 4, "lora_add: parts [P, 4] int64");
  const int64_t num_parts = parts.size(0);
  const int64_t* pp = parts.data_ptr<int64_t>();
  for (int64_t p = 0; p < num_parts; ++p) {
    TORCH_CHECK(0 <= pp[4 * p] && pp[4 * p] <= pp[4 * p + 1] && pp[4 * p + 1] <= out_size && 0 <= pp[4 * p + 2] &&
                    pp[4 * p + 2] <= pp[4 * p + 3] && pp[4 * p + 3] <= rank,
                "lora_add: a part outside the output or the rank");
  }
  const float* ap = a.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) {
    lora_rows(out.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), ap, bp, pp, num_parts, row_ids, num_rows, in,
              out_size, rank);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "lora_add: x and out bf16 or float32");
    lora_rows(out.data_ptr<float>(), x.data_ptr<float>(), ap, bp, pp, num_parts, row_ids, num_rows, in, out_size, rank);
  }
}

}  // namespace kvserve
