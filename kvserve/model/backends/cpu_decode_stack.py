"""A decode step's decoder layers in one C++ call (csrc/decode_stack.cpp), on every packed projection family.

Per layer, the Python decoder layer dispatches ~15 ops (norms, projections, rotary, the KV write, the two
attention halves and their merge, views and copies between them): ~450 per 30-layer decode step, each
costing Python and dispatcher time on the engine thread while the kernels' other thread waits. The C++
stack calls the same kernels in the same order (a single row on the GEMV, as the Python layer does), so
its output is bit for bit the Python path's. It takes steps whose every token is a decode, on a model
whose every projection weight the plan's family (AMX, AVX512-BF16 dot products, AVX-512 or AVX2) packed, at
head sizes 64, 128 and 256, with or without a QKV bias (Qwen2) and QK-norm (Qwen3), some layers without rotary
(SmolLM3), the blocks' outputs scaled as they join the residual stream (Granite); the shared prefix of cascade
decode goes through the plan's many-row attention kernel (AMX, AVX-512 or AVX2).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.config import ArchConfig
from kvserve.model.backends.base import AttentionMetadata, DecoderWeights
from kvserve.model.backends.cpu_attention import CpuAttentionMetadata, CpuKernelPagedAttention
from kvserve.model.backends.cpu_ops import ActivationLevels, PackedGateUpSilu, PackedLinear, QuantizedWidths
from kvserve.model.quantized import QuantizedWeight


class QuantizedStackWeights:
    """The stack's projections on GGUF-quantised weights: per layer the QKV, O, gate/up and down weights'
    segment counts and inner sizes, and every segment's blocks and type in that order (decode_stack's
    quant_* arguments)."""

    def __init__(self, weights: list[QuantizedWeight], widths: QuantizedWidths,
                 levels: ActivationLevels | None = None) -> None:
        self.data = [d for w in weights for d in w.data]
        self.types = [t for w in weights for t in w.types]
        self.segments = [len(w.segments) for w in weights]
        self.cols = [w.cols for w in weights]
        self.widths = widths
        # The step's one-level rows apply where every weight is interleaved (the planar kernel keeps its limit).
        self.levels = levels if all(w.interleaved for w in weights) else None

    @property
    def gemv_max_rows(self) -> int:
        return self.levels.one_level_rows if self.levels is not None else self.widths.gemv_max_rows


class FusedDecodeStack:
    """The model's layers as one ``torch.ops.kvserve.decode_stack`` call, for steps ``accepts`` takes."""

    def __init__(self, arch: ArchConfig, attentions: list[CpuKernelPagedAttention], input_norms: list[torch.Tensor],
                 post_norms: list[torch.Tensor], packed: dict[str, list[torch.Tensor]],
                 single_row_weights: list[torch.Tensor], qkv_biases: list[torch.Tensor],
                 qk_norms: tuple[list[torch.Tensor], list[torch.Tensor]],
                 quantized: QuantizedStackWeights | None = None, projections: str = "amx") -> None:
        self.arch = arch
        self.projections = projections  # the packed family's name (cpu_ops.PackedKernels.name)
        # The many-row attention family the shared-prefix half runs on ("none": steps with one are not taken);
        # only AMX keeps packed prefixes.
        self.attention = attentions[0].many_rows or "none"
        self.attentions = attentions  # per layer: its packed shared prefix is kept there
        self.input_norms = input_norms
        self.post_norms = post_norms
        self.packed = packed  # "qkv", "o", "gate_up", "down": one packed weight per layer
        # Per layer the raw QKV, O, gate/up and down weights, for a one-row step's GEMV; empty: AMX there too.
        self.single_row_weights = single_row_weights
        self.qkv_biases = qkv_biases  # per layer, or empty: no QKV bias
        self.q_norms, self.k_norms = qk_norms  # per layer each, or both empty: no QK-norm
        self.quantized = quantized  # the projections on quantised weights (then `packed` lists are empty)
        self.unrotated_layers = list(arch.no_rope_layers)  # built once: the stack is called every decode step

    @classmethod
    def build(cls, arch: ArchConfig, layers: Sequence[DecoderWeights], linear: PackedLinear,
              gate_up: PackedGateUpSilu, single_row_gemv: bool,
              quantized_widths: QuantizedWidths | None = None,
              activation_levels: ActivationLevels | None = None) -> FusedDecodeStack | None:
        """The stack for these layers, whose projections the packed kernels ``linear`` and ``gate_up`` take
        (a single row on the GEMV when ``single_row_gemv``, as the Python layer does), or, where every
        projection weight is GGUF-quantised and ``quantized_widths`` is given, the quantised kernels;
        None where a weight could not be packed or the layers mix the two. The backend decides that the
        stack applies (cpu_kernels.py's plan); a mixture of experts, which the C++ stack has no routing for,
        gets None here too."""
        if arch.is_moe:
            return None
        attentions = [a for layer in layers if isinstance(a := layer.attention, CpuKernelPagedAttention)]
        assert len(attentions) == len(layers)
        biases = [layer.qkv_bias for layer in layers if layer.qkv_bias is not None]
        q_norms = [layer.q_norm for layer in layers if layer.q_norm is not None]
        k_norms = [layer.k_norm for layer in layers if layer.k_norm is not None]
        assert len(biases) in (0, len(layers)) and len(q_norms) == len(k_norms) in (0, len(layers))
        projections = [w for layer in layers
                       for w in (layer.qkv_weight, layer.o_weight, layer.mlp.gate_up_weight, layer.mlp.down_weight)]
        quantized = [w for w in projections if isinstance(w, QuantizedWeight)]
        if quantized:
            if len(quantized) < len(projections) or quantized_widths is None:
                return None
            return cls(arch, attentions, [layer.input_norm for layer in layers],
                       [layer.post_attention_norm for layer in layers], {"qkv": [], "o": [], "gate_up": [], "down": []},
                       [], biases, (q_norms, k_norms), QuantizedStackWeights(quantized, quantized_widths, activation_levels))
        packed: dict[str, list[torch.Tensor]] = {"qkv": [], "o": [], "gate_up": [], "down": []}
        for layer in layers:
            weights = {"qkv": layer.qkv_weight, "o": layer.o_weight, "down": layer.mlp.down_weight}
            for name, weight in weights.items():
                found = linear.packed_for(weight)
                if found is None:
                    return None
                packed[name].append(found)
            interleaved = gate_up.packed_for(layer.mlp.gate_up_weight)
            if interleaved is None:
                return None
            packed["gate_up"].append(interleaved)
        single_row = [weight for layer in layers for weight in (
            layer.qkv_weight, layer.o_weight, layer.mlp.gate_up_weight, layer.mlp.down_weight)
        ] if single_row_gemv else []
        return cls(arch, attentions, [layer.input_norm for layer in layers],
                   [layer.post_attention_norm for layer in layers], packed, single_row, biases, (q_norms, k_norms),
                   projections=linear.kernels.name)

    def _quantized_args(self) -> tuple[list[torch.Tensor], list[int], list[int], list[int], int, int, bool]:
        q = self.quantized
        return (([], [], [], [], 0, 0, False) if q is None
                else (q.data, q.types, q.segments, q.cols, q.gemv_max_rows, q.widths.fused_max_rows,
                      q.widths.int8_activations))

    def prepare(self, kv_caches: list[torch.Tensor], layer_tables: Sequence[int]) -> None:
        return None  # nothing recorded: each step calls the C++ stack with its own tensors

    def accepts(self, hidden: torch.Tensor, metas: Sequence[AttentionMetadata]) -> bool:
        if len(metas) != 1:  # one table for every layer
            return False
        meta = metas[0]
        assert isinstance(meta, CpuAttentionMetadata)
        rows = hidden.shape[0]
        return (rows >= 1 and meta.num_decode_tokens == rows and not meta.prefills
                and hidden.dtype == torch.bfloat16 and meta.decode_block_table is not None
                and meta.decode_seq_lens is not None
                and (meta.decode_prefix_blocks is None
                     or (meta.decode_prefix_runs is not None and self.attention != "none")))

    def __call__(self, hidden: torch.Tensor, rotations: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 metas: Sequence[AttentionMetadata], kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the last layer, as the layers' own forwards would leave them."""
        ((cos, sin),), (meta,) = rotations, metas
        assert isinstance(meta, CpuAttentionMetadata)
        runs = meta.decode_prefix_runs if meta.decode_prefix_blocks is not None else None
        prefix_packed: list[torch.Tensor] = []
        missing: list[int] = []
        if runs is not None and self.attention == "amx":
            # A layer whose packed prefix is not kept (first step on this prefix, or no key) packs it inside
            # the kernel, after this step's KV write, as the Python path does; it is kept afterwards.
            empty = torch.empty(0, dtype=torch.int32)
            for i, attention in enumerate(self.attentions):
                kept = attention.kept_prefix(meta.decode_prefix_key)
                if kept is None:
                    missing.append(i)
                prefix_packed.append(empty if kept is None else kept)
        arch = self.arch
        hidden, residual = torch.ops.kvserve.decode_stack(
            hidden, cos, sin, self.input_norms, self.post_norms, self.packed["qkv"], self.packed["o"],
            self.packed["gate_up"], self.packed["down"], kv_caches, meta.slot_mapping, meta.decode_block_table,
            meta.decode_seq_lens, None if runs is None else runs.block_tables, None if runs is None else runs.kv_lens,
            None if runs is None else runs.q_starts, prefix_packed, self.single_row_weights, self.qkv_biases,
            self.q_norms, self.k_norms, self.unrotated_layers, arch.residual_multiplier, arch.num_heads,
            arch.num_kv_heads, arch.rms_norm_eps, self.attentions[0].scale, self.attentions[0].split_size,
            *self._quantized_args(), self.projections, self.attention,
        )
        if runs is not None and meta.decode_prefix_key is not None and self.attention == "amx":
            for i in missing:
                self.attentions[i].packed_prefix_for(kv_caches[i][0], kv_caches[i][1], runs, meta.decode_prefix_key)
        return hidden, residual
