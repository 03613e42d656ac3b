"""The C++ CPU kernel backend (model/csrc/): AMX, AVX512-BF16 and AVX-512 variants, chosen once per engine.

``plan_kernels`` is the one place that decides, from what the loaded build offers on this CPU, the model's
dtype and its shape, which kernel takes each part of a step, and says why a part falls back where it does.
Everything else here follows the plan: the
model's ops (cpu_ops.py), one attention object per layer (cpu_attention.py), the fused decode stack
(cpu_decode_stack.py), and the step metadata those kernels read, which adds to the common layout the
one-call runs, the packed prefixes' 32-key steps and the block write versions that name their contents.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal

import torch

from kvserve.config import ArchConfig, BackendConfig
from kvserve.model.backends.base import DecoderLayout, DecoderWeights, FusedDecode, StepRows
from kvserve.model.backends.block_versions import BlockVersions
from kvserve.model.backends.cpu_attention import (
    MANY_ROW_HEAD_SIZES,
    CpuAttentionMetadata,
    CpuKernelPagedAttention,
    ManyRowFamily,
    PagedRuns,
)
from kvserve.model.backends.cpu_decode_stack import FusedDecodeStack
from kvserve.model.backends.cpu_ops import QuantizedWidths, build_cpu_ops
from kvserve.model.backends.layout import prefill_spans, shared_prefix_blocks, split_decodes, window_layout
from kvserve.model.cpu_kernels import CpuKernels, KernelThreadScope
from kvserve.model.quantized import KERNEL_TYPES

logger = logging.getLogger(__name__)

# The AMX attention kernel takes keys in steps of 32: a shared prefix it keeps packed is a whole number of them.
PREFIX_KEY_STEP = 32
# Head sizes the paged decode kernel has a vectorised path for (csrc/attention.cpp; any other size takes its
# portable loop).
VECTOR_DECODE_HEAD_SIZES = (64, 128, 256)

# Inputs of at most this many rows take the quantised weights' int8 dot products with one int8 level of
# activations, wider ones their dequantised slabs on the packed bf16 kernels (benchmarks/quantized.py), or on
# interleaved weights the residual level too (below). A decode step takes one level at any width where the
# interleaved kernels take the mid widths (cpu_ops.ActivationLevels); prompt chunks keep this limit: one level
# in a prompt's rows costs greedy agreement with the dequantised model (tests/e2e/test_quantized_models.py).
QUANTIZED_GEMV_MAX_ROWS = 4
# Wider inputs up to this many rows take panels of the weight multiplied by the worker that reads them (the
# weights' integers on the BF16 dot products, else dequantised panels), on CPUs whose packed family is
# AVX-512's; wider ones, and every width on AMX (unmeasured there), the slabs (benchmarks/quantized.py
# --widths).
QUANTIZED_FUSED_MAX_ROWS = 64
# On weights held interleaved (AVX512-VNNI builds, model/quantized_layout.py), the int8 dot products take
# inputs up to this many rows, a prompt chunk's past QUANTIZED_GEMV_MAX_ROWS with the activations to about 16
# bits (an int8 residual) so that they keep bf16's accuracy; wider ones take the slabs. Measured by width
# (benchmarks/quantized.py --widths, Zen 4): ahead of the interleaved slabs up to 64 rows, behind at 512.
# On AMX the slabs take everything past the few rows.
QUANTIZED_INTERLEAVED_MAX_ROWS = 64
# With int8 activations (--quantized-activations int8, one level per 32 values) the interleaved int8 dot
# products take every width where there is no AMX: ahead of the slabs at prompt-chunk widths too
# (benchmarks/quantized.py --widths).
QUANTIZED_INT8_MAX_ROWS = 2**31 - 1

Family = Literal["amx", "bf16dot", "avx512", "avx2"]


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """Which kernel takes each part of a step. The paged decode kernel takes every decode, in any dtype."""

    projections: Family | None  # the packed projection kernels; None: torch's linear
    gemv_max_rows: int  # inputs of at most this many rows take the BF16 GEMV instead; 0: never
    elementwise: bool  # add+RMSNorm, SiLU-and-multiply and rotary through the kernels (bf16 models)
    # The many-row kernel for prefill chunks and cascade prefixes, "amx", "avx512" (which BF16 CPUs without
    # AMX run too) or "avx2"; None: torch's.
    attention: ManyRowFamily | None
    fused_decode: bool  # decode steps' layers in one C++ call (when every weight packs)
    # Projections (AVX-512, BF16 dot products or AVX2; no GEMV) and attention both on the plain-vector
    # kernels: they carry a step's heavy ops.
    vector_carries_step: bool
    # GGUF-quantised weights run in their blocks, inputs of at most this many rows on the int8 dot products
    # (0: none, every width on the dequantised panels); None: quantised weights are dequantised at load.
    quantized_gemv_max_rows: int | None = None
    # Wider inputs up to this many rows on panels multiplied by the worker that reads them (0: none); wider
    # ones on the dequantised slabs.
    quantized_fused_max_rows: int = 0
    # Whether they are held interleaved sixteen rows at a time (model/quantized_layout.py), whose int8 dot
    # products then take every input up to the wider of the two widths above.
    quantized_interleaved: bool = False
    # Whether their int8 dot products take one int8 level of activations per 32 values at every width they
    # take (--quantized-activations int8), rather than an int8 residual in prompt chunks past the few rows.
    quantized_int8_activations: bool = False
    # Whether --quantization auto (the default) keeps them in blocks: True where the quantised kernels are at
    # least as fast as dense weights at batch widths too; False where only --quantization gguf asks for them.
    quantized_by_default: bool = True
    # What each part that stays off the kernels gets instead, and why ("torch prefill attention: head size
    # 80 has no many-row kernel"), in the order of the description; empty when every part has its kernel.
    fallbacks: tuple[str, ...] = ()

    @property
    def description(self) -> str:
        parts = [f"{self.projections or 'torch'} projections"]
        if self.gemv_max_rows:
            parts.append(f"bf16 gemv up to {self.gemv_max_rows} row{'s' if self.gemv_max_rows > 1 else ''}")
        parts.append(f"{self.attention} attention" if self.attention else "decode-kernel attention")
        if self.fused_decode:
            parts.append("fused decode stack")
        if self.quantized_interleaved:
            rows = max(self.quantized_gemv_max_rows or 0, self.quantized_fused_max_rows)
            widths = "at every width" if rows == QUANTIZED_INT8_MAX_ROWS else f"up to {rows} rows"
            activations = ", int8 activations" if self.quantized_int8_activations else ""
            parts.append(f"quantised weights packed (interleaved, int8 dot products {widths}{activations})")
        elif self.quantized_gemv_max_rows is not None:
            paths = ([f"int8 dot products up to {self.quantized_gemv_max_rows} rows"] if self.quantized_gemv_max_rows
                     else []) + ([f"panels multiplied where they are read up to {self.quantized_fused_max_rows} rows"]
                                 if self.quantized_fused_max_rows else [])
            parts.append("quantised weights packed" + (f" ({', '.join(paths)})" if paths else ""))
        text = ", ".join(parts)
        return f"{text}; fell back: {'; '.join(self.fallbacks)}" if self.fallbacks else text

    @property
    def quantized_widths(self) -> QuantizedWidths | None:
        """The quantised kernels' paths by width; None where quantised weights are dequantised at load."""
        if self.quantized_gemv_max_rows is None:
            return None
        return QuantizedWidths(self.quantized_gemv_max_rows, self.quantized_fused_max_rows,
                               self.quantized_int8_activations)


