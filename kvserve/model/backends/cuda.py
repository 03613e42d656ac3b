"""The CUDA backend: torch's projections and element-wise ops, with paged attention on Triton kernels
(``triton_attention``). What it does not cover yet (sliding-window layers while their window binds, cascade
decode over a shared prefix) runs the torch reference's paths."""

from __future__ import annotations

from dataclasses import fields

import torch

from kvserve.config import ArchConfig, BackendConfig
from kvserve.model.backends.base import StepRows
from kvserve.model.backends.torch_ref import TorchRefBackend
from kvserve.model.backends.triton_attention import (
    PrefillTables,
    TritonAttentionMetadata,
    TritonPagedAttention,
)


class CudaBackend(TorchRefBackend):
    name = "cuda_triton"

    def __init__(self, arch: ArchConfig, device: torch.device, config: BackendConfig) -> None:
        super().__init__(arch, device, config)
        self.description = (f"{self.name} (torch projections, Triton paged attention; sliding windows and "
                            "shared-prefix decode on torch)")

    def make_attention(self, layer_index: int) -> TritonPagedAttention:
        arch = self.arch
        return TritonPagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.attention_scale,
                                    arch.layer_window(layer_index))

    def build_metadata(self, rows: StepRows) -> TritonAttentionMetadata:
        reference = super().build_metadata(rows)
        meta = TritonAttentionMetadata(**{f.name: getattr(reference, f.name) for f in fields(reference)})
        meta.prefill_tables = prefill_tables(rows, self.device)
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
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return PrefillTables(
        q_starts=column([chunk.q_start for chunk in chunks]), q_lens=column([chunk.q_len for chunk in chunks]),
        kv_lens=column([chunk.kv_len for chunk in chunks]),
        block_table=torch.tensor(table, dtype=torch.int32).to(device, non_blocking=True),
        max_q_len=max(chunk.q_len for chunk in chunks),
    )
