"""Tensor names and shapes: llama.cpp's GGUF names and Mixtral's checkpoint names under the Hugging Face names
the model takes, the tensors each architecture has, and the shapes its configuration implies for them (checked
before anything loads)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from kvserve.config import ArchConfig
from kvserve.errors import ModelLoadError

# GGUF name (with {i} for the layer) -> Hugging Face name.
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


# Mixture of experts (llama.cpp's names). A stacked [n_expert, ...] ``*_exps`` tensor holds one Hugging Face
# tensor per expert ({e}); Mixtral's checkpoints spell theirs differently (canonical_name).
_GGUF_TO_HF_MOE = {
    **_GGUF_TO_HF,
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "blk.{i}.ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
}
# Gemma 3 has four norms per layer; llama.cpp's ffn_norm is its pre-feedforward norm.
_GEMMA3_GGUF_TO_HF = {
    **_GGUF_TO_HF,
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}


# Phi-3 keeps QKV and gate/up fused (llama.cpp's ffn_up holds both).
_PHI3_GGUF_TO_HF = {
    **_GGUF_TO_HF,
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",
}


def gguf_to_hf_name(name: str, architecture: str) -> str | None:
    names = (_GEMMA3_GGUF_TO_HF if architecture == "gemma3" else _PHI3_GGUF_TO_HF if architecture == "phi3"
             else _GGUF_TO_HF_MOE)
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        hf = names.get(f"blk.{{i}}.{rest}")
        return hf.format(i=layer, e="{e}") if hf is not None and layer.isdigit() else None
    return names.get(name)


# Mixtral's checkpoints: block_sparse_moe for mlp, and experts' w1 / w3 / w2 for gate / up / down.
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])|(gate))\.")
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def canonical_name(key: str) -> str:
    """A checkpoint tensor's name as ``weight_names`` spells it (Mixtral's MoE names as Qwen MoE's)."""
    def rename(m: re.Match[str]) -> str:
        return ".mlp.gate." if m[3] else f".mlp.experts.{m[1]}.{_MIXTRAL_PROJECTIONS[m[2]]}."
    return _MIXTRAL_EXPERT.sub(rename, key)


def _mlp_names(arch: ArchConfig, layer: int) -> list[str]:
    prefix = f"model.layers.{layer}.mlp."
    if arch.fused_projections:
        return [prefix + "gate_up_proj.weight", prefix + "down_proj.weight"]
    if not arch.is_moe_layer(layer):
        return [f"{prefix}{p}_proj.weight" for p in ("gate", "up", "down")]
    names = [prefix + "gate.weight"]
    # By projection, then expert: a GGUF file's stacked tensor is dequantised once for all its experts.
    names += [f"{prefix}experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down") for e in range(arch.num_experts)]
    if arch.num_shared_experts:
        names += [f"{prefix}shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
    if arch.shared_expert_gate:
        names.append(prefix + "shared_expert_gate.weight")
    return names


def weight_names(arch: ArchConfig) -> list[str]:
    """Every tensor ``iter_weights`` yields for this architecture, in load order."""
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        prefix = f"model.layers.{i}."
        names += [prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"]
        if arch.architecture == "gemma3":
            names += [prefix + "pre_feedforward_layernorm.weight", prefix + "post_feedforward_layernorm.weight"]
        projections = ("qkv", "o") if arch.fused_projections else ("q", "k", "v", "o")
        names += [f"{prefix}self_attn.{p}_proj.weight" for p in projections]
        if arch.qkv_bias:
            names += [f"{prefix}self_attn.{p}_proj.bias" for p in ("q", "k", "v")]
        if arch.qk_norm:
            names += [f"{prefix}self_attn.{p}_norm.weight" for p in ("q", "k")]
        names += _mlp_names(arch, i)
    names.append("model.norm.weight")
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _expected_shape(name: str, arch: ArchConfig) -> tuple[int, ...]:
    """The shape the model takes a tensor in (Hugging Face's [out_features, in_features]). The embedding's and
    output projection's rows are the vocabulary's size at least: a file may pad them, never hold fewer."""
    hidden = arch.hidden_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (arch.vocab_size, hidden)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (arch.head_dim,)
    if name.endswith("norm.weight"):
        return (hidden,)
    module, kind = name.rsplit(".", 2)[-2:]
    attention = {"q_proj": arch.q_size, "k_proj": arch.kv_size, "v_proj": arch.kv_size,
                 "qkv_proj": arch.q_size + 2 * arch.kv_size}
    if module in attention:
        return (attention[module], hidden) if kind == "weight" else (attention[module],)
    if module == "o_proj":
        return (hidden, arch.q_size)
    if module == "gate":  # a mixture of experts' router
        return (arch.num_experts, hidden)
    if module == "shared_expert_gate":
        return (1, hidden)
    if module == "gate_up_proj":
        return (2 * arch.intermediate_size, hidden)
    width = arch.intermediate_size  # experts': their tensors' own (check_shapes checks their hidden side only)
    return (hidden, width) if module == "down_proj" else (width, hidden)


def check_shapes(source: Path, shapes: Mapping[str, tuple[int, ...]], arch: ArchConfig) -> None:
    """Refuse a file whose tensors do not have the shapes its configuration implies, before anything loads (a
    mismatch would otherwise surface at the first forward, ending the engine)."""
    wrong = []
    for name, shape in shapes.items():
        expected = _expected_shape(name, arch)
        padded_rows = name in ("model.embed_tokens.weight", "lm_head.weight") and len(shape) == 2
        if padded_rows:
            fits = shape[0] >= expected[0] and shape[1:] == expected[1:]
        elif ".experts." in name or ".shared_expert." in name:  # widths as llama.cpp infers them: the tensors'
            fits = len(shape) == 2 and (shape[0] if name.endswith("down_proj.weight") else shape[1]) == arch.hidden_size
        elif name.endswith("shared_expert_gate.weight"):  # llama.cpp writes it as a vector
            fits = shape in ((1, arch.hidden_size), (arch.hidden_size,))
        else:
            fits = shape == expected
        if not fits:
            wrong.append(f"{name} is {list(shape)}, expected {list(expected)}"
                         + (" (rows at least)" if padded_rows else ""))
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise ModelLoadError(f"{source}: tensor shapes do not match its configuration: {'; '.join(wrong[:3])}{more}")
