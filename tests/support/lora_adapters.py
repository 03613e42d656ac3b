"""LoRA adapters for the tests, random, in PEFT's file layout: made by PEFT itself on a transformers model
(``make_adapter``, the reference the real-model tests compare with), or written directly for a model's shape
(``write_adapter``, no transformers model needed)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvserve.config import ArchConfig
from kvserve.model.lora import module_shapes


def make_adapters(base, directory: Path, specs: dict[str, dict[str, object]], b_scale: float = 0.2):
    """PEFT LoRA adapters, one per ``specs`` entry (name -> LoraConfig's options: r, lora_alpha, target_modules,
    ...), on one copy of ``base`` (``base`` is left as it is), with random A and B (B shrunk by ``b_scale``, so
    that an adapter moves the output without drowning the base model), each saved into ``directory / name``;
    returns the PEFT model, the reference for what each adapter computes once ``set_adapter(name)`` picks it."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = None
    for name, options in specs.items():
        config = peft.LoraConfig(lora_dropout=0.0, init_lora_weights=False, **options)
        if model is None:
            model = peft.get_peft_model(copy.deepcopy(base), config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    assert model is not None
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.mul_(b_scale)
    model.save_pretrained(str(directory))  # each adapter into its own subdirectory, named after it
    return model.eval()


def module_name(layer: int, module: str) -> str:
    kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{kind}.{module}"


def write_adapter(directory: Path, arch: ArchConfig, modules: dict[tuple[int, str], int], seed: int = 0,
                  **config: object) -> dict[str, torch.Tensor]:
    """An adapter of the given (layer, module) -> rank, PEFT's file names and tensor names."""
    shapes = module_shapes(arch)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for (layer, module), rank in modules.items():
        out_size, in_size = shapes[module]
        tensors[f"{module_name(layer, module)}.lora_A.weight"] = torch.randn(rank, in_size, generator=generator)
        tensors[f"{module_name(layer, module)}.lora_B.weight"] = torch.randn(out_size, rank, generator=generator)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none"} | config))
    return tensors