def plan_kernels(kernels: CpuKernels, dtype: torch.dtype, arch: ArchConfig,
                 int8_activations: bool = False) -> KernelPlan:
    bf16 = dtype == torch.bfloat16
    head_dim = arch.head_dim
    dtype_name = str(dtype).removeprefix("torch.")
    fallbacks: list[str] = []
    # Measured in benchmarks/cpu_kernels.py: with AMX the BF16 GEMV streams weights fastest at one row
    # (single-stream decode) and the tiles win from two rows on. With the BF16 instructions and no AMX, the
    # dot-product kernel on packed weights is on par with the GEMV at one row and ahead of torch's bf16
    # linear (oneDNN) up to a few hundred rows, on par above: it takes every width, so that a step's heavy
    # ops stay on the kernels' threads. Without those instructions torch's bf16 linear is slow at every
    # width and the AVX-512 widening kernel takes them all. Without AVX-512, torch's bf16 linear has no bf16
    # arithmetic at all and the AVX2 widening kernel takes every width.
    projections: Family | None = None
    if bf16 and kernels.amx:
        projections = "amx"
    elif bf16 and kernels.avx512:
        projections = "bf16dot" if kernels.gemv_bf16 else "avx512"
    elif bf16 and kernels.avx2:
        projections = "avx2"
    gemv_max_rows = 1 if bf16 and kernels.gemv_bf16 and kernels.amx else 0
    if not bf16:
        fallbacks.append(f"torch projections and element-wise ops: {dtype_name} model (those kernels take bf16)")
    elif projections is None:
        fallbacks.append("torch projections: no AVX2 and FMA on this CPU")
    # The many-row attention kernels take bf16 at the head sizes they are templated on: AMX tiles, else fp32
    # FMAs on AVX-512, else on AVX2.
    attention: ManyRowFamily | None = None
    if not bf16:
        fallbacks.append(f"torch prefill attention: {dtype_name} model (the many-row kernels take bf16)")
    elif head_dim not in MANY_ROW_HEAD_SIZES:
        fallbacks.append(f"torch prefill attention: head size {head_dim} has no many-row kernel "
                         f"({', '.join(map(str, MANY_ROW_HEAD_SIZES))})")
    elif kernels.amx or kernels.avx512 or kernels.avx2:
        attention = "amx" if kernels.amx else "avx512" if kernels.avx512 else "avx2"
    else:
        fallbacks.append("torch prefill attention: no AMX, AVX-512 or AVX2 on this CPU")
    if head_dim not in VECTOR_DECODE_HEAD_SIZES:
        fallbacks.append(f"portable decode attention loop: head size {head_dim} has no vectorised path")
    # The fused stack runs the Python layer's kernels in its order: a packed family for the projections and
    # a many-row kernel for the shared-prefix attention (QKV bias and QK-norm included), a dense MLP in
    # every layer (a mixture of experts routes on the host).
    fused_decode = projections is not None and attention is not None and gemv_max_rows <= 1 and not arch.is_moe
    if not fused_decode:
        why = (f"{dtype_name} model" if not bf16 else "no packed projection kernels" if projections is None
               else f"head size {head_dim} has no many-row kernel" if head_dim not in MANY_ROW_HEAD_SIZES
               else "a mixture of experts (its routing runs on the host)")
        fallbacks.append(f"no fused decode stack: {why}")
    # Quantised weights: the dequantised slabs need a packed family to keep up with bf16 weights; the int8 dot
    # products need AVX512-VNNI, or AVX2 on a CPU without AVX-512. Measured in benchmarks/quantized.py: the dot
    # products win up to a few rows.
    quantized_gemv_max_rows: int | None = None
    quantized_fused_max_rows = 0
    if not bf16:
        fallbacks.append(f"quantised weights dequantised at load: {dtype_name} model (those kernels take bf16)")
    elif not kernels.avx512 and not (kernels.avx2 and kernels.quantized_gemv):
        fallbacks.append("quantised weights dequantised at load: no AVX-512 or AVX2 on this CPU")
    else:
        quantized_gemv_max_rows = QUANTIZED_GEMV_MAX_ROWS if kernels.quantized_gemv else 0
        if projections in ("avx512", "bf16dot"):
            quantized_fused_max_rows = QUANTIZED_FUSED_MAX_ROWS
        if not kernels.quantized_gemv:
            fallbacks.append("quantised decode on dequantised panels: no AVX512-VNNI on this CPU")
    # Without AVX-512 the int8 dot products beat dense weights at a few rows, but a batch's step dequantises
    # every weight into slabs, which made 16-row decode steps slower than dense weights (benchmarks/quantized.py
    # and docs/performance.md): under load, dense weights serve more.
    # Where the build has them, the interleaved layout's kernels take every width up to their own limit: at one
    # row they stream the weights 1.3-1.6x as fast as the planar few-row kernel (benchmarks/quantized.py
    # --widths).
    quantized_interleaved = bool(quantized_gemv_max_rows) and kernels.quantized_interleave_rows > 0
    if quantized_interleaved and quantized_fused_max_rows:
        quantized_fused_max_rows = QUANTIZED_INT8_MAX_ROWS if int8_activations else QUANTIZED_INTERLEAVED_MAX_ROWS
    quantized_int8_activations = int8_activations and quantized_interleaved
    if int8_activations and not quantized_int8_activations and quantized_gemv_max_rows is not None:
        fallbacks.append("int16 activations: int8 ones need the interleaved kernels (AVX512-VNNI)")
    elif quantized_int8_activations and not quantized_fused_max_rows:
        fallbacks.append(f"int8 activations up to {quantized_gemv_max_rows} rows: wider inputs take the AMX tiles "
                         "on dequantised weights")
    quantized_by_default = quantized_gemv_max_rows is not None and kernels.avx512
    if quantized_gemv_max_rows is not None and not quantized_by_default:
        fallbacks.append("quantised weights in their blocks only with --quantization gguf: without AVX-512 a batch "
                         "dequantises them every step")
    return KernelPlan(projections=projections, gemv_max_rows=gemv_max_rows, elementwise=bf16, attention=attention,
                      fused_decode=fused_decode, quantized_gemv_max_rows=quantized_gemv_max_rows,
                      quantized_fused_max_rows=quantized_fused_max_rows,
                      quantized_interleaved=quantized_interleaved, quantized_by_default=quantized_by_default,
                      quantized_int8_activations=quantized_int8_activations,
                      vector_carries_step=projections in ("avx512", "bf16dot", "avx2")
                      and attention in ("avx512", "avx2") and gemv_max_rows == 0,
                      fallbacks=tuple(fallbacks))


