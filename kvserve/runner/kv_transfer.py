"""Copying whole KV blocks between device memory and bytes, for the storage tiers below it.

Per layer the cache is ``[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``; one block's
payload is its KV across all layers, laid out as a contiguous

    [num_layers, 2, block_size, num_kv_heads, head_dim]   in the cache's dtype, native byte order

so a payload written by one engine loads into any engine with the same model, dtype and block size
(which the tier keys and entry headers check).
"""

from __future__ import annotations

import torch


def block_shape(kv_caches: list[torch.Tensor]) -> tuple[int, ...]:
    """Shape of one block's payload: (num_layers, 2, block_size, num_kv_heads, head_dim)."""
    layer = kv_caches[0]
    return (len(kv_caches), layer.shape[0], *layer.shape[2:])


def block_nbytes(kv_caches: list[torch.Tensor]) -> int:
    shape = block_shape(kv_caches)
    n = kv_caches[0].element_size()
    for dim in shape:
        n *= dim
    return n


def read_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> list[bytes]:
    """The payload of each block in ``block_ids`` (one gather per layer, one device-to-host copy)."""
    if not block_ids:
        return []
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    # per layer [2, n, bs, h, d] -> [L, 2, n, bs, h, d] -> [n, L, 2, bs, h, d]
    stacked = torch.stack([kv.index_select(1, index) for kv in kv_caches])
    blocks = stacked.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
    raw = blocks.view(torch.uint8).reshape(len(block_ids), -1).numpy()  # [n, block_nbytes]
    return [raw[i].tobytes() for i in range(len(block_ids))]


def write_blocks(kv_caches: list[torch.Tensor], items: list[tuple[int, bytes]]) -> None:
    """Write each (block_id, payload) into device memory (one host-to-device copy, one scatter per layer)."""
    if not items:
        return
    layer = kv_caches[0]
    nbytes = block_nbytes(kv_caches)
    buffer = bytearray(nbytes * len(items))
    for i, (_, payload) in enumerate(items):
        if len(payload) != nbytes:
            raise ValueError(f"a KV block payload must be {nbytes} bytes, got {len(payload)}")
        buffer[i * nbytes : (i + 1) * nbytes] = payload
    shape = (len(items), *block_shape(kv_caches))
    data = torch.frombuffer(buffer, dtype=torch.uint8).view(layer.dtype).view(shape)  # [n, L, 2, bs, h, d]
    data = data.to(layer.device, non_blocking=False)
    index = torch.tensor([block_id for block_id, _ in items], dtype=torch.long, device=layer.device)
    for i, kv in enumerate(kv_caches):
        kv.index_copy_(1, index, data[:, i].transpose(0, 1))  # [2, n, bs, h, d] into [2, num_blocks, ...]
