"""Architecture name -> model class. One table; adding a family is one line plus its weight-name map."""

from __future__ import annotations

import torch

from kvserve.config import ArchConfig
from kvserve.errors import UnsupportedModel
from kvserve.model.backends.base import Backend
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "smollm3": LlamaForCausalLM,  # Llama's layers, every fourth without rotary (ArchConfig.no_rope_layers)
    "granite": LlamaForCausalLM,  # Llama's layers with Granite's scalars (ArchConfig.residual_multiplier, ...)
    "phi3": LlamaForCausalLM,  # fused checkpoints, part of each head rotating (ArchConfig.rotary_dim), LongRoPE
    "gemma3": Gemma3ForCausalLM,
    # The same decoder with a mixture-of-experts MLP (model/moe.py) in the layers that route.
    "mixtral": LlamaForCausalLM,
    "qwen2_moe": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
}


def build_model(arch: ArchConfig, dtype: torch.dtype, device: torch.device, backend: Backend) -> LlamaForCausalLM:
    """The model of ``arch``'s family, running on ``backend`` (model/backends/select.py chooses it)."""
    try:
        cls = MODEL_CLASSES[arch.architecture]
    except KeyError:
        raise UnsupportedModel(
            f"architecture {arch.architecture!r} is not supported; supported: {sorted(MODEL_CLASSES)}"
        ) from None
    return cls(arch, backend, dtype, device)