class CpuKernelsBackend:
    name = "cpu_kernels"

    def __init__(self, plan: KernelPlan, arch: ArchConfig, device: torch.device, config: BackendConfig) -> None:
        self.plan = plan
        self.arch = arch
        self.device = device
        self.config = config
        self.description = f"{self.name} ({plan.description})"
        cpu_ops = build_cpu_ops(plan.projections, plan.gemv_max_rows, plan.elementwise, plan.quantized_widths)
        self.quantized_types = KERNEL_TYPES if plan.quantized_gemv_max_rows is not None else frozenset()
        self.quantized_by_default = plan.quantized_by_default
        self.quantized_interleaved = plan.quantized_interleaved
        self.quantized_int8_activations = plan.quantized_int8_activations
        self.ops = cpu_ops.ops
        self._packed_linear, self._packed_gate_up = cpu_ops.packed_linear, cpu_ops.packed_gate_up
        self._activation_levels = cpu_ops.activation_levels
        # torch's argmax walks a bf16 row one element at a time; the kernel takes bf16 and float32.
        self.argmax = torch.ops.kvserve.argmax_rows
        self.mask_logits = torch.ops.kvserve.mask_logits
        # Only the AMX attention keeps packed KV across steps, so only it needs to know which blocks changed.
        self._versions = BlockVersions() if plan.attention == "amx" else None
        self._shared_prefill_min_tokens = (config.cascade_min_tokens if config.shared_prefill_min_tokens is None
                                           else config.shared_prefill_min_tokens)
        self._carries_step = plan.vector_carries_step

    def make_attention(self, layer_index: int) -> CpuKernelPagedAttention:
        arch, plan = self.arch, self.plan
        return CpuKernelPagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.attention_scale,
                                       arch.layer_window(layer_index), many_rows=plan.attention,
                                       split_size=self.config.decode_split_size)

    def build_fused_decode(self, layers: Sequence[DecoderWeights], layout: DecoderLayout) -> FusedDecode | None:
        if not self.plan.fused_decode or not layout.llama_layers:
            return None
        assert self._packed_linear is not None and self._packed_gate_up is not None
        stack = FusedDecodeStack.build(self.arch, layers, self._packed_linear, self._packed_gate_up,
                                       single_row_gemv=self.plan.gemv_max_rows == 1,
                                       quantized_widths=self.plan.quantized_widths,
                                       activation_levels=self._activation_levels)
        if stack is None:
            # Decided at load, after the start-up line that named the stack: say that it is off after all.
            logger.info("no fused decode stack: a projection weight did not pack for the %s kernels, or the layers "
                        "mix quantised and dense projection weights", self.plan.projections)
        elif self.plan.attention is not None:
            # Without a many-row kernel, prefill attention is torch's and needs torch's threads.
            self._carries_step = True
        return stack

    def packed_weight_nbytes(self) -> int:
        copies = [*(self._packed_linear.packed.values() if self._packed_linear else ()),
                  *(self._packed_gate_up.packed.values() if self._packed_gate_up else ())]
        return sum(t.numel() * t.element_size() for t in copies)

    def step_scope(self) -> AbstractContextManager[None]:
        # The kernels carry every heavy op of a step (the fused decode stack, or the plain-vector projections
        # and attention): torch's ops then run on the calling thread alone (KernelThreadScope says why).
        return KernelThreadScope() if self._carries_step else nullcontext()

    def build_metadata(self, rows: StepRows) -> CpuAttentionMetadata:
        if self._activation_levels is not None:
            num_rows = rows.num_decode_rows + sum(chunk.q_len for chunk in rows.prefills)
            self._activation_levels.set_step(rows.num_decode_requests or 0, num_rows, bool(rows.prefills))
        versions = self._versions
        if versions is not None:
            versions.bump(rows.written_block_ids)
        device, block_size = self.device, rows.block_size
        many_rows = self.plan.attention is not None
        meta = CpuAttentionMetadata(slot_mapping=rows.slot_mapping, num_decode_tokens=rows.num_decode_rows,
                                    prefills=prefill_spans(rows, device),
                                    window=window_layout(rows, self.arch.sliding_window, device))
        split = split_decodes(rows, self.config.cascade_min_tokens)
        if split is not None:
            meta.decode_block_table = split.block_table.to(device, non_blocking=True)
            meta.decode_seq_lens = split.seq_lens.to(device, non_blocking=True)
            shared = split.shared_block_ids
            if shared:
                meta.decode_prefix_blocks = torch.tensor(shared, dtype=torch.long).to(device, non_blocking=True)
                if many_rows:
                    meta.decode_prefix_runs = _paged_runs([shared], [len(shared) * block_size],
                                                          [rows.num_decode_rows], device)
                if versions is not None:
                    meta.decode_prefix_key = versions.key(shared)
        if rows.prefills and many_rows:
            tables = [chunk.block_ids for chunk in rows.prefills]
            kv_lens = [chunk.kv_len for chunk in rows.prefills]
            meta.prefill_runs = _paged_runs(tables, kv_lens, [chunk.q_len for chunk in rows.prefills], device)
            if versions is not None:
                # Keys every chunk holds in the same blocks, in whole key steps: packed once per layer and
                # kept while the blocks are unchanged, instead of once per chunk and head every step.
                shared_keys = shared_prefix_blocks(tables, kv_lens, block_size) * block_size
                shared_keys = shared_keys // PREFIX_KEY_STEP * PREFIX_KEY_STEP
                if shared_keys >= self._shared_prefill_min_tokens:
                    shared = tables[0][: -(-shared_keys // block_size)]
                    meta.prefill_prefix_keys = shared_keys
                    meta.prefill_prefix_table = torch.tensor(shared, dtype=torch.int32, device=device)
                    meta.prefill_prefix_key = (shared_keys, *versions.key(shared))
        return meta


def _paged_runs(tables: list[list[int]], kv_lens: list[int], q_lens: list[int], device: torch.device) -> PagedRuns:
    width = max(len(table) for table in tables)
    q_starts = [0]
    for q_len in q_lens:
        q_starts.append(q_starts[-1] + q_len)
    tensors = (torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32),
               torch.tensor(kv_lens, dtype=torch.int32), torch.tensor(q_starts, dtype=torch.int32))
    return PagedRuns(*(t.to(device, non_blocking=True) for t in tensors))
