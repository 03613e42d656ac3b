// Registers the CPU kernels as torch ops under torch.ops.kvserve. Built on first use by
// kvserve/model/cpu_kernels.py (torch.utils.cpp_extension, -march=native). The torch reference paths stay
// the oracle: tests compare every kernel against them.
//
//   projections.cpp  gemv_bf16, amx_pack, amx_linear: the bf16 projections; amx_linear_silu_mul: the MLP's
//                    gate/up projection and its activation in one
//   pack_pairs.cpp   pack_bf16_pairs: the weight layout of the AVX-512 and AVX2 projection families
//   linear_avx512.cpp avx512_linear, avx512_linear_silu_mul: the same projections on AVX-512 without BF16
//                    instructions or AMX (fp32 FMAs on bf16 weights widened in registers);
//                    bf16dot_linear, bf16dot_linear_silu_mul: on the same layout with VDPBF16PS (AVX512-BF16)
//   linear_avx2.cpp  avx2_linear, avx2_linear_silu_mul: the widening projections on AVX2 and FMA
//   quantized.cpp    quant_linear, quant_linear_silu_mul: projections on GGUF-quantised weights (int8 VNNI
//                    dot products for few rows, dequantised bf16 panels for more); quant_dequantize: their values
//   attention.cpp    paged_decode: decode attention over the paged KV cache, read in place;
//                    merge_attention: two attention halves into one by their log-sum-exps
//   flash_attention.cpp  paged_attention_amx: many query rows (prefill, shared-prefix decode) on AMX tiles;
//                    pack_kv_amx: a run of blocks in its tile layouts, for reuse across steps
//   flash_attention_avx512.cpp  paged_attention_avx512: the same many-row attention on plain AVX-512
//   flash_attention_avx2.cpp  paged_attention_avx2: the same on AVX2 and FMA
//   paged_runs.cpp   check_paged_runs: the argument checks the many-row kernels share;
//                    split_row_items: the plain-vector kernels' work items
//   elementwise.cpp  add_rms_norm, silu_mul, gelu_tanh_mul, rotary: the glue between projections
//   lora.cpp         lora_add: a LoRA adapter's low-rank update added to a projection's rows in place
//   sampling.cpp     argmax_rows: greedy sampling's reduction; mask_logits: a grammar's token mask
//   decode_stack.cpp decode_stack: a decode step's whole decoder stack (the kernels above) in one call
//   worker_pool.cpp  the threads the kernels' parallel regions run on; use_worker_pool: OpenMP instead

#include <torch/library.h>

#include "common.h"

