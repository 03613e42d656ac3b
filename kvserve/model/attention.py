"""Paged attention backends. The torch reference backend runs everywhere and is the correctness oracle.

KV memory per layer is one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
``block_id * block_size + offset``. The runner orders a step's tokens as

    [ decode tokens (one per request) | prefill chunk of request a | prefill chunk of request b | ... ]

and describes that layout once per step in ``AttentionMetadata``; every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from kvserve.model.cpu_kernels import load_cpu_kernels


@dataclass(slots=True)
class PrefillSpan:
    """One request's prefill chunk: queries q_start..q_start+q_len attend to keys 0..kv_len-1."""

    q_start: int
    q_len: int
    kv_len: int
    # None when the chunk starts at position 0: keys are exactly this chunk's, plain causal attention.
    block_ids: torch.Tensor | None = None  # [num_blocks] blocks holding keys 0..kv_len-1
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def history_mask(self) -> torch.Tensor:
        """[q_len, kv_len] bool, True = attend: each query sees the keys up to its own position. Built on
        first use and kept for the step's other layers; kernels that take the paged runs never build it."""
        if self._mask is None:
            assert self.block_ids is not None, "a chunk from position 0 is plain causal attention"
            device = self.block_ids.device
            positions = torch.arange(self.kv_len - self.q_len, self.kv_len, device=device)
            self._mask = torch.arange(self.kv_len, device=device)[None, :] <= positions[:, None]
        return self._mask


@dataclass(slots=True)
class PagedRuns:
    """Runs of query tokens against paged keys, for kernels that take a whole batch in one call: run i owns
    query tokens q_starts[i] .. q_starts[i+1]-1 (counted from the first token handed to the kernel) and
    attends to keys 0..kv_lens[i]-1 held in the blocks of row i of block_tables."""

    block_tables: torch.Tensor  # int32 [num_runs, max_blocks], padded with block 0
    kv_lens: torch.Tensor  # int32 [num_runs]
    q_starts: torch.Tensor  # int32 [num_runs + 1]


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decode_tokens: int = 0
    decode_block_table: torch.Tensor | None = None  # int32 [num_decodes, max_blocks], padded with block 0
    decode_seq_lens: torch.Tensor | None = None  # int32 [num_decodes]: keys the table above covers
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size]
    # Blocks every decode shares, read once for all of them; the table and mask above then cover only
    # the blocks after them. None: no shared prefix (or too short to be worth it).
    decode_prefix_blocks: torch.Tensor | None = None  # [num_shared_blocks]
    prefills: list[PrefillSpan] = field(default_factory=list)
    # The same layout for the one-call kernels: every prefill chunk (causal, ending at its last key), and
    # all decodes against the shared prefix blocks above.
    prefill_runs: PagedRuns | None = None
    decode_prefix_runs: PagedRuns | None = None
    # Names the shared prefix's KV contents (its block ids and their write versions): equal keys, equal KV.
    # None when nobody tracks the writes; a backend then keeps nothing derived from the prefix across steps.
    decode_prefix_key: tuple[int, ...] | None = None
    # The leading keys every prefill chunk holds in the same blocks (a system prompt), a multiple of 32, for
    # kernels that pack keys once and keep them across steps: their blocks and the key of their contents.
    prefill_prefix_keys: int = 0
    prefill_prefix_table: torch.Tensor | None = None  # int32 [blocks holding prefill_prefix_keys]
    prefill_prefix_key: tuple[int, ...] | None = None


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        ...


