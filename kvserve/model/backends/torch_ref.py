"""The torch reference backend: torch ops and scaled_dot_product_attention, on any device. It is the
correctness oracle for every faster backend, and what runs where no kernel loads."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from kvserve.config import ArchConfig, BackendConfig
from kvserve.model.attention import TorchAttentionMetadata, TorchPagedAttention
from kvserve.model.backends.base import DecoderLayout, DecoderWeights, FusedDecode, StepRows
from kvserve.model.backends.layout import prefill_spans, split_decodes, window_layout
from kvserve.model.host_inputs import to_device
from kvserve.model.ops import ModelOps


class TorchRefBackend:
    name = "torch_ref"

    def __init__(self, arch: ArchConfig, device: torch.device, config: BackendConfig) -> None:
        self.arch = arch
        self.device = device
        self.config = config
        self.description = f"{self.name} (torch projections, torch attention)"
        self.ops = ModelOps()
        self.argmax = None
        self.mask_logits = None
        self.quantized_types: frozenset[int] = frozenset()
        self.quantized_interleaved = False
        self.quantized_int8_activations = False
        self.quantized_by_default = False

    def make_attention(self, layer_index: int) -> TorchPagedAttention:
        arch = self.arch
        return TorchPagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.attention_scale,
                                   arch.layer_window(layer_index))

    def build_fused_decode(self, layers: Sequence[DecoderWeights], layout: DecoderLayout) -> FusedDecode | None:
        return None

    def packed_weight_nbytes(self) -> int:
        return 0

    def step_scope(self) -> AbstractContextManager[None]:
        return nullcontext()

    def build_metadata(self, rows: StepRows) -> TorchAttentionMetadata:
        device = self.device
        meta = TorchAttentionMetadata(slot_mapping=rows.slot_mapping, num_decode_tokens=rows.num_decode_rows,
                                      prefills=prefill_spans(rows, device),
                                      window=window_layout(rows, self.arch.sliding_window, device))
        split = split_decodes(rows, self.config.cascade_min_tokens)
        if split is not None:
            num_keys = split.block_table.shape[1] * rows.block_size
            # [num_decodes, 1, 1, max_blocks * block_size]: True where the key exists
            mask = (torch.arange(num_keys)[None, :] < split.seq_lens[:, None])[:, None, None, :]
            meta.decode_block_table = to_device(split.block_table, device)
            meta.decode_seq_lens = to_device(split.seq_lens, device)
            meta.decode_mask = to_device(mask, device)
            if split.shared_block_ids:
                meta.decode_prefix_blocks = to_device(split.shared_block_ids, device, torch.long)
        return meta
