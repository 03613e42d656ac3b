// A decode step's whole decoder stack in one call: every layer's add+RMSNorm, projections, rotary, KV
// write, cascade attention and MLP, calling the same kernels the Python layer calls, in the same order,
// so the result is bit for bit the same. What it removes is the Python between them: a 16-request decode
// step issues ~15 ops per layer, ~450 per step, and dispatching each from Python cost about as much as the
// smaller kernels themselves (the engine thread runs that Python while the kernels' other thread waits).

#include "common.h"
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/rms_norm.h>

namespace kvserve {

namespace {

// Row t of src (heads contiguous, any token stride) into the cache slot slots[t]: the KV write.
void write_slots(const at::Tensor& src, const at::Tensor& cache, const int64_t* slots, int64_t num_tokens) {
  const int64_t row = src.size(1) * src.size(2);
  const int64_t capacity = cache.numel() / row;
  auto* dst = cache.data_ptr<at::BFloat16>();
  const auto* from = src.data_ptr<at::BFloat16>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, "decode_stack: slot ", slots[t], " is outside the cache");
    std::memcpy(dst + slots[t] * row, from + t * src.stride(0), row * sizeof(at::BFloat16));
  }
}

// The packed projection kernels the Python layer's plan chose (backends/cpu_kernels.py's family names).
struct ProjectionFamily {
  at::Tensor (*linear)(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&);
  at::Tensor (*linear_silu_mul)(const at::Tensor&, const at::Tensor&);

  static ProjectionFamily named(c10::string_view name) {
    if (name == "amx") return {&amx_linear, &amx_linear_silu_mul};
    if (name == "avx512") return {&avx512_linear, &avx512_linear_silu_mul};
    if (name == "bf16dot") return {&bf16dot_linear, &bf16dot_linear_silu_mul};
    if (name == "avx2") return {&avx2_linear, &avx2_linear_silu_mul};
    TORCH_CHECK(false, "decode_stack: unknown projection family ", name);
  }

  // x · W^T (+ bias) as the Python layer computes it: on the GEMV when given the raw weight (one row), else
  // on the family's kernel with the packed one.
  at::Tensor project(const at::Tensor& x, const at::Tensor& packed, const at::Tensor* raw,
                     const c10::optional<at::Tensor>& bias = c10::nullopt) const {
    return raw != nullptr ? gemv_bf16(x, *raw, bias) : linear(x, packed, bias);
  }
};

// layers.rms_norm on [T, H, D] heads, op for op as the Python layer calls it (QK-norm): normalised in
// float32 without a weight, rounded back to bf16, then scaled by the bf16 weight.
at::Tensor head_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return at::rms_norm(x.to(at::kFloat), {x.size(-1)}, c10::nullopt, eps).to(at::kBFloat16) * weight;
}

}  // namespace

