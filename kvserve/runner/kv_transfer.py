"""Copying whole KV blocks between device memory and bytes, for the storage tiers below it.

Per layer the cache is ``[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``; one block's
payload is its KV across all layers, laid out as a contiguous

    [num_layers, 2, block_size, num_kv_heads, head_dim]   in the cache's dtype, native byte order

so a payload written by one engine loads into any engine with the same model, dtype and block size
(which the tier keys and entry headers check).
"""

from __future__ import annotations

import torch

from kvserve.model.host_inputs import to_device


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


class PendingRead:
    """Blocks' payloads being copied to the host: started before a step's forward, read after it."""

    def __init__(self, blocks: torch.Tensor | None, event: torch.cuda.Event | None = None) -> None:
        self._blocks = blocks  # [n, L, 2, bs, h, d] on the host (pinned, still landing while ``event`` is pending)
        self._event = event

    def result(self) -> list[bytes]:
        if self._blocks is None:
            return []
        if self._event is not None:
            self._event.synchronize()
        raw = self._blocks.view(torch.uint8).reshape(self._blocks.shape[0], -1).numpy()  # [n, block_nbytes]
        return [raw[i].tobytes() for i in range(raw.shape[0])]


def start_read_blocks(kv_caches: list[torch.Tensor], block_ids: list[int],
                      stream: torch.cuda.Stream | None = None) -> PendingRead:
    """The payload of each block in ``block_ids``: one gather per layer on the current stream (so that a
    forward queued after it may overwrite the blocks), then one device-to-host copy, on ``stream`` (a CUDA
    side stream) into pinned memory where one is given: the copy then overlaps what the device does next."""
    if not block_ids:
        return PendingRead(None)
    device = kv_caches[0].device
    index = to_device(block_ids, device, torch.long)
    # per layer [2, n, bs, h, d] -> [L, 2, n, bs, h, d] -> [n, L, 2, bs, h, d]
    stacked = torch.stack([kv.index_select(1, index) for kv in kv_caches])
    blocks = stacked.permute(2, 0, 1, 3, 4, 5).contiguous()
    if stream is None:
        return PendingRead(blocks.cpu())
    stream.wait_stream(torch.cuda.current_stream(device))
    host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(blocks, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    blocks.record_stream(stream)  # its memory is not handed out again before the copy has read it
    return PendingRead(host, event)


def read_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> list[bytes]:
    """The payload of each block in ``block_ids``, now."""
    return start_read_blocks(kv_caches, block_ids).result()


def write_blocks(kv_caches: list[torch.Tensor], items: list[tuple[int, bytes]]) -> None:
    """Write each (block_id, payload) into device memory (one host-to-device copy, through pinned memory on
    CUDA, then one scatter per layer on the same stream)."""
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
    data = to_device(data, layer.device)
    index = to_device([block_id for block_id, _ in items], layer.device, torch.long)
    for i, kv in enumerate(kv_caches):
        kv.index_copy_(1, index, data[:, i].transpose(0, 1))  # [2, n, bs, h, d] into [2, num_blocks, ...]
