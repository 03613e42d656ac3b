"""Architecture name -> model class. One table; adding a family is one line plus its weight-name map."""

from __future__ import annotations

import torch

from kvserve.config import ArchConfig
from kvserve.errors import UnsupportedModel
from kvserve.model.attention import get_attention_backend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.ops import select_ops

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def build_model(
    arch: ArchConfig, dtype: torch.dtype, device: torch.device, cpu_kernels: bool = True
) -> LlamaForCausalLM:
    try:
        cls = MODEL_CLASSES[arch.architecture]
    except KeyError:
        raise UnsupportedModel(
            f"architecture {arch.architecture!r} is not supported; supported: {sorted(MODEL_CLASSES)}"
        ) from None
    kernels = cpu_kernels and device.type == "cpu"
    attention = get_attention_backend(device, arch.num_heads, arch.num_kv_heads, arch.head_dim, kernels)
    return cls(arch, attention, dtype, device, select_ops(dtype, kernels))
