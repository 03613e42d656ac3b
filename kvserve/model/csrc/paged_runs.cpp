// The argument checks every many-row attention kernel shares (paged_attention_amx, paged_attention_avx512,
// paged_attention_avx2): one contract, one place that states it; and the plain-vector kernels' work items.

#include "common.h"

namespace kvserve {

PagedRunsShape check_paged_runs(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& kv_lens,
                                const at::Tensor& q_starts, bool causal) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && many_row_head_size(q.size(2)) &&
                  q.stride(2) == 1 && q.stride(1) == q.size(2),
              op, ": q must be bf16 [T, H, D] (D = 64, 128 or 256) with each token's heads contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
                  k_cache.size(3) == q.size(2) && k_cache.sizes() == v_cache.sizes(),
              op, ": caches must be contiguous bf16 [num_blocks, block_size, H_kv, D] with q's head size");
  PagedRunsShape shape;
  shape.head_dim = q.size(2);
  shape.num_heads = q.size(1);
  shape.kv_heads = k_cache.size(2);
  shape.block_size = k_cache.size(1);
  TORCH_CHECK(shape.num_heads % shape.kv_heads == 0, op, ": query heads must be a multiple of KV heads");
  shape.group = shape.num_heads / shape.kv_heads;
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              op, ": block_tables must be contiguous int32 [S, max_blocks]");
  shape.num_spans = block_tables.size(0);
  shape.max_blocks = block_tables.size(1);
  TORCH_CHECK(kv_lens.scalar_type() == at::kInt && kv_lens.numel() == shape.num_spans &&
                  q_starts.scalar_type() == at::kInt && q_starts.numel() == shape.num_spans + 1,
              op, ": kv_lens int32 [S] and q_starts int32 [S + 1]");
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  const int32_t* starts = q_starts.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[shape.num_spans] == q.size(0), op, ": q_starts must cover q");
  for (int64_t s = 0; s < shape.num_spans; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    TORCH_CHECK(q_len >= 0 && lens[s] <= shape.max_blocks * shape.block_size && (q_len == 0 || lens[s] >= 1) &&
                    (!causal || q_len <= lens[s]),
                op, ": span ", s, " has ", q_len, " queries and ", lens[s], " keys");
    const int32_t* blocks = tables + s * shape.max_blocks;
    for (int64_t b = 0; b < (lens[s] + shape.block_size - 1) / shape.block_size; ++b)
      TORCH_CHECK(blocks[b] >= 0 && blocks[b] < k_cache.size(0), op, ": block id out of range");
  }
  return shape;
}

RowItems split_row_items(const PagedRunsShape& shape, const at::Tensor& block_tables, const at::Tensor& kv_lens,
                         const at::Tensor& q_starts, int64_t row_group, int64_t max_rows) {
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  const int32_t* starts = q_starts.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  RowItems out;
  int64_t total_rows = 0;
  for (int64_t s = 0; s < shape.num_spans; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    out.spans.push_back({starts[s], q_len, lens[s], tables + s * shape.max_blocks});
    total_rows += q_len * shape.group;
  }
  const int64_t wanted_items = 4 * kernel_threads();
  const int64_t item_rows = std::clamp<int64_t>(
      (total_rows * shape.kv_heads + wanted_items - 1) / wanted_items / row_group * row_group, row_group, max_rows);
  for (int64_t s = 0; s < shape.num_spans; ++s) {
    const int64_t rows = out.spans[s].q_len * shape.group;
    for (int64_t h = 0; h < shape.kv_heads; ++h)
      for (int64_t r = 0; r < rows; r += item_rows) out.items.push_back({s, h, r, std::min(item_rows, rows - r)});
  }
  return out;
}

}  // namespace kvserve
