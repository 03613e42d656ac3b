"""The torch reference paged attention: the correctness oracle, and the path faster backends fall back to.

KV memory per layer is one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
``block_id * block_size + offset``. A step's tokens are ordered as

    [ decode tokens (one per request) | prefill chunk of request a | prefill chunk of request b | ... ]

and the backend describes that layout once per step (model/backends/base.py); every layer reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.model.backends.base import AttentionMetadata


@dataclass(slots=True)
class TorchAttentionMetadata(AttentionMetadata):
    """The reference decode's padding mask on top of the common layout (model/backends/torch_ref.py)."""

    # [num_decodes, 1, 1, max_blocks * block_size]: True where the key exists (after the shared prefix)
    decode_mask: torch.Tensor | None = None


class TorchPagedAttention:
    """Gathers each request's blocks and calls scaled_dot_product_attention.

    Decodes are batched in one call: with grouped-query attention the query heads sharing a KV head are
    laid out as that head's "query positions" ([B, num_kv_heads, group, head_dim]), so K/V are never
    repeated and the padding mask is the only mask.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale if scale is not None else head_dim**-0.5
        # This layer's queries see only the last sliding_window keys (None: all of them).
        self.sliding_window = sliding_window

    def _window_binds(self, meta: AttentionMetadata) -> bool:
        return self.sliding_window is not None and meta.window is not None

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
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

        windowed = self._window_binds(meta)
        decode = self._decode_windowed if windowed else self._decode
        prefill = self._prefill_windowed if windowed else self._prefill
        nd = meta.num_decode_tokens
        if nd == num_tokens:
            return decode(q, k_cache, v_cache, meta).view(num_tokens, -1)
        prefill_out = prefill(q, k, v, k_cache, v_cache, meta)  # [num_tokens - nd, num_heads, head_dim]
        if not nd:
            return prefill_out.view(num_tokens, -1)
        return torch.cat((decode(q[:nd], k_cache, v_cache, meta), prefill_out)).view(num_tokens, -1)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """The step's new K/V rows into their cache slots."""
        _, _, num_kv_heads, head_dim = k_cache.shape
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    def _prefill_windowed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Each chunk's queries against the keys within the window behind them (explicit mask), reading only
        the blocks the window reaches."""
        assert self.sliding_window is not None
        nd = meta.num_decode_tokens
        out = torch.empty_like(q[nd:])
        for span in meta.prefills:
            qs = slice(span.q_start, span.q_start + span.q_len)
            query = q[qs].transpose(0, 1).unsqueeze(0)
            block_size = k_cache.shape[1]
            if span.block_ids is None:
                key, value = k[qs], v[qs]
            else:  # only the blocks the window reaches
                first = span.window_start_block(self.sliding_window, block_size)
                num_keys = span.kv_len - first * block_size
                key = k_cache[span.block_ids[first:]].flatten(0, 1)[:num_keys]
                value = v_cache[span.block_ids[first:]].flatten(0, 1)[:num_keys]
            o = F.scaled_dot_product_attention(
                query, key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0),
                attn_mask=span.window_mask(self.sliding_window, block_size, q.device), scale=self.scale,
                enable_gqa=True,
            )
            out[span.q_start - nd : span.q_start - nd + span.q_len] = o[0].transpose(0, 1)
        return out

    def _decode_windowed(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        window = meta.window
        assert window is not None and window.decode_block_table is not None and window.decode_mask is not None
        return self._gathered_decode(q, k_cache, v_cache, window.decode_block_table, window.decode_mask)

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
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TorchAttentionMetadata
    ) -> torch.Tensor:
        assert meta.decode_block_table is not None
        if meta.decode_prefix_blocks is not None:
            return self._decode_shared_prefix(q, k_cache, v_cache, meta)
        return self._gathered_decode(q, k_cache, v_cache, meta.decode_block_table, meta.decode_mask)

    def _gathered_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_table: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Every decode row against the keys of its row of ``block_table`` that ``mask`` lets through."""
        batch = q.shape[0]
        query = q.reshape(batch, self.num_kv_heads, self.group, self.head_dim)
        # [batch, max_blocks, block_size, kv_heads, head_dim] -> [batch, kv_heads, max_blocks * block_size, head_dim]
        key = k_cache[block_table].flatten(1, 2).transpose(1, 2)
        value = v_cache[block_table].flatten(1, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scale)
        return o.reshape(batch, self.num_heads, self.head_dim)

    def _decode_shared_prefix(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TorchAttentionMetadata
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

