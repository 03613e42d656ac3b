"""One layer's attention through the C++ kernels (the cpu_kernels backend), and the metadata it reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from kvserve.model.attention import TorchPagedAttention, merge_by_lse
from kvserve.model.backends.base import AttentionMetadata

# Head sizes the many-row attention kernels and the fused decode stack take (csrc/common.h, many_row_head_size).
MANY_ROW_HEAD_SIZES = (64, 128, 256)

# The many-row attention kernels: AMX tiles, or fp32 FMAs on AVX-512 or AVX2 (the op each of those calls).
ManyRowFamily = Literal["amx", "avx512", "avx2"]
VECTOR_MANY_ROW_KERNELS = {"avx512": "paged_attention_avx512", "avx2": "paged_attention_avx2"}

# What a layer keeps of a run of blocks: the key naming the contents it was packed from, and the packing.
Kept = tuple[tuple[int, ...], torch.Tensor]


@dataclass(slots=True)
class PagedRuns:
    """Runs of query tokens against paged keys, for kernels that take a whole batch in one call: run i owns
    query tokens q_starts[i] .. q_starts[i+1]-1 (counted from the first token handed to the kernel) and
    attends to keys 0..kv_lens[i]-1 held in the blocks of row i of block_tables."""

    block_tables: torch.Tensor  # int32 [num_runs, max_blocks], padded with block 0
    kv_lens: torch.Tensor  # int32 [num_runs]
    q_starts: torch.Tensor  # int32 [num_runs + 1]


@dataclass(slots=True)
class CpuAttentionMetadata(AttentionMetadata):
    """The common layout, plus the same layout for the one-call kernels and what names the KV they pack."""

    # Every prefill chunk (causal, ending at its last key), and all decodes against the shared prefix
    # blocks; None where no many-row kernel takes them.
    prefill_runs: PagedRuns | None = None
    decode_prefix_runs: PagedRuns | None = None
    # Names the shared prefix's KV contents (its block ids and their write versions): equal keys, equal KV.
    # None when nobody tracks the writes; the attention then keeps nothing derived from the prefix.
    decode_prefix_key: tuple[int, ...] | None = None
    # The leading keys every prefill chunk holds in the same blocks (a system prompt), a whole number of
    # the AMX kernel's key steps, packed once and kept across steps: their blocks and the key of their contents.
    prefill_prefix_keys: int = 0
    prefill_prefix_table: torch.Tensor | None = None  # int32 [blocks holding prefill_prefix_keys]
    prefill_prefix_key: tuple[int, ...] | None = None


class CpuKernelPagedAttention(TorchPagedAttention):
    """Attention through the C++ kernels, which read each request's KV blocks in place.

    Decodes go through the split-KV decode kernel. With a many-row kernel (bf16, head size 64, 128 or 256),
    every prefill chunk of the step is one call, and so is the shared-prefix half of cascade decode: every
    decode's query heads against the prefix they share. ``many_rows`` names it: "amx" (tile matmuls, packed
    keys kept across steps), "avx512" or "avx2" (the same contract on fp32 FMAs, nothing kept); None: those
    calls stay on the reference path (the prefix part is then one flash-attention call for the whole batch).
    The prefix and suffix halves merge exactly through their log-sum-exps.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None, many_rows: ManyRowFamily | None = None,
                 split_size: int = 256) -> None:
        # A sliding-window layer takes the kernels in steps where the window hides no key, and the reference
        # path (explicit window mask) in the steps where it does.
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        assert many_rows is None or head_dim in MANY_ROW_HEAD_SIZES, f"many-row kernels take {MANY_ROW_HEAD_SIZES}"
        # Without AMX: the plain-vector kernels of the same contract, against torch's flash attention per chunk
        # (gather copy, explicit mask) in benchmarks/cpu_kernels.py's many-row cases.
        self.many_rows = many_rows
        # Looked up once: the op is called per layer and step.
        self._vector_op = (getattr(torch.ops.kvserve, VECTOR_MANY_ROW_KERNELS[many_rows])
                           if many_rows in VECTOR_MANY_ROW_KERNELS else None)
        # Keys per decode-kernel work item (BackendConfig.decode_split_size).
        self.split_size = split_size
        # This layer's shared prefix in the AMX kernel's tile layouts, with the key of the contents it was
        # packed from. Decodes attend to the same prefix step after step; packing it is a large share of the
        # prefix half's time, and a packed prefix also lets the kernel split its rows into more work items
        # (benchmarks/cpu_kernels.py, cascade decode with the prefix pre-packed).
        self._packed_prefix: Kept | None = None
        # The same for the keys every prefill chunk of a step shares (the system prompt of concurrent agent
        # turns): each chunk's work items then pack only their own keys after it. Kept apart from the decode
        # prefix, which may cover a different run of blocks in the same steps.
        self._packed_prefill_prefix: Kept | None = None

    def _uses_amx(self, q: torch.Tensor) -> bool:
        return self.many_rows == "amx" and q.dtype == torch.bfloat16

    def _vector_kernel(self, q: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
        """The plain-vector many-row kernel (a torch op) for this query, or None."""
        return self._vector_op if q.dtype == torch.bfloat16 else None

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: CpuAttentionMetadata,
    ) -> torch.Tensor:
        runs = meta.prefill_runs
        vector_kernel = self._vector_kernel(q)
        if runs is not None and vector_kernel is not None:
            out, _ = vector_kernel(q[meta.num_decode_tokens :], k_cache, v_cache, runs.block_tables, runs.kv_lens,
                                   runs.q_starts, self.scale, True, False)
            return out
        if runs is None or not self._uses_amx(q):
            return super()._prefill(q, k, v, k_cache, v_cache, meta)
        packed, shared_keys = None, 0
        if meta.prefill_prefix_table is not None and meta.prefill_prefix_key is not None:
            shared_keys = meta.prefill_prefix_keys
            packed = _kept(self._packed_prefill_prefix, meta.prefill_prefix_key)
            if packed is None:
                packed = torch.ops.kvserve.pack_kv_amx(k_cache, v_cache, meta.prefill_prefix_table, shared_keys)
                self._packed_prefill_prefix = (meta.prefill_prefix_key, packed)
        out, _ = torch.ops.kvserve.paged_attention_amx(
            q[meta.num_decode_tokens :], k_cache, v_cache, runs.block_tables, runs.kv_lens, runs.q_starts,
            self.scale, True, False, packed, shared_keys,
        )
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: CpuAttentionMetadata
    ) -> torch.Tensor:
        assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
        batch = q.shape[0]
        query = q.reshape(batch, self.num_kv_heads, self.group, self.head_dim).contiguous()
        out, lse = torch.ops.kvserve.paged_decode(
            query, k_cache, v_cache, meta.decode_block_table, meta.decode_seq_lens, self.scale, self.split_size
        )
        if meta.decode_prefix_blocks is not None:
            runs = meta.decode_prefix_runs
            vector_kernel = self._vector_kernel(q)
            if runs is not None and (self._uses_amx(q) or vector_kernel is not None):
                args = (q, k_cache, v_cache, runs.block_tables, runs.kv_lens, runs.q_starts, self.scale, False, True)
                if vector_kernel is not None:
                    out_p, lse_p = vector_kernel(*args)
                else:
                    packed = self.packed_prefix_for(k_cache, v_cache, runs, meta.decode_prefix_key)
                    out_p, lse_p = torch.ops.kvserve.paged_attention_amx(*args, packed)
                out_p = out_p.view(out.shape)
                lse_p = lse_p.view(lse.shape)
            else:
                out_p, lse_p = self._shared_prefix_flash(query, k_cache, v_cache, meta.decode_prefix_blocks)
            if q.dtype in (torch.bfloat16, torch.float32):
                out = torch.ops.kvserve.merge_attention(out_p, lse_p, out, lse, q.dtype == torch.bfloat16)
            else:
                out = merge_by_lse(out_p, lse_p, out, lse)
        return out.to(q.dtype).reshape(batch, self.num_heads, self.head_dim)

    def kept_prefix(self, key: tuple[int, ...] | None) -> torch.Tensor | None:
        """This layer's packed prefix if one is kept for these contents, else None."""
        return _kept(self._packed_prefix, key)

    def packed_prefix_for(self, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: PagedRuns,
                          key: tuple[int, ...] | None) -> torch.Tensor | None:
        """This layer's packed prefix: kept while its key holds, packed again when the key changes."""
        if key is None:
            return None
        packed = _kept(self._packed_prefix, key)
        if packed is None:
            packed = torch.ops.kvserve.pack_kv_amx(k_cache, v_cache, runs.block_tables[0], int(runs.kv_lens[0]))
            self._packed_prefix = (key, packed)
        return packed

    def _shared_prefix_flash(
        self,
        query: torch.Tensor,  # [batch, kv_heads, group, dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        prefix_blocks: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decode's attention over the shared prefix: fp32 out [batch, kv_heads, group, dim] and its
        log-sum-exp [batch, kv_heads, group]."""
        batch, kvh, group, dim = query.shape
        key_p = k_cache[prefix_blocks].flatten(0, 1).permute(1, 0, 2).unsqueeze(0)  # [1, kv_heads, Lp, dim]
        value_p = v_cache[prefix_blocks].flatten(0, 1).permute(1, 0, 2).unsqueeze(0)
        # Every request's query heads as one long "query sequence" per KV head: one flash-attention call
        # over the prefix for the whole batch, which also returns the log-sum-exp the merge needs.
        q_by_head = query.permute(1, 0, 2, 3).reshape(1, kvh, batch * group, dim)
        # The aten op behind F.scaled_dot_product_attention on CPU; called directly for its log-sum-exp.
        out_p, lse_p = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_by_head, key_p, value_p, scale=self.scale
        )[:2]
        out_p = out_p.float().view(kvh, batch, group, dim).permute(1, 0, 2, 3)
        lse_p = lse_p.view(kvh, batch, group).permute(1, 0, 2)
        return out_p, lse_p


def _kept(kept: Kept | None, key: tuple[int, ...] | None) -> torch.Tensor | None:
    """The packing in ``kept`` if it was packed from the contents ``key`` names."""
    return kept[1] if kept is not None and key is not None and kept[0] == key else None