TORCH_LIBRARY(kvserve, m) {
  m.def("gemv_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor", &kvserve::gemv_bf16);
  m.def("has_avx512_bf16() -> bool", &kvserve::has_avx512_bf16);
  m.def("has_amx() -> bool", &kvserve::has_amx);
  m.def("use_worker_pool(bool enabled) -> ()", &kvserve::use_worker_pool);
  m.def("set_kernel_threads(int threads) -> ()", &kvserve::set_kernel_threads);
  m.def("amx_pack(Tensor w) -> Tensor", &kvserve::amx_pack);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &kvserve::amx_linear);
  m.def("amx_linear_silu_mul(Tensor x, Tensor packed) -> Tensor", &kvserve::amx_linear_silu_mul);
  m.def("has_avx512() -> bool", &kvserve::has_avx512);
  m.def("quant_linear(Tensor x, Tensor[] data, int[] types, int cols, Tensor? bias, int gemv_max_rows, "
        "int fused_max_rows, bool int8_activations=False) -> Tensor",
        &kvserve::quant_linear);
  m.def("quant_linear_silu_mul(Tensor x, Tensor[] data, int[] types, int cols, int gemv_max_rows, "
        "int fused_max_rows, bool int8_activations=False) -> Tensor",
        &kvserve::quant_linear_silu_mul);
  m.def("quant_dequantize(Tensor data, int type, int cols, Tensor rows, ScalarType dtype) -> Tensor",
        &kvserve::quant_dequantize);
  m.def("has_quantized_gemv() -> bool", &kvserve::has_quantized_gemv);
  m.def("quant_interleaved_rows() -> int", &kvserve::quant_interleaved_rows);
  m.def("pack_bf16_pairs(Tensor w) -> Tensor", &kvserve::pack_bf16_pairs);
  m.def("avx512_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &kvserve::avx512_linear);
  m.def("avx512_linear_silu_mul(Tensor x, Tensor packed) -> Tensor", &kvserve::avx512_linear_silu_mul);
  m.def("bf16dot_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &kvserve::bf16dot_linear);
  m.def("bf16dot_linear_silu_mul(Tensor x, Tensor packed) -> Tensor", &kvserve::bf16dot_linear_silu_mul);
  m.def("avx2_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &kvserve::avx2_linear);
  m.def("avx2_linear_silu_mul(Tensor x, Tensor packed) -> Tensor", &kvserve::avx2_linear_silu_mul);
  m.def("has_avx2() -> bool", &kvserve::has_avx2);
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &kvserve::add_rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &kvserve::silu_mul);
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor", &kvserve::gelu_tanh_mul);
  m.def("rotary(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor", &kvserve::rotary);
  m.def("paged_attention_amx(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor kv_lens, "
        "Tensor q_starts, float scale, bool causal, bool fp32_out, Tensor? packed=None, int shared_keys=0) -> "
        "(Tensor, Tensor)",
        &kvserve::paged_attention_amx);
  m.def("paged_attention_avx512(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor kv_lens, "
        "Tensor q_starts, float scale, bool causal, bool fp32_out) -> (Tensor, Tensor)",
        &kvserve::paged_attention_avx512);
  m.def("paged_attention_avx2(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor kv_lens, "
        "Tensor q_starts, float scale, bool causal, bool fp32_out) -> (Tensor, Tensor)",
        &kvserve::paged_attention_avx2);
  m.def("pack_kv_amx(Tensor k_cache, Tensor v_cache, Tensor block_table, int kv_len) -> Tensor",
        &kvserve::pack_kv_amx);
  m.def("merge_attention(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, bool bf16_out) -> Tensor",
        &kvserve::merge_attention);
  m.def("argmax_rows(Tensor x) -> Tensor", &kvserve::argmax_rows);
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, Tensor parts, Tensor? rows) -> ()", &kvserve::lora_add);
  m.def("mask_logits(Tensor(a!) logits, Tensor rows, Tensor bitmask) -> ()", &kvserve::mask_logits);
  m.def("decode_stack(Tensor hidden, Tensor cos, Tensor signed_sin, Tensor[] input_norms, Tensor[] post_norms, "
        "Tensor[] qkv_packed, Tensor[] o_packed, Tensor[] gate_up_packed, Tensor[] down_packed, Tensor[] kv_caches, "
        "Tensor slot_mapping, Tensor block_table, Tensor seq_lens, Tensor? prefix_block_tables, "
        "Tensor? prefix_kv_lens, Tensor? prefix_q_starts, Tensor[] prefix_packed, Tensor[] single_row_weights, "
        "Tensor[] qkv_biases, Tensor[] q_norms, Tensor[] k_norms, int[] unrotated_layers, float residual_multiplier, "
        "int num_heads, int num_kv_heads, "
        "float eps, float scale, int split_size, Tensor[] quant_data, int[] quant_types, int[] quant_segments, "
        "int[] quant_cols, int quant_gemv_max_rows, int quant_fused_max_rows, bool quant_int8_activations, str projections, str attention) -> (Tensor, Tensor)",
        &kvserve::decode_stack);
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, float scale, "
        "int split_size) -> (Tensor, Tensor)",
        &kvserve::paged_decode);
}