class TorchPagedAttention:
    """Gathers each request's blocks and calls scaled_dot_product_attention.

    Decodes are batched in one call: with grouped-query attention the query heads sharing a KV head are
    laid out as that head's "query positions" ([B, num_kv_heads, group, head_dim]), so K/V are never
    repeated and the padding mask is the only mask.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale if scale is not None else head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

        nd = meta.num_decode_tokens
        if nd == num_tokens:
            return self._decode(q, k_cache, v_cache, meta).view(num_tokens, -1)
        prefill_out = self._prefill(q, k, v, k_cache, v_cache, meta)  # [num_tokens - nd, num_heads, head_dim]
        if not nd:
            return prefill_out.view(num_tokens, -1)
        return torch.cat((self._decode(q[:nd], k_cache, v_cache, meta), prefill_out)).view(num_tokens, -1)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention of every prefill chunk (the tokens after the decodes), one scaled_dot_product_attention
        call per chunk."""
        nd = meta.num_decode_tokens
        out = torch.empty_like(q[nd:])
        for span in meta.prefills:
            qs = slice(span.q_start, span.q_start + span.q_len)
            query = q[qs].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
            if span.block_ids is None:
                key = k[qs].transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, q_len, head_dim]
                value = v[qs].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                key = k_cache[span.block_ids].flatten(0, 1)[: span.kv_len].transpose(0, 1).unsqueeze(0)
                value = v_cache[span.block_ids].flatten(0, 1)[: span.kv_len].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    query, key, value, attn_mask=span.history_mask(), scale=self.scale, enable_gqa=True
                )
            out[span.q_start - nd : span.q_start - nd + span.q_len] = o[0].transpose(0, 1)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert meta.decode_block_table is not None
        if meta.decode_prefix_blocks is not None:
            return self._decode_shared_prefix(q, k_cache, v_cache, meta)
        batch = q.shape[0]
        query = q.reshape(batch, self.num_kv_heads, self.group, self.head_dim)
        # [batch, max_blocks, block_size, kv_heads, head_dim] -> [batch, kv_heads, max_blocks * block_size, head_dim]
        key = k_cache[meta.decode_block_table].flatten(1, 2).transpose(1, 2)
        value = v_cache[meta.decode_block_table].flatten(1, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(query, key, value, attn_mask=meta.decode_mask, scale=self.scale)
        return o.reshape(batch, self.num_heads, self.head_dim)

    def _decode_shared_prefix(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Decode attention split at a prefix every request shares (cascade attention).

            keys:  [ shared prefix (Lp), read once | request's own suffix (Ls), padded ]
            scores = [ q·Kp  |  q·Ks ]  -> one softmax over both -> p[:, :Lp]·Vp + p[:, Lp:]·Vs

        One softmax over the concatenated scores is the same arithmetic as attention over the whole
        sequence; only the prefix K/V are gathered once instead of once per request.
        """
        assert meta.decode_prefix_blocks is not None and meta.decode_mask is not None
        batch, kvh, group, dim = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        query = q.reshape(batch, kvh, group, dim)
        key_p = k_cache[meta.decode_prefix_blocks].flatten(0, 1).permute(1, 0, 2)  # [kv_heads, Lp, dim]
        value_p = v_cache[meta.decode_prefix_blocks].flatten(0, 1).permute(1, 0, 2)
        key_s = k_cache[meta.decode_block_table].flatten(1, 2).transpose(1, 2)  # [batch, kv_heads, Ls, dim]
        value_s = v_cache[meta.decode_block_table].flatten(1, 2).transpose(1, 2)
        # Prefix scores for every request at once: [kv_heads, batch * group, Lp]
        q_by_head = query.permute(1, 0, 2, 3).reshape(kvh, batch * group, dim)
        scores_p = torch.matmul(q_by_head, key_p.transpose(1, 2)).float()
        scores_p = scores_p.view(kvh, batch, group, -1).permute(1, 0, 2, 3)  # [batch, kv_heads, group, Lp]
        scores_s = torch.matmul(query, key_s.transpose(2, 3)).float()  # [batch, kv_heads, group, Ls]
        scores_s = scores_s.masked_fill(~meta.decode_mask, float("-inf"))
        probs = torch.softmax(torch.cat((scores_p, scores_s), dim=-1) * self.scale, dim=-1).to(q.dtype)
        num_prefix = key_p.shape[1]
        probs_p = probs[..., :num_prefix].permute(1, 0, 2, 3).reshape(kvh, batch * group, num_prefix)
        out_p = torch.matmul(probs_p, value_p).view(kvh, batch, group, dim).permute(1, 0, 2, 3)
        out_s = torch.matmul(probs[..., num_prefix:], value_s)  # [batch, kv_heads, group, dim]
        return (out_p + out_s).reshape(batch, self.num_heads, dim)


class CpuKernelPagedAttention(TorchPagedAttention):
    """Attention through the C++ kernels, which read each request's KV blocks in place.

    Decodes go through the split-KV decode kernel. With AMX (bf16, head size 64), every prefill chunk of
    the step is one tile-matmul call, and so is the shared-prefix half of cascade decode: every decode's
    query heads against the prefix they share. Without AMX, the AVX-512 kernel of the same contract takes
    those calls (fp32 FMAs, no packed keys kept across steps); without either, they stay on the reference
    path (the prefix part is then one flash-attention call for the whole batch). The prefix and suffix
    halves merge exactly through their log-sum-exps.
    """

    # Keys per decode-kernel work item: short enough that one long sequence still spreads over every core.
    split_size = 256

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 amx: bool = False, avx512: bool = False) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.amx = amx and head_dim == 64
        # Without AMX: the AVX-512 kernel of the same contract, against torch's flash attention per chunk
        # (gather copy, explicit mask) in benchmarks/cpu_kernels.py's many-row cases.
        self.avx512 = avx512 and head_dim == 64 and not self.amx
        # Per layer (its K cache's address): the shared prefix's keys in the AMX kernel's tile layouts and
        # the key of the contents they were packed from. Decodes attend to the same prefix step after step;
        # packing it took about a third of the prefix half's time, and a packed prefix also lets the kernel
        # split its rows into more work items (one layer holds ~1.2 MB for a 1,568-token prefix).
        self._packed_prefix: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
        # The same for the keys every prefill chunk of a step shares (the system prompt of concurrent agent
        # turns): each chunk's work items then pack only their own keys after it. Kept apart from the decode
        # prefix, which may cover a different run of blocks in the same steps.
        self._packed_prefill_prefix: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}

    def _uses_amx(self, q: torch.Tensor) -> bool:
        return self.amx and q.dtype == torch.bfloat16

    def _uses_avx512(self, q: torch.Tensor) -> bool:
        return self.avx512 and q.dtype == torch.bfloat16

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        runs = meta.prefill_runs
        if runs is not None and self._uses_avx512(q):
            out, _ = torch.ops.kvserve.paged_attention_avx512(
                q[meta.num_decode_tokens :], k_cache, v_cache, runs.block_tables, runs.kv_lens, runs.q_starts,
                self.scale, True, False,
            )
            return out
        if runs is None or not self._uses_amx(q):
            return super()._prefill(q, k, v, k_cache, v_cache, meta)
        packed, shared_keys = None, 0
        if meta.prefill_prefix_table is not None and meta.prefill_prefix_key is not None:
            shared_keys = meta.prefill_prefix_keys
            packed = self._kept_or_packed(self._packed_prefill_prefix, k_cache, v_cache, meta.prefill_prefix_table,
                                          shared_keys, meta.prefill_prefix_key)
        out, _ = torch.ops.kvserve.paged_attention_amx(
            q[meta.num_decode_tokens :], k_cache, v_cache, runs.block_tables, runs.kv_lens, runs.q_starts,
            self.scale, True, False, packed, shared_keys,
        )
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
        batch = q.shape[0]
        query = q.reshape(batch, self.num_kv_heads, self.group, self.head_dim).contiguous()
        out, lse = torch.ops.kvserve.paged_decode(
            query, k_cache, v_cache, meta.decode_block_table, meta.decode_seq_lens, self.scale, self.split_size
        )
        if meta.decode_prefix_blocks is not None:
            runs = meta.decode_prefix_runs
            if runs is not None and (self._uses_amx(q) or self._uses_avx512(q)):
                args = (q, k_cache, v_cache, runs.block_tables, runs.kv_lens, runs.q_starts, self.scale, False, True)
                if self._uses_amx(q):
                    packed = self.packed_prefix_for(k_cache, v_cache, runs, meta.decode_prefix_key)
                    out_p, lse_p = torch.ops.kvserve.paged_attention_amx(*args, packed)
                else:
                    out_p, lse_p = torch.ops.kvserve.paged_attention_avx512(*args)
                out_p = out_p.view(out.shape)
                lse_p = lse_p.view(lse.shape)
            else:
                out_p, lse_p = self._shared_prefix_flash(query, k_cache, v_cache, meta.decode_prefix_blocks)
            if q.dtype in (torch.bfloat16, torch.float32):
                out = torch.ops.kvserve.merge_attention(out_p, lse_p, out, lse, q.dtype == torch.bfloat16)
            else:
                out = merge_by_lse(out_p, lse_p, out, lse)
        return out.to(q.dtype).reshape(batch, self.num_heads, self.head_dim)

    def kept_prefix(self, k_cache: torch.Tensor, key: tuple[int, ...] | None) -> torch.Tensor | None:
        """The layer's packed prefix if one is kept for these contents, else None."""
        return self._kept(self._packed_prefix, k_cache, key) if key is not None else None

    def packed_prefix_for(self, k_cache: torch.Tensor, v_cache: torch.Tensor, runs: PagedRuns,
                          key: tuple[int, ...] | None) -> torch.Tensor | None:
        """The layer's packed prefix: kept while its key holds, packed again when the key changes."""
        if key is None:
            return None
        return self._kept_or_packed(self._packed_prefix, k_cache, v_cache, runs.block_tables[0],
                                    int(runs.kv_lens[0]), key)

    @staticmethod
    def _kept_or_packed(kept: dict[int, tuple[tuple[int, ...], torch.Tensor]], k_cache: torch.Tensor,
                        v_cache: torch.Tensor, table: torch.Tensor, num_keys: int,
                        key: tuple[int, ...]) -> torch.Tensor:
        """This layer's entry of ``kept`` if it was packed from the same contents, else packed now and kept."""
        packed = CpuKernelPagedAttention._kept(kept, k_cache, key)
        if packed is None:
            packed = torch.ops.kvserve.pack_kv_amx(k_cache, v_cache, table, num_keys)
            kept[k_cache.data_ptr()] = (key, packed)
        return packed

    @staticmethod
    def _kept(kept: dict[int, tuple[tuple[int, ...], torch.Tensor]], k_cache: torch.Tensor,
              key: tuple[int, ...]) -> torch.Tensor | None:
        """The layer's entry of ``kept`` (keyed by its K cache's address) if packed from these contents."""
        entry = kept.get(k_cache.data_ptr())
        return entry[1] if entry is not None and entry[0] == key else None

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


def merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over keys A ∪ B from the halves over A and over B (fp32 outs [..., dim], lses [...]):
    each half weighted by its share of the total softmax mass, exp(lse_half - lse_total). A half with no
    keys has lse -inf and weight 0."""
    lse_total = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse_total).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse_total).unsqueeze(-1)
    return out_a * w_a + out_b * w_b


def get_attention_backend(
    device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, cpu_kernels: bool = True
) -> AttentionBackend:
    """The one place a backend is chosen. Fused CUDA kernels plug in here without touching model code."""
    kernels = load_cpu_kernels() if cpu_kernels and device.type == "cpu" else None
    if kernels is not None:
        return CpuKernelPagedAttention(num_heads, num_kv_heads, head_dim, amx=kernels.amx, avx512=kernels.avx512)
    return TorchPagedAttention(num_heads, num_kv_heads, head_dim)
