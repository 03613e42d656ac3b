"""The per-token math a model calls besides attention, chosen once per model like the attention backend.

The torch versions are the reference and run everywhere. With the C++ CPU kernels loaded and a bf16
model, the projections, the add+RMSNorm, the SiLU-and-multiply (with AMX or AVX-512: fused into the
gate/up projection) and the rotary embedding go through them
(benchmarks/cpu_kernels.py measures each against the torch version, side by side).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.layers import apply_rotary, rms_norm

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
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


class DecodeRows:
    """Calls ``kernel`` on inputs of at most ``max_rows`` rows, ``wider`` on the rest.

    The bf16 GEMV kernel streams weights at close to memory bandwidth at a row or two, where torch's bf16
    linear is bound by its own arithmetic; from a few rows on, the AMX tiles or torch do better.
    """

    def __init__(self, kernel: Callable[..., torch.Tensor], wider: Callable[..., torch.Tensor],
                 max_rows: int = 4) -> None:
        self.kernel = kernel
        self.wider = wider
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor, *args: object) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            return self.kernel(x, *args)
        return self.wider(x, *args)


@dataclass(frozen=True, slots=True)
class PackedKernels:
    """A family of projection kernels that read each weight in a layout of their own, packed once."""

    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    # silu(gate) * up from a [gate | up] weight packed with its gate and up rows interleaved 16 at a time
    linear_silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    depth_multiple: int  # the weight's inner size must be a multiple of this (its rows always of 16)

    @classmethod
    def amx(cls) -> PackedKernels:
        """AMX tile multiplies (csrc/projections.cpp): about 2x torch's bf16 linear at decode widths, on par
        at prefill widths (benchmarks/cpu_kernels.py)."""
        kvserve = torch.ops.kvserve
        return cls("amx", kvserve.amx_pack, kvserve.amx_linear, kvserve.amx_linear_silu_mul, 32)

    @classmethod
    def avx512(cls) -> PackedKernels:
        """fp32 FMAs on bf16 weights widened in registers (csrc/linear_avx512.cpp), for AVX-512 CPUs
        without the BF16 instructions, where torch's bf16 linear is slowest."""
        kvserve = torch.ops.kvserve
        return cls("avx512", kvserve.avx512_pack, kvserve.avx512_linear, kvserve.avx512_linear_silu_mul, 2)


class PackedLinear:
    """bf16 projections through a ``PackedKernels`` family, at every width; weights it could not pack go
    to ``fallback``.

    Each projection weight gets a packed copy once, at load (``prepare``); that costs a second copy of the
    weights in memory. A weight is found again by its storage address, which model weights never change
    after load.
    """

    def __init__(self, kernels: PackedKernels, fallback: Linear = F.linear) -> None:
        self.kernels = kernels
        self.fallback = fallback
        self.packed: dict[int, torch.Tensor] = {}

    def prepare(self, weight: torch.Tensor) -> None:
        rows, depth = weight.shape
        if weight.dtype == torch.bfloat16 and rows % 16 == 0 and depth % self.kernels.depth_multiple == 0:
            self.packed.setdefault(weight.data_ptr(), self.kernels.pack(weight))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = self.packed.get(weight.data_ptr())
        if packed is None or x.dtype != torch.bfloat16:
            return self.fallback(x, weight, bias)
        return self.kernels.linear(x, packed, bias)


