"""The KV cache tensors: one preallocated tensor per layer, cut into blocks; or, when the model's layers keep
their KV in groups (kv_layout.py), one tensor per place in a group's page, shared by the layers there."""

from __future__ import annotations

import torch

from kvserve.config import ArchConfig, CacheConfig
from kvserve.kv_layout import KVLayout

GIB = 1 << 30


def block_bytes(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block occupies across all layers (K and V)."""
    return arch.kv_bytes_per_token(dtype.itemsize) * block_size


def num_blocks_for(arch: ArchConfig, config: CacheConfig, dtype: torch.dtype) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    return max(1, int(config.kv_cache_gb * GIB) // block_bytes(arch, config.block_size, dtype))


def allocate_kv_caches(
    arch: ArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    layout: KVLayout | None = None,
) -> list[torch.Tensor]:
    """Per layer, [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]; with a grouped ``layout``,
    ``num_blocks`` counts pages and the layers at the same place of their groups share one tensor."""
    layout = layout or KVLayout.single(arch.num_layers)
    # Zeroed so padded reads (and the null page) are finite.
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    slots = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.layers_per_page)]
    return [slots[slot] for slot in layout.layer_slot]
