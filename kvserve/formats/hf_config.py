"""A Hugging Face checkpoint's JSON files, and the ``ArchConfig`` its ``config.json`` describes (no torch).

Reads llama-like families, dense and mixture-of-experts (Mixtral, Qwen MoE), and, for the cost model,
the multi-head-latent-attention (DeepSeek-V2/V3) fields too. What the engine can run is checked by the
loader.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvserve.arch import ArchConfig, RopeScaling
from kvserve.errors import ModelLoadError


def read_hf_json(path: Path) -> dict[str, Any]:
    """One of a checkpoint's JSON files (``config.json``, ``generation_config.json``,
    ``tokenizer_config.json``) as a dict; ``ModelLoadError`` (naming the file) when it cannot be read."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope block: ``rope_parameters`` (newer transformers) or ``rope_scaling``; {} when neither. For
    Gemma 3 in the newer form, its full-attention layers' block (its sliding layers have their own)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return params.get("full_attention") or params if isinstance(params, dict) else {}


def rope_type(params: dict[str, Any]) -> str:
    """A rope block's kind (``default`` when it stretches nothing)."""
    return str(params.get("rope_type") or params.get("type") or "default")


def rope_scaling(params: dict[str, Any], max_position_embeddings: int,
                 original: int | None = None) -> RopeScaling | None:
    """The stretch of a rope block of a kind the engine computes (linear, llama3, yarn, longrope); None for any
    other, which the loader refuses (the cost model reads such configs too). Absent fields take transformers'
    defaults (the original context: the config's top-level ``original`` (Phi-3's), else
    ``max_position_embeddings``; the factor: the ratio of the two)."""
    kind = rope_type(params)
    if kind in ("longrope", "su"):
        context = int(original or params.get("original_max_position_embeddings") or max_position_embeddings)
        factor = float(params.get("factor") or max_position_embeddings / context)
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(context))
        return RopeScaling("longrope", factor=factor, original_max_position_embeddings=context,
                           freq_factors=tuple(float(f) for f in params["short_factor"]),
                           attention_factor=float(attention))
    if kind == "linear":
        return RopeScaling("linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", factor=float(params["factor"]),
                           low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                           original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    if kind == "yarn":
        original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
        factor = params.get("factor")
        return RopeScaling("yarn", factor=float(factor if factor is not None else max_position_embeddings / original),
                           original_max_position_embeddings=original,
                           beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                           attention_factor=float(params.get("attention_factor") or 0.0),
                           mscale=float(params.get("mscale") or 0.0),
                           mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                           truncate=bool(params.get("truncate", True)))
    return None


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's sliding layers, its two rope bases and its attention scale, in the config's old and new forms."""
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if not layer_types:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    rope = cfg.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    return {
        "architecture": "gemma3",
        "sliding_window": int(cfg.get("sliding_window") or 0),
        "sliding_layers": tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention"),
        "rope_theta": float(full.get("rope_theta") or cfg.get("rope_theta") or 1000000.0),
        "rope_local_theta": float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
        "final_logit_softcapping": float(cfg.get("final_logit_softcapping") or 0.0),
        "qk_norm": True,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }


def _rotary_dim(cfg: dict[str, Any], default_head_dim: int) -> int:
    """The dimensions of each head that rotate (``partial_rotary_factor``, top-level or in the rope block, as
    transformers reads it); 0: all."""
    factor = cfg.get("partial_rotary_factor") or rope_parameters(cfg).get("partial_rotary_factor") or 1.0
    if float(factor) >= 1.0:
        return 0
    return int(int(cfg.get("head_dim") or default_head_dim) * float(factor))


def _phi3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's sliding window, over every layer where it is shorter than the context."""
    window, num_layers = cfg.get("sliding_window"), int(cfg["num_hidden_layers"])
    if not window or int(window) >= int(cfg.get("max_position_embeddings", 2048)):
        return {}
    return {"sliding_window": int(window), "sliding_layers": tuple(range(num_layers))}


def _smollm3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3's layers without rotary (``no_rope_layers`` marks each layer 1 where it rotates, else every
    ``no_rope_layer_interval``-th, 4, goes without), its sliding-window layers where ``use_sliding_window``
    (``layer_types``, by default the layers without rotary) and its tied embeddings, as transformers'
    SmolLM3Config reads them."""
    num_layers = int(cfg["num_hidden_layers"])
    marks = cfg.get("no_rope_layers")
    if marks is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        marks = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(marks) != num_layers:
        raise ValueError(f"no_rope_layers has {len(marks)} entries for {num_layers} layers")
    no_rope = tuple(i for i, rotates in enumerate(marks) if not rotates)
    fields: dict[str, Any] = {"no_rope_layers": no_rope,
                              "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") and window:
        types = cfg.get("layer_types") or ["sliding_attention" if i in no_rope else "full_attention"
                                           for i in range(num_layers)]
        fields.update(sliding_window=int(window),
                      sliding_layers=tuple(i for i, kind in enumerate(types) if kind == "sliding_attention"))
    return fields


def arch_from_hf_config(cfg: dict[str, Any], source: Path) -> ArchConfig:
    """The ``ArchConfig`` of a parsed ``config.json`` read from ``source`` (named in errors)."""
    model_type = str(cfg.get("model_type") or "")
    try:
        family = (_gemma3_fields(cfg) if model_type in ("gemma3", "gemma3_text")
                  else _smollm3_fields(cfg) if model_type == "smollm3"
                  else _phi3_fields(cfg) if model_type == "phi3" else {})
        hidden_size = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [eos]
        shared_size = int(cfg.get("shared_expert_intermediate_size") or 0)
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        rope = rope_parameters(cfg)
        if model_type == "phi3" and rope_type(rope) == "yarn":  # Phi3Config reads su and yarn as longrope
            rope = {**rope, "rope_type": "longrope"}
        scaling = rope_scaling(rope, max_positions, cfg.get("original_max_position_embeddings"))
        fields: dict[str, Any] = dict(
            architecture=model_type,
            name=model_type or Path(source).parent.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden_size // num_heads),
            max_position_embeddings=scaling.served_context(max_positions) if scaling else max_positions,
            rope_theta=float(cfg.get("rope_theta") or rope_parameters(cfg).get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2-MoE's configs name their QKV bias qkv_bias (true when absent, as in the original checkpoints).
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
            or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rotary_dim=_rotary_dim(cfg, hidden_size // num_heads),
            fused_projections=model_type == "phi3",
            # Granite's scalars, absent ones as transformers' GraniteConfig defaults them (attention's: 1)
            embedding_multiplier=float(cfg.get("embedding_multiplier") or 1.0),
            residual_multiplier=float(cfg.get("residual_multiplier") or 1.0),
            logits_scaling=float(cfg.get("logits_scaling") or 1.0),
            attention_multiplier=float(cfg.get("attention_multiplier", 1.0)) if model_type == "granite" else 0.0,
            num_experts=int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
            num_experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            # Qwen2-MoE has one shared expert of its own size, gated; DeepSeek n_shared_experts of the routed size.
            num_shared_experts=int(cfg.get("n_shared_experts") or (1 if shared_size else 0)),
            shared_expert_intermediate_size=shared_size,
            shared_expert_gate=model_type == "qwen2_moe" and shared_size > 0,
            # Mixtral always renormalises its top-k (its config has no switch).
            norm_topk_prob=model_type == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
            num_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(sorted(int(i) for i in cfg.get("mlp_only_layers") or ())),
            kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or 0),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        )
        return ArchConfig(**{**fields, **family})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{source}: missing or bad field {e}") from None
