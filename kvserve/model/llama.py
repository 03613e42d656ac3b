"""The Llama family: Llama / SmolLM2, Mistral, Qwen2 (QKV bias) and Qwen3 (QK-norm), one implementation;
with a mixture-of-experts MLP (model/moe.py) in the layers that route, Mixtral, Qwen2-MoE and Qwen3-MoE.

Weights arrive under Hugging Face names; Q/K/V and gate/up are fused into one matmul each at load time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from kvserve.config import ArchConfig
from kvserve.errors import ModelLoadError
from kvserve.kv_layout import KVLayout
from kvserve.model.backends.base import (
    NO_ROTATION,
    AttentionMetadata,
    Backend,
    DecoderLayout,
    FusedDecode,
    PagedAttention,
)
from kvserve.model.layers import RotaryEmbedding, rms_norm
from kvserve.model.lora import LayerLoRA, StepLoRA
from kvserve.model.mlp import FeedForward, GatedMLP, Take
from kvserve.model.moe import MoeMLP
from kvserve.model.ops import ModelOps
from kvserve.model.quantized import QuantizedWeight, Weight, concat_rows, type_name


class DecoderLayer:
    def __init__(self, arch: ArchConfig, attention: PagedAttention, ops: ModelOps) -> None:
        self.arch = arch
        self.attention = attention
        self.ops = ops
        self.qkv_weight: Weight  # [q_size + 2 * kv_size, hidden]
        self.qkv_bias: torch.Tensor | None = None
        self.o_weight: Weight  # [hidden, q_size]
        self.q_norm: torch.Tensor | None = None  # [head_dim]
        self.k_norm: torch.Tensor | None = None
        self.mlp: FeedForward  # dense (GatedMLP) or mixture of experts (MoeMLP)
        self.input_norm: torch.Tensor  # [hidden]
        self.post_attention_norm: torch.Tensor

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        lora: LayerLoRA | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``lora``: the adapters of the step's rows at this layer (None: every row runs the base model);
        ``cos``, ``sin`` None: a layer without rotary."""
        eps, ops = self.arch.rms_norm_eps, self.ops
        x, residual = ops.add_rms_norm(hidden, residual, self.input_norm, eps)
        attn = self.attend(x, cos, sin, meta, kv_cache, lora)
        x, residual = ops.add_rms_norm(self.project_out(attn, lora), residual, self.post_attention_norm, eps)
        return self.to_residual(self.mlp.forward(x, lora)), residual

    def project_out(self, attn: torch.Tensor, lora: LayerLoRA | None) -> torch.Tensor:
        """The attention's output projection (O), with the rows' adapters, as it joins the residual stream."""
        out = self.ops.linear(attn, self.o_weight, None)
        return self.to_residual(out if lora is None else lora.add("o", attn, out))

    def to_residual(self, out: torch.Tensor) -> torch.Tensor:
        """A block's output as it joins the residual stream (times Granite's residual multiplier)."""
        multiplier = self.arch.residual_multiplier
        return out if multiplier == 1.0 else out * multiplier

    def attend(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, meta: AttentionMetadata,
               kv_cache: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        """QKV projection, QK-norm, rotary and paged attention: [num_tokens, hidden] -> [num_tokens, q_size]."""
        arch, ops, eps = self.arch, self.ops, self.arch.rms_norm_eps
        num_tokens = x.shape[0]
        num_heads, num_kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        qkv = ops.linear(x, self.qkv_weight, self.qkv_bias)  # [num_tokens, q_size + 2 * kv_size]
        if lora is not None:
            qkv = lora.add("qkv", x, qkv)
        # Q and K heads side by side, so one rotary call covers both.
        qk = qkv[:, : arch.q_size + arch.kv_size].view(num_tokens, num_heads + num_kv_heads, head_dim)
        v = qkv[:, arch.q_size + arch.kv_size :].view(num_tokens, num_kv_heads, head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((ops.add_rms_norm(qk[:, :num_heads], None, self.q_norm, eps)[0],
                            ops.add_rms_norm(qk[:, num_heads:], None, self.k_norm, eps)[0]), dim=1)
        if cos is not None and sin is not None:
            qk = ops.rotary(qk, cos, sin)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        return self.attention.forward(q, k, v, kv_cache, meta)


class LlamaForCausalLM:
    # Llama's layer layout, which a backend's fused decode stack may run itself (a family with another says False).
    llama_layers = True

    def __init__(self, arch: ArchConfig, backend: Backend, dtype: torch.dtype, device: torch.device) -> None:
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.backend = backend
        self.ops = backend.ops
        # One attention object per layer: what a kernel keeps across steps is that layer's own.
        self.layers = [self.make_layer(i) for i in range(arch.num_layers)]
        # Which KV group's table each layer reads, when the engine keeps the window layers' KV apart.
        self.layer_group = KVLayout.for_arch(arch).layer_group
        self.rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, dtype, device,
                                      arch.rope_scaling, arch.rotary_dim)
        self.layer_rotations = self.decoder_layout().layer_rotations
        self.embed_tokens: Weight  # [vocab, hidden]
        self.final_norm: torch.Tensor
        self.lm_head: Weight  # [vocab, hidden]; the embedding itself when tied
        # Decode steps' layers in one call where the backend has one (set once the weights are prepared).
        self.fused_decode: FusedDecode | None = None
        # Entered around each step's forward and sampling (the backend's, set once the weights are prepared).
        self.thread_scope: AbstractContextManager[None] = nullcontext()

    def make_layer(self, layer_index: int) -> DecoderLayer:
        return DecoderLayer(self.arch, self.backend.make_attention(layer_index), self.ops)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        group_metas: Sequence[AttentionMetadata] = (),
        lora: StepLoRA | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden], before the final norm
        """``meta`` is the step's layout over the requests' block tables, ``group_metas`` over the tables of
        the other KV groups, when the layers keep their KV in groups (kv_layout.py); ``lora`` which rows run
        which LoRA adapter (None: none does)."""
        hidden = self.embed(input_ids)
        rotations = self.rotations(positions)
        step_metas = (meta, *group_metas)
        if lora is None and self.fused_decode is not None and self.fused_decode.accepts(hidden, step_metas):
            last_hidden, last_residual = self.fused_decode(hidden, rotations, step_metas, kv_caches)
            return last_hidden + last_residual
        residual: torch.Tensor | None = None
        metas = self.layer_metas(meta, group_metas)
        for i, (layer, kv_cache, layer_meta, r) in enumerate(zip(self.layers, kv_caches, metas, self.layer_rotations,
                                                                  strict=True)):
            cos, sin = rotations[r] if r != NO_ROTATION else (None, None)
            hidden, residual = layer.forward(hidden, residual, cos, sin, layer_meta, kv_cache,
                                             None if lora is None else lora.layer(i))
        assert residual is not None
        return hidden + residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded = self.ops.embedding(input_ids, self.embed_tokens)
        multiplier = self.arch.embedding_multiplier
        return embedded if multiplier == 1.0 else embedded * multiplier

    def rotations(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) at the positions for each rope base the layers use (``DecoderLayout.layer_rotations``)."""
        return [self.rotary.lookup(positions)]

    def decoder_layout(self) -> DecoderLayout:
        return DecoderLayout(llama_layers=self.llama_layers, layer_rotations=tuple(
            NO_ROTATION if i in self.arch.no_rope_layers else 0 for i in range(len(self.layers))))

    def prepare_decode(self, kv_caches: list[torch.Tensor], layer_tables: Sequence[int]) -> None:
        """Called once the KV caches exist, before the first step, with each layer's KV group (all 0 when the
        engine keeps one table for every layer): the fused decode may record its steps."""
        if self.fused_decode is not None:
            self.fused_decode.prepare(kv_caches, layer_tables)

    def layer_metas(self, meta: AttentionMetadata, group_metas: Sequence[AttentionMetadata]) -> list[AttentionMetadata]:
        """Each layer's attention layout: its KV group's."""
        if not group_metas:
            return [meta] * len(self.layers)
        metas = (meta, *group_metas)
        return [metas[group] for group in self.layer_group]

    def compute_logits(self, hidden: torch.Tensor, head: Weight | None = None) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] in the model's dtype (only the rows that sample). Kept there:
        greedy argmax is exact in any dtype, and the sampler's general path converts to float32 itself. (The CPU
        argmax kernel takes bf16 and float32; float16 is refused on CPU at start-up.) ``head``: leading rows of
        the output projection to use instead of the whole (a draft's pruned vocabulary)."""
        logits = self.ops.linear(self.final_hidden(hidden), self.lm_head if head is None else head, None)
        return logits if self.arch.logits_scaling == 1.0 else logits / self.arch.logits_scaling

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's output after the final norm: what the output projection reads."""
        return rms_norm(hidden, self.final_norm, self.arch.rms_norm_eps)

    # --- weights --------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Take tensors under Hugging Face names; fuse Q/K/V and gate/up; check nothing is missing. Quantised
        weights (model/quantized.py) stay as they come: the backend's ops run them."""
        arch = self.arch
        parts: dict[str, Weight] = {}
        for name, tensor in weights:
            parts[name] = tensor.to(device=self.device, dtype=self.dtype) if isinstance(tensor, torch.Tensor) else tensor

        def take(name: str) -> Weight:
            try:
                return parts.pop(name)
            except KeyError:
                raise ModelLoadError(f"weight {name!r} is missing from the model files") from None

        self.embed_tokens = take("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        if arch.tie_word_embeddings:
            parts.pop("lm_head.weight", None)
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = take("lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            layer.qkv_weight = (take(attn + "qkv_proj.weight") if arch.fused_projections else
                                concat_rows([take(attn + "q_proj.weight"), take(attn + "k_proj.weight"),
                                             take(attn + "v_proj.weight")]))
            if arch.qkv_bias:
                layer.qkv_bias = torch.cat([take(attn + "q_proj.bias"), take(attn + "k_proj.bias"),
                                            take(attn + "v_proj.bias")]).contiguous()
            layer.o_weight = take(attn + "o_proj.weight")
            if arch.qk_norm:
                layer.q_norm = take(attn + "q_norm.weight")
                layer.k_norm = take(attn + "k_norm.weight")
            layer.mlp = self.load_mlp(i, mlp, take)
            layer.input_norm = take(p + "input_layernorm.weight")
            layer.post_attention_norm = take(p + "post_attention_layernorm.weight")
        for layer in self.layers:
            for weight in (layer.qkv_weight, layer.o_weight):
                self.ops.prepare_weight(weight)
            layer.mlp.prepare()
        self.ops.prepare_weight(self.lm_head)
        self.fused_decode = self.backend.build_fused_decode(self.layers, self.decoder_layout())
        self.thread_scope = self.backend.step_scope()
        # Tolerate biases some checkpoints carry as zeros; anything else unexpected is a layout we don't know.
        leftover = [name for name in parts if not name.endswith(".bias")]
        if leftover:
            raise ModelLoadError(f"unexpected weights for {arch.architecture}: {sorted(leftover)[:5]}")

    def load_mlp(self, layer_index: int, prefix: str, take: Take) -> FeedForward:
        """Layer ``layer_index``'s feed-forward block from the weights under ``prefix``."""
        if self.arch.is_moe_layer(layer_index):
            return MoeMLP.load(self.arch, self.ops, prefix, take)
        if self.arch.fused_projections:
            return GatedMLP(self.ops, take(prefix + "gate_up_proj.weight"), take(prefix + "down_proj.weight"))
        return GatedMLP.load(self.ops, prefix, take)

    def weights(self) -> list[Weight]:
        """Every weight the model holds, each once."""
        tensors = [self.embed_tokens, self.final_norm]
        if self.lm_head is not self.embed_tokens:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [layer.qkv_weight, layer.o_weight, *layer.mlp.tensors(), layer.input_norm,
                        layer.post_attention_norm]
        return tensors

    @property
    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.weights())

    def weight_nbytes(self) -> int:
        """The bytes the weights are held in (before any kernel's packed copies)."""
        return sum(w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size() for w in self.weights())

    @property
    def holds_quantized_weights(self) -> bool:
        """Whether any weight is kept in its GGUF blocks (and multiplied there) rather than dequantised."""
        return any(isinstance(w, QuantizedWeight) for w in self.weights())

    def weight_summary(self) -> str:
        """What the weights are held as and how many bytes they take (before any kernel's packed copies),
        for the start-up log: "412.3 MiB; 97 matrices in GGUF blocks (Q5_0, Q6_K, Q8_0), the rest bfloat16"."""
        quantized = [w for w in self.weights() if isinstance(w, QuantizedWeight)]
        nbytes = self.weight_nbytes()
        dtype = str(self.dtype).removeprefix("torch.")
        if not quantized:
            return f"{nbytes / 2**20:.1f} MiB, all {dtype}"
        types = sorted({type_name(s.ggml_type) for w in quantized for s in w.segments})
        interleaved = sum(w.interleaved for w in quantized)
        layout = f", {interleaved} of them interleaved" if interleaved else ""
        return (f"{nbytes / 2**20:.1f} MiB; {len(quantized)} matrices in GGUF blocks ({', '.join(types)}){layout}, "
                f"the rest {dtype}")
