"""The projection kernels of the cpu_kernels backend, and the ``ModelOps`` its plan gives a model.

With the C++ CPU kernels loaded and a bf16 model, the projections, the add+RMSNorm, the SiLU-and-multiply
(with a packed projection family: fused into the gate/up projection) and the rotary embedding go through them
(benchmarks/cpu_kernels.py measures each against the torch version, side by side).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.model.ops import Linear, ModelOps
from kvserve.model.quantized import QuantizedWeight, Weight


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
        """AMX tile multiplies (csrc/projections.cpp): faster than torch's bf16 linear at decode widths, on
        par at prefill widths (benchmarks/cpu_kernels.py)."""
        kvserve = torch.ops.kvserve
        return cls("amx", kvserve.amx_pack, kvserve.amx_linear, kvserve.amx_linear_silu_mul, 32)

    @classmethod
    def avx512(cls) -> PackedKernels:
        """fp32 FMAs on bf16 weights widened in registers (csrc/linear_avx512.cpp), for AVX-512 CPUs
        without the BF16 instructions, where torch's bf16 linear is slowest."""
        kvserve = torch.ops.kvserve
        return cls("avx512", kvserve.pack_bf16_pairs, kvserve.avx512_linear, kvserve.avx512_linear_silu_mul, 2)

    @classmethod
    def bf16dot(cls) -> PackedKernels:
        """VDPBF16PS on the AVX-512 family's packed layout (csrc/linear_avx512.cpp), for CPUs with the BF16
        instructions but no AMX: ahead of torch's bf16 linear up to a few hundred rows
        (benchmarks/cpu_kernels.py)."""
        kvserve = torch.ops.kvserve
        return cls("bf16dot", kvserve.pack_bf16_pairs, kvserve.bf16dot_linear, kvserve.bf16dot_linear_silu_mul, 2)


    @classmethod
    def avx2(cls) -> PackedKernels:
        """The widening kernel 8 lanes wide (csrc/linear_avx2.cpp) on the same packing, for CPUs without
        AVX-512, where torch's bf16 linear has no bf16 arithmetic to call (benchmarks/cpu_kernels.py)."""
        kvserve = torch.ops.kvserve
        return cls("avx2", kvserve.pack_bf16_pairs, kvserve.avx2_linear, kvserve.avx2_linear_silu_mul, 2)


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

    def packed_for(self, weight: Weight) -> torch.Tensor | None:
        """The packed copy of a dense weight; None for one it did not pack (or a quantised one)."""
        return self.packed.get(weight.data_ptr()) if type(weight) is not QuantizedWeight else None

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

    def packed_for(self, weight: Weight) -> torch.Tensor | None:
        """The interleaved packed copy of a dense [gate | up] weight; None if it has none."""
        return self.packed.get(weight.data_ptr()) if type(weight) is not QuantizedWeight else None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        packed = self.packed.get(weight.data_ptr())
        if packed is None or x.dtype != torch.bfloat16 or x.shape[0] < self.min_rows:
            return self.fallback(x, weight)
        return self.kernels.linear_silu_mul(x, packed)


class QuantizedOrDense:
    """Calls ``quantized`` for a ``QuantizedWeight`` and ``dense`` for every other weight: an op of the
    dense plan, with the quantised kernels in front of it."""

    def __init__(self, quantized: Callable[..., object], dense: Callable[..., object]) -> None:
        self.quantized = quantized
        self.dense = dense

    def __call__(self, x: object, weight: Weight, *args: object) -> object:
        return (self.quantized if type(weight) is QuantizedWeight else self.dense)(x, weight, *args)


@dataclass(frozen=True, slots=True)
class QuantizedWidths:
    """Which of the quantised kernels' paths (csrc/quantized.cpp) takes an input of a given number of rows:
    at most ``gemv_max_rows`` the int8 dot products on the blocks (0: none), else at most ``fused_max_rows``
    panels of the weight multiplied by the worker that reads them (the weights' integers on VDPBF16PS, or
    dequantised panels; 0: none), wider ones the weight dequantised in slabs ahead of the packed bf16
    kernels (or torch's matmul). ``int8_activations``: interleaved weights' int8 dot products take one int8
    level of activations per 32 values at every width they take."""

    gemv_max_rows: int
    fused_max_rows: int = 0
    int8_activations: bool = False


