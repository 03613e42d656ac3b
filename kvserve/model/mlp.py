"""The feed-forward block a decoder layer plugs in (``FeedForward``), and the dense gated ones (SwiGLU; GELU for Gemma).

model/moe.py has the mixture-of-experts block. Both take their weights under Hugging Face names through
the model's ``take`` (a name -> its tensor, ``ModelLoadError`` when the files lack it) and compute through
the backend's ``ModelOps``, so the kernels a plan picks for projections apply to them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, Self

import torch

from kvserve.model.lora import LayerLoRA
from kvserve.model.ops import ModelOps
from kvserve.model.quantized import Weight, concat_rows

Take = Callable[[str], Weight]


class FeedForward(Protocol):
    """A decoder layer's MLP: [num_tokens, hidden] -> [num_tokens, hidden], with the rows' LoRA adapters
    where it runs them."""

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor: ...

    def prepare(self) -> None:
        """Hand the projection weights to the backend's kernels, once, after loading."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """Every weight it holds, for counting parameters."""
        ...


class GatedMLP:
    """down(silu(gate(x)) * up(x)), gate and up fused into one [2 * intermediate, hidden] weight."""

    def __init__(self, ops: ModelOps, gate_up_weight: Weight, down_weight: Weight) -> None:
        self.ops = ops
        self.gate_up_weight = gate_up_weight  # [2 * intermediate, hidden]
        self.down_weight = down_weight  # [hidden, intermediate]

    @classmethod
    def load(cls, ops: ModelOps, prefix: str, take: Take) -> Self:
        """From ``{prefix}gate_proj.weight``, ``up_proj`` and ``down_proj``."""
        gate_up = concat_rows([take(prefix + "gate_proj.weight"), take(prefix + "up_proj.weight")])
        return cls(ops, gate_up, take(prefix + "down_proj.weight"))

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        if lora is None:
            return self.ops.linear(self.ops.gate_up_silu(x, self.gate_up_weight), self.down_weight, None)
        if lora.targets("gate_up"):  # the update goes in before the activation: no fused gate/up kernel
            h = self.ops.silu_mul(lora.add("gate_up", x, self.ops.linear(x, self.gate_up_weight, None)))
        else:
            h = self.ops.gate_up_silu(x, self.gate_up_weight)
        return lora.add("down", h, self.ops.linear(h, self.down_weight, None))

    def prepare(self) -> None:
        self.ops.prepare_gate_up(self.gate_up_weight)
        self.ops.prepare_weight(self.down_weight)

    def tensors(self) -> list[Weight]:
        return [self.gate_up_weight, self.down_weight]


class GeluGatedMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)) (Gemma): the fused [gate | up] weight is an ordinary projection here,
    as the backends' fused gate-up kernel applies SiLU."""

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        gate_up = self.ops.linear(x, self.gate_up_weight, None)
        if lora is None:
            return self.ops.linear(self.ops.gelu_tanh_mul(gate_up), self.down_weight, None)
        h = self.ops.gelu_tanh_mul(lora.add("gate_up", x, gate_up))
        return lora.add("down", h, self.ops.linear(h, self.down_weight, None))

    def prepare(self) -> None:
        self.ops.prepare_weight(self.gate_up_weight)
        self.ops.prepare_weight(self.down_weight)
