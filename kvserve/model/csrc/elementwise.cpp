// Element-wise glue between the projections, bf16. Each is one pass instead of the 4-8 small torch ops
// it replaces (at one token per step those ops cost more in dispatch than in arithmetic). Rounding follows
// the Hugging Face reference: the norm in fp32, cast to bf16, then multiplied by the bf16 weight.

#include "common.h"

namespace kvserve {

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
  parallel_range(0, rows, kSerialRows, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(H);
    for (int64_t r = r0; r < r1; ++r) {
      int64_t i = 0;
      float sumsq = 0.f;
#if KVSERVE_HAS_AVX512
      __m512 sq = _mm512_setzero_ps();
      for (; i + 16 <= H; i += 16) {
        __m512 v = load16(xp + r * H + i);
        if (has_residual) {
          const __m256i rounded = cvt16_bf16(_mm512_add_ps(v, load16(rp + r * H + i)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(sp + r * H + i), rounded);
          v = widen16_bf16(rounded);
        }
        _mm512_storeu_ps(row.data() + i, v);
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      sumsq = _mm512_reduce_add_ps(sq);
#elif KVSERVE_HAS_AVX2
      __m256 sq = _mm256_setzero_ps();
      for (; i + 8 <= H; i += 8) {
        __m256 v = load8(xp + r * H + i);
        if (has_residual) {
          const __m128i rounded = cvt8_bf16(_mm256_add_ps(v, load8(rp + r * H + i)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(sp + r * H + i), rounded);
          v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(rounded), 16));
        }
        _mm256_storeu_ps(row.data() + i, v);
        sq = _mm256_fmadd_ps(v, v, sq);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, sq);
      for (const float lane : lanes) sumsq += lane;
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
#if KVSERVE_HAS_AVX512
      for (; i + 16 <= H; i += 16) {
        const __m512 n = round16_bf16(_mm512_mul_ps(_mm512_loadu_ps(row.data() + i), _mm512_set1_ps(inv)));
        store16_bf16(op + r * H + i, _mm512_mul_ps(n, load16(wp + i)));
      }
#elif KVSERVE_HAS_AVX2
      for (; i + 8 <= H; i += 8) {
        const __m256 n = round8_bf16(_mm256_mul_ps(_mm256_loadu_ps(row.data() + i), _mm256_set1_ps(inv)));
        store8_bf16(op + r * H + i, _mm256_mul_ps(n, load8(wp + i)));
      }
#endif
      for (; i < H; ++i)
        op[r * H + i] = at::BFloat16(round_bf16(row[i] * inv) * static_cast<float>(wp[i]));
    }
  });
  return {out, summed};
}

namespace {

// silu(g) = g / (1 + exp(-g)).
struct Silu {
  static float scalar(float g) { return g / (1.f + std::exp(-g)); }
#if KVSERVE_HAS_AVX512
  static __m512 v16(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  }
#elif KVSERVE_HAS_AVX2
  static __m256 v8(__m256 g) { return silu8(g); }
#endif
};

// gelu_tanh(g) = 0.5 g (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + exp(-2z)):
// the same value, one exp instead of a tanh.
struct GeluTanh {
  static constexpr float kTwoC = 1.5957691216057308f;  // 2 sqrt(2 / pi)
  static constexpr float kCube = 0.044715f;
  static float scalar(float g) { return g / (1.f + std::exp(-kTwoC * (g + kCube * g * g * g))); }
#if KVSERVE_HAS_AVX512
  static __m512 v16(__m512 g) {
    const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(g, g), g), _mm512_set1_ps(kCube), g);
    const __m512 minus_2z = _mm512_mul_ps(inner, _mm512_set1_ps(-kTwoC));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(minus_2z)));
  }
#elif KVSERVE_HAS_AVX2
  static __m256 v8(__m256 g) {
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(g, g), g), _mm256_set1_ps(kCube), g);
    const __m256 minus_2z = _mm256_mul_ps(inner, _mm256_set1_ps(-kTwoC));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(minus_2z)));
  }
#endif
};