class ActivationLevels:
    """How many rows of the current step the interleaved int8 products give one int8 level of activations
    (csrc/quantized_interleaved.cpp); wider inputs get a second, residual level. Each row's products depend
    on its level only, not on how many rows come with it.

    The backend sets it each step (``set_step``): a decode step (no prompt chunk in it) gives all its rows one
    level, as a single request's decode step has them, so that its drafts, riding as extra rows, are verified
    on exactly the logits its plain decode step computes, and a batch's decode costs one level's dot
    products (half the two levels'). That holds for any number of requests where the int8 products take the mid
    widths (``every_decode_step``: no AMX), and for at most ``few_rows`` requests on AMX, whose tiles take
    wider inputs. Steps with a prompt chunk keep one level for at most ``few_rows`` rows: a prompt's rows
    past that get the residual (the KV every later token reads), or the dequantised slabs past the
    interleaved kernels' width."""

    def __init__(self, few_rows: int, every_decode_step: bool = True) -> None:
        self.few_rows = few_rows
        self.every_decode_step = every_decode_step
        self.one_level_rows = few_rows

    def set_step(self, num_decode_requests: int, num_rows: int, has_prefill: bool) -> None:
        decode_only = (not has_prefill and num_decode_requests > 0
                       and (self.every_decode_step or num_decode_requests <= self.few_rows))
        self.one_level_rows = max(num_rows, self.few_rows) if decode_only else self.few_rows


