"""PEFT LoRA adapters made on a transformers model for the tests: random, saved as PEFT saves them."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch


def make_adapter(base, directory: Path, *, rank: int, alpha: float, targets: list[str], seed: int,
                 b_scale: float = 0.2, **options: object):
    """A PEFT LoRA adapter on a copy of ``base`` (``base`` is left as it is) with random A and B (B shrunk by
    ``b_scale``, so that the adapter moves the output without drowning the base model), saved into
    ``directory``; returns the PEFT model, the reference for what the adapter computes."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                             init_lora_weights=False, **options)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(b_scale)
    model.save_pretrained(str(directory))
    return model.eval()