// hidden [T, hidden] bf16: the step's embedded decode rows (each request's token and any drafts). Per layer
// l, in the lists: input/post-attention norm weights, the QKV, O and down weights packed for the
// `projections` family ("amx", "avx512", "bf16dot" or "avx2"), the gate/up weight packed gate/up-interleaved (its
// linear_silu_mul's layout), and the KV cache [2, blocks, block_size, H_kv, D] (D = 64, 128 or 256, the
// same in every layer). Attention: decode over block_table/seq_lens (the keys after any shared prefix) and,
// when prefix_block_tables is given, the shared prefix through the `attention` family's many-row kernel
// ("amx": paged_attention_amx with prefix_packed[l], an empty tensor packing on the fly; "avx512" or
// "avx2": paged_attention_avx512 or paged_attention_avx2, prefix_packed empty; "none": no shared prefix is
// given), merged by log-sum-exp. single_row_weights: empty,
// or per layer the raw QKV, O, gate/up and down weights (4 per layer), which a one-row step multiplies on
// the GEMV, as the Python layer does. qkv_biases: empty, or per layer the QKV projection's bias (Qwen2).
// q_norms, k_norms: empty, or per layer the QK-norm weights [D] (Qwen3). unrotated_layers: the layers whose
// queries and keys take no rotary (SmolLM3's NoPE layers). residual_multiplier: what each layer's attention
// and MLP outputs are multiplied by as they join the residual stream (Granite's; 1: none). quant_segments:
// empty, or (GGUF-quantised weights, through quant_linear; the packed lists are then empty) per layer the number of row
// segments of the QKV, O, gate/up and down weights, with quant_cols their inner sizes and quant_data /
// quant_types the segments in that order, quant_gemv_max_rows / quant_fused_max_rows quant_linear's limits of
// its paths and quant_int8_activations its int8_activations. Returns (hidden, residual) after the last layer.
std::tuple<at::Tensor, at::Tensor> decode_stack(
    const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& signed_sin, at::TensorList input_norms,
    at::TensorList post_norms, at::TensorList qkv_packed, at::TensorList o_packed, at::TensorList gate_up_packed,
    at::TensorList down_packed, at::TensorList kv_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const c10::optional<at::Tensor>& prefix_block_tables,
    const c10::optional<at::Tensor>& prefix_kv_lens, const c10::optional<at::Tensor>& prefix_q_starts,
    at::TensorList prefix_packed, at::TensorList single_row_weights, at::TensorList qkv_biases,
    at::TensorList q_norms, at::TensorList k_norms, at::IntArrayRef unrotated_layers, double residual_multiplier,
    int64_t num_heads, int64_t num_kv_heads, double eps,
    double scale, int64_t split_size, at::TensorList quant_data, at::IntArrayRef quant_types,
    at::IntArrayRef quant_segments, at::IntArrayRef quant_cols, int64_t quant_gemv_max_rows,
    int64_t quant_fused_max_rows, bool quant_int8_activations, c10::string_view projections,
    c10::string_view attention) {
  const ProjectionFamily family = ProjectionFamily::named(projections);
  TORCH_CHECK(attention == "amx" || attention == "avx512" || attention == "avx2" || attention == "none",
              "decode_stack: unknown attention family ", attention);
  const bool amx_attention = attention == "amx";
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  const bool quantized = !quant_segments.empty();
  TORCH_CHECK(input_norms.size() == kv_caches.size() && post_norms.size() == kv_caches.size(),
              "decode_stack: every per-layer list needs one entry per layer");
  TORCH_CHECK(quantized || (qkv_packed.size() == kv_caches.size() && o_packed.size() == kv_caches.size() &&
                            gate_up_packed.size() == kv_caches.size() && down_packed.size() == kv_caches.size()),
              "decode_stack: every per-layer list needs one entry per layer");
  // Quantised projections: per layer, the QKV, O, gate/up and down weights' segment counts and inner sizes;
  // their segments' blocks and types in that order.
  std::vector<int64_t> first_segment(quant_segments.size() + 1, 0);
  if (quantized) {
    TORCH_CHECK(static_cast<int64_t>(quant_segments.size()) == 4 * num_layers && quant_cols.size() == quant_segments.size(),
                "decode_stack: quantised weights need 4 projections per layer");
    for (size_t i = 0; i < quant_segments.size(); ++i) first_segment[i + 1] = first_segment[i] + quant_segments[i];
    TORCH_CHECK(static_cast<int64_t>(quant_data.size()) == first_segment.back() &&
                    quant_types.size() == quant_data.size(),
                "decode_stack: one type per quantised segment");
  }
  const bool cascade = prefix_block_tables.has_value();
  TORCH_CHECK(!cascade || attention != "none", "decode_stack: a shared prefix needs a many-row attention family");
  TORCH_CHECK(!cascade || (prefix_kv_lens.has_value() && prefix_q_starts.has_value() &&
                           (!amx_attention || static_cast<int64_t>(prefix_packed.size()) == num_layers)),
              "decode_stack: a shared prefix needs its lengths, query starts and one packed entry per layer");
  TORCH_CHECK(single_row_weights.empty() || static_cast<int64_t>(single_row_weights.size()) == 4 * num_layers,
              "decode_stack: single_row_weights needs the 4 raw weights of every layer");
  TORCH_CHECK(qkv_biases.empty() || static_cast<int64_t>(qkv_biases.size()) == num_layers,
              "decode_stack: qkv_biases needs one bias per layer, or none");
  TORCH_CHECK(q_norms.size() == k_norms.size() &&
                  (q_norms.empty() || static_cast<int64_t>(q_norms.size()) == num_layers),
              "decode_stack: q_norms and k_norms need one weight per layer each, or none");
  TORCH_CHECK(num_layers > 0, "decode_stack: no layers");
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.scalar_type() == at::kBFloat16,
              "decode_stack: hidden must be bf16 [T, hidden]");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "decode_stack: query heads must be a multiple of KV heads");
  const int64_t kDim = kv_caches[0].size(-1);
  TORCH_CHECK(many_row_head_size(kDim), "decode_stack: head size ", kDim, " has no many-row kernel");
  const int64_t T = hidden_in.size(0), group = num_heads / num_kv_heads;
  const int64_t q_size = num_heads * kDim, kv_size = num_kv_heads * kDim;
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T && slot_mapping.is_contiguous(),
              "decode_stack: slot_mapping must be int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();

  at::Tensor hidden = hidden_in;
  c10::optional<at::Tensor> residual;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor& cache = kv_caches[l];
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() && cache.size(3) == num_kv_heads &&
                    cache.size(4) == kDim && cache.scalar_type() == at::kBFloat16,
                "decode_stack: KV caches must be contiguous bf16 [2, blocks, block_size, H_kv, D], one D");
    const at::Tensor k_cache = cache.select(0, 0), v_cache = cache.select(0, 1);

    auto [x, res] = add_rms_norm(hidden, residual, input_norms[l], eps);
    const bool gemv = !single_row_weights.empty() && T == 1;
    auto raw = [&](int64_t i) -> const at::Tensor* { return gemv ? &single_row_weights[4 * l + i] : nullptr; };
    // Projection i of this layer: quantised, or on the GEMV / AMX as the Python layer does.
    auto projection = [&](const at::Tensor& in, int64_t i, const at::TensorList packed,
                          const c10::optional<at::Tensor>& bias = c10::nullopt) {
      if (!quantized) return family.project(in, packed[l], raw(i), bias);
      const int64_t a = first_segment[4 * l + i], b = first_segment[4 * l + i + 1];
      return quant_linear(in, quant_data.slice(a, b - a), quant_types.slice(a, b - a), quant_cols[4 * l + i], bias,
                          quant_gemv_max_rows, quant_fused_max_rows, quant_int8_activations);
    };
    const at::Tensor qkv = projection(x, 0, qkv_packed,
                                      qkv_biases.empty() ? c10::nullopt : c10::optional<at::Tensor>(qkv_biases[l]));
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decode_stack: the QKV weight does not match the heads");
    at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({T, num_heads + num_kv_heads, kDim});
    if (!q_norms.empty())
      qk = at::cat({head_rms_norm(qk.narrow(1, 0, num_heads), q_norms[l], eps),
                    head_rms_norm(qk.narrow(1, num_heads, num_kv_heads), k_norms[l], eps)}, 1);
    if (std::find(unrotated_layers.begin(), unrotated_layers.end(), l) == unrotated_layers.end())
      qk = rotary(qk, cos, signed_sin);
    const at::Tensor q = qk.narrow(1, 0, num_heads);
    write_slots(qk.narrow(1, num_heads, num_kv_heads), k_cache, slots, T);
    write_slots(qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, kDim}), v_cache, slots, T);

    auto [out, lse] = paged_decode(q.reshape({T, num_kv_heads, group, kDim}).contiguous(), k_cache, v_cache,
                                   block_table, seq_lens, scale, split_size);
    at::Tensor attn;
    if (cascade) {
      at::Tensor out_p, lse_p;
      if (amx_attention) {
        const at::Tensor& packed = prefix_packed[l];
        std::tie(out_p, lse_p) = paged_attention_amx(
            q, k_cache, v_cache, *prefix_block_tables, *prefix_kv_lens, *prefix_q_starts, scale, false, true,
            packed.defined() && packed.numel() > 0 ? c10::optional<at::Tensor>(packed) : c10::nullopt);
      } else {
        const auto many_rows = attention == "avx512" ? &paged_attention_avx512 : &paged_attention_avx2;
        std::tie(out_p, lse_p) = many_rows(q, k_cache, v_cache, *prefix_block_tables, *prefix_kv_lens,
                                           *prefix_q_starts, scale, false, true);
      }
      attn = merge_attention(out_p.view(out.sizes()), lse_p.view(lse.sizes()), out, lse, true);
    } else {
      attn = out.to(at::kBFloat16);
    }
    // As the Python layer rounds it: the bf16 output times the multiplier, rounded to bf16.
    auto to_residual = [&](at::Tensor out) { return residual_multiplier == 1.0 ? out : out.mul(residual_multiplier); };
    const at::Tensor o = to_residual(projection(attn.reshape({T, q_size}), 1, o_packed));
    auto [x2, res2] = add_rms_norm(o, res, post_norms[l], eps);
    at::Tensor h;
    if (quantized) {
      const int64_t a = first_segment[4 * l + 2], b = first_segment[4 * l + 3];
      h = quant_linear_silu_mul(x2, quant_data.slice(a, b - a), quant_types.slice(a, b - a), quant_cols[4 * l + 2],
                                quant_gemv_max_rows, quant_fused_max_rows, quant_int8_activations);
    } else {
      h = gemv ? silu_mul(family.project(x2, gate_up_packed[l], raw(2)))
               : family.linear_silu_mul(x2, gate_up_packed[l]);
    }
    hidden = to_residual(projection(h, 3, down_packed));
    residual = res2;
  }
  return {hidden, *residual};
}

}  // namespace kvserve