class PackedGateUpSilu:
    """The MLP's gate/up projection and its activation in one kernel (``linear_silu_mul``): silu(gate) * up
    comes straight from the accumulators, so the [rows, 2 x intermediate] product is never written to
    memory and read back by silu_mul. Bit for bit what silu_mul(linear(...)) gives.

    The weight [gate | up] is packed with its gate and up rows interleaved 16 at a time, so each pair of
    output blocks the kernel finishes holds the gate and the up of the same 16 columns. Inputs of fewer
    than ``min_rows`` rows (the GEMV's single row), other dtypes and weights it could not pack go to
    ``fallback``; a weight it cannot interleave is handed to ``prepare_fallback`` (the plain projection's
    packing) so that the unfused pair keeps its kernels.
    """

    def __init__(self, kernels: PackedKernels, fallback: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 min_rows: int = 1, prepare_fallback: Callable[[torch.Tensor], None] | None = None) -> None:
        self.kernels = kernels
        self.fallback = fallback
        self.min_rows = min_rows
        self.prepare_fallback = prepare_fallback
        self.packed: dict[int, torch.Tensor] = {}

    def prepare(self, weight: torch.Tensor) -> None:
        rows, depth = weight.shape
        if weight.dtype == torch.bfloat16 and rows % 32 == 0 and depth % self.kernels.depth_multiple == 0:
            interleaved = weight.view(2, rows // 32, 16, depth).transpose(0, 1).reshape(rows, depth)
            self.packed.setdefault(weight.data_ptr(), self.kernels.pack(interleaved.contiguous()))
        elif self.prepare_fallback is not None:
            self.prepare_fallback(weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        packed = self.packed.get(weight.data_ptr())
        if packed is None or x.dtype != torch.bfloat16 or x.shape[0] < self.min_rows:
            return self.fallback(x, weight)
        return self.kernels.linear_silu_mul(x, packed)


def _nothing_to_prepare(weight: torch.Tensor) -> None:
    return None


@dataclass(frozen=True, slots=True)
class ModelOps:
    """The functions a model's layers call; the defaults are the torch reference versions."""

    linear: Linear = F.linear
    add_rms_norm: AddRmsNorm = torch_add_rms_norm
    silu_mul: Callable[[torch.Tensor], torch.Tensor] = torch_silu_mul
    # (x [T, H, D], cos [T, 1, D], signed_sin [T, 1, D]) -> rotated x
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = apply_rotary
    # Called once per projection weight after loading (a kernel may keep its own layout of it).
    prepare_weight: Callable[[torch.Tensor], None] = _nothing_to_prepare
    # (x, fused [gate | up] weight) -> silu(gate) * up in one kernel; None: silu_mul(linear(x, weight)).
    fused_gate_up_silu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Called once per fused gate/up weight after loading, instead of prepare_weight.
    prepare_gate_up: Callable[[torch.Tensor], None] = _nothing_to_prepare
    # The AMX kernels' packed weights, for the fused decode stack (model/decode_stack.py); None without AMX.
    amx_linear: PackedLinear | None = None
    amx_gate_up: PackedGateUpSilu | None = None

    def gate_up_silu(self, x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up_silu is not None:
            return self.fused_gate_up_silu(x, gate_up_weight)
        return self.silu_mul(self.linear(x, gate_up_weight, None))


def select_ops(dtype: torch.dtype, cpu_kernels: bool) -> ModelOps:
    kernels = load_cpu_kernels() if cpu_kernels and dtype == torch.bfloat16 else None
    if kernels is None:
        return ModelOps()
    # Measured in benchmarks/cpu_kernels.py: the BF16 GEMV streams weights fastest at one row (single-stream
    # decode), AMX wins from two rows on; without AMX it hands wider inputs to torch (oneDNN), which has the
    # BF16 instructions too. Without those instructions torch's bf16 linear is slow at every width
    # (~4x behind the AVX-512 kernel at 16 rows, ~2.5x at 512) and the AVX-512 kernel takes them all.
    family = PackedKernels.amx() if kernels.amx else None
    if family is None and kernels.avx512 and not kernels.gemv_bf16:
        family = PackedKernels.avx512()
    linear: Linear = F.linear
    prepare_weight = _nothing_to_prepare
    packed_linear: PackedLinear | None = None
    if family is not None:
        packed_linear = PackedLinear(family, fallback=F.linear)
        linear, prepare_weight = packed_linear, packed_linear.prepare
    if kernels.gemv_bf16:
        linear = DecodeRows(torch.ops.kvserve.gemv_bf16, linear, max_rows=1 if kernels.amx else 4)
    fused_gate_up_silu = None
    prepare_gate_up = prepare_weight
    gate_up: PackedGateUpSilu | None = None
    if family is not None:
        def gate_up_then_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return torch.ops.kvserve.silu_mul(linear(x, weight, None))

        # One row stays on the GEMV where there is one (it reads the weight in its own layout), then silu_mul.
        gate_up = PackedGateUpSilu(family, gate_up_then_silu, min_rows=2 if kernels.gemv_bf16 else 1,
                                   prepare_fallback=prepare_weight)
        fused_gate_up_silu, prepare_gate_up = gate_up, gate_up.prepare
    amx = family is not None and family.name == "amx"
    return ModelOps(
        linear=linear,
        prepare_weight=prepare_weight,
        fused_gate_up_silu=fused_gate_up_silu,
        prepare_gate_up=prepare_gate_up,
        amx_linear=packed_linear if amx else None,
        amx_gate_up=gate_up if amx else None,
        add_rms_norm=torch.ops.kvserve.add_rms_norm,
        silu_mul=torch.ops.kvserve.silu_mul,
        rotary=torch.ops.kvserve.rotary,
    )


def select_argmax(device: torch.device, cpu_kernels: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The greedy sampler's row-wise argmax: the kernel on CPU when it loads (torch's argmax walks a
    49k-entry bf16 row one element at a time: ~1.8 ms for 16 rows), else None for torch's."""
    if not cpu_kernels or device.type != "cpu" or load_cpu_kernels() is None:
        return None
    return torch.ops.kvserve.argmax_rows
