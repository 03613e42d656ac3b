"""A step's inputs from the host to the model's device: token ids, positions, slots, block tables, the
sampler's per-row parameters.

On CUDA they go through pinned memory with an asynchronous copy, so that building the rest of the step goes
on while they land, instead of a copy from pageable memory that waits for the device; torch's caching host
allocator keeps each pinned block until the copy reading it has run. On a CPU they are built where they are
used."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: torch.Tensor | Sequence[float] | Sequence[Sequence[int]], device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a host tensor, or lists of numbers made one in ``dtype``) on ``device``."""
    if device.type != "cuda":
        if isinstance(values, torch.Tensor):
            return values.to(device)
        return torch.tensor(values, dtype=dtype, device=device)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True)