// act(gate) * up for gate_up = [gate | up] along the last dim, bf16, as torch rounds it: the activation to
// bf16, then the product to bf16 (round-to-nearest-even).
template <typename Act>
at::Tensor gated_mul(const at::Tensor& gate_up_in, const char* name) {
  TORCH_CHECK(gate_up_in.scalar_type() == at::kBFloat16, name, ": bf16 only");
  at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t I = gate_up.size(-1) / 2;
  const int64_t rows = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  at::Tensor out = at::empty(sizes, gate_up.options());
  const at::BFloat16* gp = gate_up.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  parallel_range(0, rows, kSerialRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const at::BFloat16* g_row = gp + r * 2 * I;
      const at::BFloat16* u_row = g_row + I;
      at::BFloat16* o_row = op + r * I;
      int64_t i = 0;
#if KVSERVE_HAS_AVX512
      for (; i + 16 <= I; i += 16)
        store16_bf16(o_row + i, _mm512_mul_ps(round16_bf16(Act::v16(load16(g_row + i))), load16(u_row + i)));
#elif KVSERVE_HAS_AVX2
      for (; i + 8 <= I; i += 8)
        store8_bf16(o_row + i, _mm256_mul_ps(round8_bf16(Act::v8(load8(g_row + i))), load8(u_row + i)));
#endif
      for (; i < I; ++i)
        o_row[i] = at::BFloat16(round_bf16(Act::scalar(static_cast<float>(g_row[i]))) * static_cast<float>(u_row[i]));
    }
  });
  return out;
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) { return gated_mul<Silu>(gate_up, "silu_mul"); }

// Gemma's MLP activation; within a bf16 rounding of torch's gelu(approximate="tanh") * up.
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return gated_mul<GeluTanh>(gate_up, "gelu_tanh_mul"); }

// Neox-style rotary embedding, bf16, rounded as torch rounds x * cos + rotate_half(x) * sin: each
// product to bf16, then the sum. x [T, H, D] (rows may be strided, as Q and K are views into the fused
// QKV output); cos and signed_sin [T, 1, D] with sin's first half negated (layers.RotaryEmbedding).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && cos_in.scalar_type() == at::kBFloat16 &&
                  sin_in.scalar_type() == at::kBFloat16,
              "rotary: bf16 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x must be [T, H, D] with contiguous rows");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos_in.numel() == T * D && sin_in.numel() == T * D, "rotary: bad table shapes");
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  at::Tensor out = at::empty({T, H, D}, x.options());
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* cp = cos.data_ptr<at::BFloat16>();
  const at::BFloat16* sp = sin.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  parallel_range(0, T * H, kSerialWork, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H;
      const at::BFloat16* xr = xp + t * st + h * sh;
      const at::BFloat16* c = cp + t * D;
      const at::BFloat16* s = sp + t * D;
      at::BFloat16* o = op + i * D;
      int64_t d = 0;
#if KVSERVE_HAS_AVX512
      if (half % 16 == 0) {
        for (; d < D; d += 16) {
          const int64_t partner = d < half ? d + half : d - half;
          const __m512 a = round16_bf16(_mm512_mul_ps(load16(xr + d), load16(c + d)));
          const __m512 b = round16_bf16(_mm512_mul_ps(load16(xr + partner), load16(s + d)));
          store16_bf16(o + d, _mm512_add_ps(a, b));
        }
      }
#elif KVSERVE_HAS_AVX2
      if (half % 8 == 0) {
        for (; d < D; d += 8) {
          const int64_t partner = d < half ? d + half : d - half;
          const __m256 a = round8_bf16(_mm256_mul_ps(load8(xr + d), load8(c + d)));
          const __m256 b = round8_bf16(_mm256_mul_ps(load8(xr + partner), load8(s + d)));
          store8_bf16(o + d, _mm256_add_ps(a, b));
        }
      }
#endif
      for (; d < D; ++d) {
        const int64_t partner = d < half ? d + half : d - half;
        const float a = round_bf16(static_cast<float>(xr[d]) * static_cast<float>(c[d]));
        const float b = round_bf16(static_cast<float>(xr[partner]) * static_cast<float>(s[d]));
        o[d] = at::BFloat16(a + b);
      }
    }
  });
  return out;
}

}  // namespace kvserve