class QuantizedKernels:
    """Projections, the MLP's fused gate/up and embedding lookups on GGUF-quantised weights
    (``QuantizedWeight``, csrc/quantized.cpp), each width on the path ``widths`` gives it; interleaved
    weights' activation levels as ``levels`` has them for the step."""

    def __init__(self, widths: QuantizedWidths, levels: ActivationLevels) -> None:
        self.widths = widths
        self.levels = levels

    def linear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.kvserve.quant_linear(x, weight.data, weight.types, weight.cols, bias,
                                              self._one_level_rows(weight), self.widths.fused_max_rows,
                                              self.widths.int8_activations)

    def gate_up_silu(self, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        return torch.ops.kvserve.quant_linear_silu_mul(x, weight.data, weight.types, weight.cols,
                                                       self._one_level_rows(weight), self.widths.fused_max_rows,
                                                       self.widths.int8_activations)

    def _one_level_rows(self, weight: QuantizedWeight) -> int:
        # The planar layout's few-row kernel keeps its own limit.
        return self.levels.one_level_rows if weight.interleaved else self.widths.gemv_max_rows

    @staticmethod
    def embedding(ids: torch.Tensor, table: QuantizedWeight) -> torch.Tensor:
        (segment,) = table.segments  # the loader keeps a table in one segment
        rows = torch.ops.kvserve.quant_dequantize(segment.data, segment.kernel_type, table.cols, ids.reshape(-1),
                                                  torch.bfloat16)
        return rows.view(*ids.shape, table.cols)


def dense_only(prepare: Callable[[torch.Tensor], None]) -> Callable[[Weight], None]:
    """A dense kernel's prepare hook, which a quantised weight skips (its kernels read the blocks as they
    are held)."""
    def prepare_dense(weight: Weight) -> None:
        if type(weight) is not QuantizedWeight:
            prepare(weight)  # type: ignore[arg-type]
    return prepare_dense


@dataclass(frozen=True, slots=True)
class CpuOps:
    """A model's ops, and the packed projections' weights the fused decode stack reads."""

    ops: ModelOps
    packed_linear: PackedLinear | None = None
    packed_gate_up: PackedGateUpSilu | None = None
    activation_levels: ActivationLevels | None = None  # with quantised weights: set by the backend each step


def build_cpu_ops(projections: str | None, gemv_max_rows: int, elementwise: bool,
                  quantized: QuantizedWidths | None = None) -> CpuOps:
    """The ops for a plan: ``projections`` names the packed family ("amx", "avx512", "bf16dot", "avx2" or None:
    torch's linear), inputs of at most ``gemv_max_rows`` rows take the BF16 GEMV (0: none), ``elementwise``
    puts the norms, SiLU-and-multiply and rotary on the kernels (a bf16 model), and
    ``quantized`` (None: no quantised weights) the widths of the quantised kernels' paths."""
    ops = _build_dense_ops(projections, gemv_max_rows, elementwise)
    if quantized is None:
        return ops
    levels = ActivationLevels(quantized.gemv_max_rows, every_decode_step=quantized.fused_max_rows > 0)
    kernels = QuantizedKernels(quantized, levels)
    dense = ops.ops
    # Without a fused dense gate/up, a quantised one still runs fused; a dense one as silu_mul(linear(...)).
    dense_gate_up = dense.fused_gate_up_silu or (lambda x, w: dense.silu_mul(dense.linear(x, w, None)))
    return CpuOps(ModelOps(
        linear=QuantizedOrDense(kernels.linear, dense.linear),  # type: ignore[arg-type]
        embedding=QuantizedOrDense(kernels.embedding, F.embedding),  # type: ignore[arg-type]
        add_rms_norm=dense.add_rms_norm, silu_mul=dense.silu_mul, gelu_tanh_mul=dense.gelu_tanh_mul,
        rotary=dense.rotary, lora_add=dense.lora_add,
        prepare_weight=dense_only(dense.prepare_weight),
        fused_gate_up_silu=QuantizedOrDense(kernels.gate_up_silu, dense_gate_up),  # type: ignore[arg-type]
        prepare_gate_up=dense_only(dense.prepare_gate_up),
    ), ops.packed_linear, ops.packed_gate_up, levels)


def _build_dense_ops(projections: str | None, gemv_max_rows: int, elementwise: bool) -> CpuOps:
    if not elementwise:  # LoRA's update takes float32 too
        return CpuOps(ModelOps(lora_add=torch.ops.kvserve.lora_add))
    families = {"amx": PackedKernels.amx, "avx512": PackedKernels.avx512, "bf16dot": PackedKernels.bf16dot,
                "avx2": PackedKernels.avx2}
    family = families[projections]() if projections else None
    linear: Linear = F.linear
    packed_linear = PackedLinear(family, fallback=F.linear) if family is not None else None
    if packed_linear is not None:
        linear = packed_linear
    if gemv_max_rows:
        linear = DecodeRows(torch.ops.kvserve.gemv_bf16, linear, max_rows=gemv_max_rows)
    kernels = torch.ops.kvserve
    if packed_linear is None:
        return CpuOps(ModelOps(linear=linear, add_rms_norm=kernels.add_rms_norm, silu_mul=kernels.silu_mul,
                               gelu_tanh_mul=kernels.gelu_tanh_mul, rotary=kernels.rotary, lora_add=kernels.lora_add))

    def gate_up_then_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvserve.silu_mul(linear(x, weight, None))

    # The rows the GEMV takes stay on it (it reads the weight in its own layout), then silu_mul.
    gate_up = PackedGateUpSilu(packed_linear.kernels, gate_up_then_silu, min_rows=gemv_max_rows + 1,
                               prepare_fallback=packed_linear.prepare)
    ops = ModelOps(linear=linear, prepare_weight=packed_linear.prepare, fused_gate_up_silu=gate_up,
                   prepare_gate_up=gate_up.prepare, add_rms_norm=kernels.add_rms_norm, silu_mul=kernels.silu_mul,
                   gelu_tanh_mul=kernels.gelu_tanh_mul, rotary=kernels.rotary, lora_add=kernels.lora_add)
    return CpuOps(ops, packed_linear, gate_up)
