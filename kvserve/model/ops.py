"""The per-token math a model calls besides attention: its torch reference versions, and the ``ModelOps``
a backend hands the model (model/backends/; the C++ kernels' versions are in backends/cpu_ops.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.model.layers import apply_rotary, rms_norm
from kvserve.model.quantized import Weight

Linear = Callable[[torch.Tensor, Weight, torch.Tensor | None], torch.Tensor]
# (x, residual or None, weight, eps) -> (rms_norm(x + residual) * weight, x + residual)
AddRmsNorm = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


def torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x if residual is None else x + residual
    return rms_norm(residual, weight, eps), residual


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up = [gate | up] along the last dim (Gemma's MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# (out, x, a [rank, in], bt [rank, out], parts [P, 4], rows or None: all) -> None: out[rows] += (x[rows] @ a.T) @ bt
# in place; bt is zero outside its parts (output columns [c0, c1) taking ranks [r0, r1)), which a kernel may skip.
LoRAAdd = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], None]


def torch_lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, parts: torch.Tensor,
                   rows: torch.Tensor | None) -> None:
    """A LoRA adapter's update of a projection's output rows, in ``a``'s dtype, added in place (``bt`` whole:
    its zeros add nothing)."""
    inputs = x if rows is None else x.index_select(0, rows)
    update = ((inputs.to(a.dtype) @ a.T) @ bt).to(out.dtype)
    if rows is None:
        out += update
    else:
        out.index_add_(0, rows, update)


def _nothing_to_prepare(weight: Weight) -> None:
    return None


@dataclass(frozen=True, slots=True)
class ModelOps:
    """The functions a model's layers call; the defaults are the torch reference versions."""

    linear: Linear = F.linear  # type: ignore[assignment]  # dense weights only: see model/quantized.py
    # (token ids [T], the embedding table) -> its rows [T, hidden]
    embedding: Callable[[torch.Tensor, Weight], torch.Tensor] = F.embedding  # type: ignore[assignment]
    add_rms_norm: AddRmsNorm = torch_add_rms_norm
    silu_mul: Callable[[torch.Tensor], torch.Tensor] = torch_silu_mul
    gelu_tanh_mul: Callable[[torch.Tensor], torch.Tensor] = torch_gelu_tanh_mul
    # (x [T, H, D], cos [T, 1, D], signed_sin [T, 1, D]) -> rotated x
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = apply_rotary
    # Called once per projection weight after loading (a kernel may keep its own layout of it).
    prepare_weight: Callable[[Weight], None] = _nothing_to_prepare
    # (x, fused [gate | up] weight) -> silu(gate) * up in one kernel; None: silu_mul(linear(x, weight)).
    fused_gate_up_silu: Callable[[torch.Tensor, Weight], torch.Tensor] | None = None
    # Called once per fused gate/up weight after loading, instead of prepare_weight.
    prepare_gate_up: Callable[[Weight], None] = _nothing_to_prepare
    lora_add: LoRAAdd = torch_lora_add  # a LoRA adapter's update of a projection (model/lora.py)

    def gate_up_silu(self, x: torch.Tensor, gate_up_weight: Weight) -> torch.Tensor:
        if self.fused_gate_up_silu is not None:
            return self.fused_gate_up_silu(x, gate_up_weight)
        return self.silu_mul(self.linear(x, gate_up_weight, None))
