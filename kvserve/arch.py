"""A model's architecture: the one description the loader, the runner and the cost model all read.

``kvserve.formats`` reads it from a model's files (GGUF metadata, a Hugging Face ``config.json``);
``kvserve.model_presets`` writes it out for published models. The engine runs llama-like models (the
first block of fields), dense or mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE); the
multi-head-latent-attention fields are read by the cost model only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def yarn_magnitude(factor: float, mscale: float = 1.0) -> float:
    """YaRN's scale of the rotation's magnitude for a context stretched by ``factor``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How the rotary frequencies of the full-attention layers are stretched for a longer context, as
    transformers computes them: ``linear`` divides every frequency by ``factor``; ``llama3`` (Llama 3.1 and
    later) divides the low ones by ``factor``, keeps the high ones and blends those between, by wavelength
    against ``original_max_position_embeddings``; ``freq_factors`` divides each frequency by its own factor
    (what llama.cpp's GGUF files carry as rope_freqs.weight in place of the llama3 parameters); ``yarn``
    (Qwen2.5's and Qwen3's long context) interpolates the low frequencies by ``factor``, keeps the high ones,
    ramps between ``beta_slow`` and ``beta_fast`` rotations over the original context, and scales the
    rotation's magnitude by ``attention_factor`` (0: derived from ``factor``, and ``mscale`` over
    ``mscale_all_dim`` where both are set); ``longrope`` (Phi-3.5, Phi-4-mini) divides each frequency by its
    own factor (``freq_factors``: the short ones, those of the original context) and scales the magnitude by
    ``attention_factor``."""

    kind: str  # "linear", "llama3", "freq_factors", "yarn" or "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def served_context(self, max_position_embeddings: int) -> int:
        """The context a model of this stretch is served: YaRN's original context times its factor (vLLM's
        reading of a YaRN config, whose ``max_position_embeddings`` often stays the original's); LongRoPE's
        original context, where its short factors hold (past it the long ones would, for every position, as
        llama.cpp runs them: not served); the config's for the other kinds."""
        if self.kind == "yarn":
            return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        if self.kind == "longrope":
            return min(max_position_embeddings, self.original_max_position_embeddings)
        return max_position_embeddings

    @property
    def magnitude(self) -> float:
        """What YaRN and LongRoPE multiply the rotation's cos and sin by (1 for the other kinds)."""
        if self.kind not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor or self.kind == "longrope":
            return self.attention_factor or 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_magnitude(self.factor, self.mscale) / yarn_magnitude(self.factor, self.mscale_all_dim)
        return yarn_magnitude(self.factor)


