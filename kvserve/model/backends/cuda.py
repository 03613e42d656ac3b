"""The CUDA backend: torch's projections, with paged attention and the element-wise ops on Triton kernels
(``triton_attention``, ``triton_ops``) and decode steps replayed from CUDA graphs (``decode_graphs``). What
the kernels do not cover (head sizes the tiles cannot take) runs the torch reference's paths, eagerly."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import torch

from kvserve.config import ArchConfig, BackendConfig
from kvserve.model.backends import triton_ops
from kvserve.model.backends.base import DecoderLayout, DecoderWeights, FusedDecode, StepRows
from kvserve.model.backends.decode_graphs import CudaGraphCapture, DecodeGraphs, DecoderStep, replay_eagerly
from kvserve.model.backends.layout import split_decodes, whole_decodes
from kvserve.model.backends.torch_ref import TorchRefBackend
from kvserve.model.backends.triton_attention import (
    PrefillTables,
    SharedPrefix,
    TritonAttentionMetadata,
    TritonPagedAttention,
    head_size_unsupported,
)
from kvserve.model.host_inputs import to_device
from kvserve.model.ops import ModelOps


class CudaBackend(TorchRefBackend):
    name = "cuda_triton"

    def __init__(self, arch: ArchConfig, device: torch.device, config: BackendConfig) -> None:
        super().__init__(arch, device, config)
        self.ops = ModelOps(add_rms_norm=triton_ops.add_rms_norm, silu_mul=triton_ops.silu_mul,
                            rotary=triton_ops.rotary)
        self.triton_attention = not head_size_unsupported(arch.head_dim)
        # Cascade decode for models without window layers (whose windows would start inside a shared prefix).
        self.cascade = not (arch.sliding_window and arch.sliding_layers)
        why_eager = self._why_eager()
        graphs = (f"decode steps of up to {config.cuda_graph_max_rows} rows on CUDA graphs" if why_eager is None
                  else f"every step eager: {why_eager}")
        attention = ("Triton paged attention" if self.triton_attention
                     else f"torch attention: Triton's tiles take no head size {arch.head_dim}")
        self.description = f"{self.name} (torch projections, Triton norms, rotary and SiLU, {attention}; {graphs})"

    def _why_eager(self) -> str | None:
        """Why decode steps cannot replay CUDA graphs here, or None when they can."""
        if self.config.enforce_eager:
            return "--enforce-eager"
        if not self.triton_attention:
            return "no Triton attention for this head size"
        if self.arch.is_moe:
            return "a mixture of experts routes on the host"
        return None

    def make_attention(self, layer_index: int) -> TritonPagedAttention:
        arch = self.arch
        return TritonPagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.attention_scale,
                                    arch.layer_window(layer_index))

    def build_fused_decode(self, layers: Sequence[DecoderWeights], layout: DecoderLayout) -> FusedDecode | None:
        if self._why_eager() is not None:
            return None
        capture = CudaGraphCapture(self.device) if self.device.type == "cuda" else replay_eagerly
        steps: Sequence[DecoderStep] = layers  # type: ignore[assignment]  # the model's layers run themselves
        return DecodeGraphs(steps, self.arch.hidden_size, self.arch.head_dim, self.config.cuda_graph_max_rows,
                            self.config.cuda_graph_max_seq_len, capture, cascade=self.cascade,
                            layer_rotations=layout.layer_rotations)

    def build_metadata(self, rows: StepRows) -> TritonAttentionMetadata:
        if not self.triton_attention:  # the reference's layout, masks included
            reference = super().build_metadata(rows)
            return TritonAttentionMetadata(**{f.name: getattr(reference, f.name) for f in fields(reference)})
        device = self.device
        # The kernels apply a layer's sliding window themselves: no window layout. The Triton prefill reads its
        # tables, not the reference's spans (each span on history copies its block ids to the device).
        meta = TritonAttentionMetadata(slot_mapping=rows.slot_mapping, num_decode_tokens=rows.num_decode_rows,
                                       prefill_tables=prefill_tables(rows, device))
        # No reference decode mask. A shared prefix is split off (cascade) unless a window layer reads these
        # tables: its window starts inside the rows' own keys.
        split = split_decodes(rows, self.config.cascade_min_tokens) if self.cascade else whole_decodes(rows)
        if split is not None:
            meta.decode_block_table = to_device(split.block_table, device)
            meta.decode_seq_lens = to_device(split.seq_lens, device)
            if split.shared_block_ids:
                ids = split.shared_block_ids
                meta.decode_shared_prefix = SharedPrefix(to_device(ids, device, torch.int32),
                                                         to_device([len(ids)], device, torch.int32))
        return meta


def prefill_tables(rows: StepRows, device: torch.device) -> PrefillTables | None:
    """The step's prefill chunks as the Triton prefill kernel reads them; None without any."""
    if not rows.prefills:
        return None
    chunks = rows.prefills
    max_blocks = max(-(-chunk.kv_len // rows.block_size) for chunk in chunks)
    table = [chunk.block_ids[:max_blocks] + [0] * (max_blocks - len(chunk.block_ids[:max_blocks]))
             for chunk in chunks]

    def column(values: list[int]) -> torch.Tensor:
        return to_device(values, device, torch.int32)

    return PrefillTables(
        q_starts=column([chunk.q_start for chunk in chunks]), q_lens=column([chunk.q_len for chunk in chunks]),
        kv_lens=column([chunk.kv_len for chunk in chunks]),
        block_table=to_device(table, device, torch.int32),
        max_q_len=max(chunk.q_len for chunk in chunks),
    )
