"""Device and dtype choice, in one place."""

from __future__ import annotations

import torch

from kvserve.errors import InvalidRequest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequest(f"device {name!r} requested but CUDA is not available", "device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    try:
        dtype = DTYPES[name]
    except KeyError:
        raise InvalidRequest(f"dtype must be one of {sorted(DTYPES)}, got {name!r}", "dtype") from None
    if dtype == torch.float16 and device.type == "cpu":
        raise InvalidRequest("float16 is not supported on CPU; use bfloat16 or float32", "dtype")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