@dataclass(frozen=True, slots=True)
class ArchConfig:
    """A model's shape and the counts FLOPs and bytes per token depend on.

    Mixture of experts: a layer ``is_moe_layer`` routes each token to ``num_experts_per_token`` of
    ``num_experts`` experts of ``moe_intermediate_size`` plus ``num_shared_experts`` always-on ones; the
    others (``num_dense_layers`` leading ones, ``mlp_only_layers``, those ``decoder_sparse_step`` skips)
    use a dense MLP of ``intermediate_size``. Multi-head latent attention
    (DeepSeek-V2/V3) caches one latent of ``kv_lora_rank + qk_rope_head_dim`` per token per layer.
    """

    # The engine's: "llama", "mistral", "qwen2", "qwen3", "smollm3", "granite", "phi3", "gemma3", "mixtral",
    # "qwen2_moe", "qwen3_moe"
    # (Hugging Face model_type names); any model_type for the cost model.
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3, Gemma 3
    # Sliding-window attention (Gemma 3): the layers in ``sliding_layers`` see only the last ``sliding_window``
    # keys and rotate with their own rope base; the others attend to everything.
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float = 0.0  # rope base of the sliding layers (0: rope_theta)
    rope_scaling: RopeScaling | None = None  # of the full-attention layers (the sliding ones keep theirs)
    no_rope_layers: tuple[int, ...] = ()  # layers whose attention has no rotary at all (SmolLM3's NoPE layers)
    # Dimensions of each head that rotate, the first ones (Phi-4-mini's 3/4; 0: all). The loader moves each Q/K
    # head's rows so that the kernels' whole-head rotation (halves paired) turns these and leaves the rest.
    rotary_dim: int = 0
    fused_projections: bool = False  # the checkpoint holds QKV and gate/up fused (Phi-3's qkv_proj, gate_up_proj)
    query_pre_attn_scalar: float = 0.0  # attention scale is this ** -0.5 (0: head_dim, the usual)
    # Granite's scalars: the embeddings times embedding_multiplier, each layer's attention and MLP outputs times
    # residual_multiplier as they join the residual stream, the logits divided by logits_scaling, and the
    # attention scale attention_multiplier (0: as above).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float = 0.0
    final_logit_softcapping: float = 0.0  # logits -> cap * tanh(logits / cap) (0: none)
    # Mixture of experts (0: a dense MLP in every layer).
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0  # 0: intermediate_size
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0  # 0: moe_intermediate_size
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output scaled by sigmoid(gate(x))
    norm_topk_prob: bool = False  # renormalise the top-k routing probabilities to sum to one (Mixtral: always)
    num_dense_layers: int = 0
    decoder_sparse_step: int = 1  # Qwen MoE: every decoder_sparse_step-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # Qwen MoE: layers that stay dense
    # Multi-head latent attention (0: ordinary multi-head / grouped-query attention).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""  # what the model calls itself (GGUF general.name, a preset's key); "" when unknown

    # ---- attention sizes ---------------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.attention_multiplier or (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer_index: int) -> int | None:
        """The keys a layer's queries see back from their own position (None: all of them)."""
        return self.sliding_window if self.sliding_window and layer_index in self.sliding_layers else None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.num_experts_per_token > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def shared_expert_size(self) -> int:
        return self.shared_expert_intermediate_size or self.expert_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` routes tokens to experts (the rule of Hugging Face's Qwen MoE decoder layer)."""
        return (self.is_moe and layer >= self.num_dense_layers and layer not in self.mlp_only_layers
                and (layer + 1) % max(self.decoder_sparse_step, 1) == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(layer) for layer in range(self.num_layers))

    # ---- the KV cache ------------------------------------------------------------------------------

    def kv_elements_per_token(self) -> int:
        """Cached values per token across all layers (K and V; MLA: the latent and the rope key)."""
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.num_layers * self.kv_size

    def kv_bytes_per_token(self, dtype_bytes: float = 2) -> float:
        """Bytes of KV one token occupies across all layers (an int for a whole ``dtype_bytes``)."""
        return self.kv_elements_per_token() * dtype_bytes

    # ---- parameter counts --------------------------------------------------------------------------

    def attention_params(self) -> int:
        """Weights of one layer's attention projections."""
        h, n = self.hidden_size, self.num_heads
        if self.is_mla:
            q = (h * self.q_lora_rank + self.q_lora_rank * n * self.qk_head_dim) if self.q_lora_rank else (
                h * n * self.qk_head_dim)
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * n * (
                self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + n * self.v_head_dim * h
        q, kv = self.q_size, self.kv_size
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return h * (q + 2 * kv) + q * h + bias

    def mlp_params(self, intermediate: int) -> int:
        """A gated (SwiGLU) MLP: gate, up and down projections."""
        return 3 * self.hidden_size * intermediate

    def layer_mlp_params(self, active: bool) -> list[int]:
        """MLP weights per layer: all of them, or the ones one token uses (``active``)."""
        routed = self.num_experts_per_token if active else self.num_experts
        dense = self.mlp_params(self.intermediate_size)
        return [int(self.moe_mlp_params(routed)) if self.is_moe_layer(layer) else dense
                for layer in range(self.num_layers)]

    def moe_mlp_params(self, num_routed: float) -> float:
        """One MoE layer's MLP weights with ``num_routed`` routed experts: those, the shared ones, the router."""
        experts = num_routed * self.mlp_params(self.expert_size)
        shared = self.num_shared_experts * self.mlp_params(self.shared_expert_size)
        gates = self.hidden_size * (self.num_experts + (1 if self.shared_expert_gate else 0))
        return experts + shared + gates

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def total_params(self) -> int:
        """All weights (norm vectors included), the number a model card quotes."""
        return self._params(active=False)

    def active_params(self) -> int:
        """Weights one token uses (MoE: the routed experts it goes to), embeddings included."""
        return self._params(active=True)

    def _params(self, active: bool) -> int:
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        return self.num_layers * self.attention_params() + sum(self.layer_mlp_params(active)) + \
            self.embedding_params() + norms

    def matmul_params_per_token(self) -> int:
        """Weights that take part in a matmul for one token: active layers plus the LM head."""
        return self.num_layers * self.attention_params() + sum(self.layer_mlp_params(True)) + \
            self.vocab_size * self.hidden_size

    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair over all layers: QKᵀ and P·V."""
        return 2 * self.num_heads * (self.qk_head_dim + self.v_dim) * self.num_layers
