"""Tiny random-weight models for tests.

- ``make_tiny_model``: a transformers checkpoint directory (safetensors, float32) with the SmolLM2
  tokenizer, for any supported family, dense (``FAMILIES``) or mixture of experts (``MOE_FAMILIES``);
  compare kvserve against transformers on it.
- ``make_tiny_gguf``: a small GGUF written the way llama.cpp writes one (Q/K rows permuted for the
  llama family), optionally quantised; no tokenizer metadata.
- ``gguf_from_tiny_model``: the GGUF llama.cpp's converter would write from a tiny (MoE) checkpoint
  directory, with the SmolLM2 tokenizer's metadata, so the engine runs it as it runs the directory.
- ``with_renamed_tokens``: a copy of a model directory whose vocabulary spells some of SmolLM2's unused
  special tokens as another family's markers (``<think>``, ``[TOOL_CALLS]``), special or not.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.model.loader import resolve_model_path
from kvserve.tokenizer import Tokenizer

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # make_tiny_model also builds gemma3, smollm3 and granite
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")

TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
_ROPE_THETA = {"llama": 10000.0, "mistral": 1000000.0, "qwen2": 1000000.0, "qwen3": 50000.0, "smollm3": 2000000.0,
               "granite": 10000000.0, "phi3": 10000.0, "gemma3": 1000000.0, "mixtral": 1000000.0, "qwen2_moe": 1000000.0,
               "qwen3_moe": 50000.0}
# Mixture of experts: 8 experts, 2 per token, on three layers; the dense layers keep TINY_SHAPE's MLP.
TINY_MOE_SHAPE = {"num_hidden_layers": 3, "num_experts_per_tok": 2}
TINY_NUM_EXPERTS = 8
TINY_EXPERT_SIZE = 32
# Gemma 3's window, shorter than most test prompts so the window hides keys.
TINY_GEMMA3_WINDOW = 8


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    """The default model's tokenizer (built once per test session)."""
    return Tokenizer.from_model_path(resolve_model_path(None))


def _hf_config(family: str, tie: bool, vocab_size: int, bos_id: int | None, eos_id: int | None,
               **overrides: object):
    import transformers

    common = dict(
        TINY_SHAPE,
        **(TINY_MOE_SHAPE if family in MOE_FAMILIES else {}),
        vocab_size=vocab_size,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
        rope_theta=_ROPE_THETA[family],
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    common.update(overrides)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        # An explicit head_dim unlike hidden_size // num_heads (16), as real Qwen3 checkpoints have.
        return transformers.Qwen3Config(**common, head_dim=32)
    if family == "phi3":  # Phi-4-mini's shape: half of each head rotating, LongRoPE past a short original context
        head_dim = int(common["hidden_size"]) // int(common["num_attention_heads"])  # type: ignore[call-overload]
        factors = [1.0 + 0.5 * i for i in range(head_dim // 4)]
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": factors, "long_factor": [2 * f for f in factors]}
        return transformers.Phi3Config(**{"original_max_position_embeddings": 128, "rope_parameters": rope,
                                          "pad_token_id": None, **common})
    if family == "granite":  # its scalars far from 1, so that leaving one out changes every logit
        return transformers.GraniteConfig(**{"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                             "attention_multiplier": 0.09, "logits_scaling": 8.0, **common})
    if family == "smollm3":  # four layers: the fourth has no rotary (NoPE), as every fourth in SmolLM3
        return transformers.SmolLM3Config(**{**common, "num_hidden_layers": 4, "pad_token_id": None})
    if family == "mixtral":  # its intermediate_size is the experts'; every layer routes, top-k renormalised
        return transformers.MixtralConfig(**dict(common, intermediate_size=TINY_EXPERT_SIZE),
                                          num_local_experts=TINY_NUM_EXPERTS, sliding_window=None)
    moe = dict(num_experts=TINY_NUM_EXPERTS, moe_intermediate_size=TINY_EXPERT_SIZE)
    if family == "qwen2_moe":  # a gated shared expert, raw top-k weights, layer 1 dense
        return transformers.Qwen2MoeConfig(**{"mlp_only_layers": [1], **common}, **moe,
                                           shared_expert_intermediate_size=48, norm_topk_prob=False)
    if family == "qwen3_moe":  # QK-norm, renormalised top-k
        return transformers.Qwen3MoeConfig(**{"norm_topk_prob": True, **common}, **moe, head_dim=32)
    if family == "gemma3":
        # Three layers, two of them sliding; a query_pre_attn_scalar unlike head_dim, as the larger Gemmas have.
        common.update(num_hidden_layers=3, pad_token_id=0)
        return transformers.Gemma3TextConfig(
            **common, head_dim=32, query_pre_attn_scalar=24, sliding_window=TINY_GEMMA3_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES + MOE_FAMILIES} or gemma3")


def make_tiny_model(tmp_dir: Path, family: str, *, tie: bool = True, seed: int = 0, **config: object) -> Path:
    """Build, save and return ``tmp_dir/tiny-{family}-{tied|untied}-{seed}`` (plus ``-{key}{value}`` for
    each ``config`` override of the transformers config).

    hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128, vocab = SmolLM2's (49152), so the
    SmolLM2 tokenizer and chat template (saved alongside) work with it. Norm weights and biases are
    randomised too (transformers initialises them to 1 and 0), so a model that skips a norm or a
    bias, or swaps two of them, gives different logits. Mixture-of-experts families get 3 layers of
    8 experts of 32, 2 per token (``TINY_MOE_SHAPE``), with routers and experts scaled up so that
    tokens prefer experts clearly and which experts run changes the output (``_sharpen_experts``).
    """
    import transformers

    tokenizer = smollm2_tokenizer()
    suffix = "".join(f"-{key}{value}" for key, value in sorted(config.items())).replace(" ", "")
    model_dir = Path(tmp_dir) / f"tiny-{family}-{'tied' if tie else 'untied'}-{seed}{suffix}"
    eos_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    hf_config = _hf_config(family, tie, tokenizer.vocab_size, tokenizer.bos_token_id, eos_id, **config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
            elif name.endswith("self_attn.qkv_proj.weight"):
                # Phi-3: queries and keys large enough that the attention, and so how positions rotate, shows in
                # the logprobs (with the usual tiny weights every score is near zero and attention near uniform).
                heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
                head_dim = param.shape[0] // (heads + 2 * kv_heads)
                param[: (heads + kv_heads) * head_dim].mul_(6.0)
            else:
                _sharpen_experts(name, param, generator)
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save(model_dir)
    return model_dir


def with_renamed_tokens(model_dir: Path, target: Path, renamed: dict[str, str], special: bool) -> Path:
    """A copy of ``model_dir`` at ``target`` whose tokenizer spells each of ``renamed``'s SmolLM2 special tokens
    (``<gh_stars>``, ``<issue_start>``, ...: unused in its chat) as its new text, ``special`` or an ordinary
    added token: one token of a family's markers, as that family's vocabulary holds it."""
    shutil.copytree(model_dir, target)
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    for added in tokenizer["added_tokens"]:
        if added["content"] in renamed:
            added["content"], added["special"] = renamed[added["content"]], special
    vocab = tokenizer["model"]["vocab"]
    for old, new in renamed.items():
        vocab[new] = vocab.pop(old)
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((target / "tokenizer_config.json").read_text())
    for added in (config.get("added_tokens_decoder") or {}).values():
        if added.get("content") in renamed:
            added["content"], added["special"] = renamed[added["content"]], special
    config["additional_special_tokens"] = [renamed.get(t, t) if special else t
                                           for t in config.get("additional_special_tokens") or []
                                           if special or t not in renamed]
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def _sharpen_experts(name: str, param: torch.nn.Parameter, generator: torch.Generator) -> None:
    """transformers' init (std 0.02) gives a router near-uniform probabilities and experts whose output is
    lost in the residual: a wrong routing would go unnoticed. Routers get logits of a few units (clear
    preferences, no near-ties for rounding to flip), experts' and shared experts' weights a std of 0.15."""
    # In memory (transformers 5): mlp.gate.weight (the router, all three families), mlp.experts.gate_up_proj
    # and down_proj ([num_experts, ...]), mlp.shared_expert.*, mlp.shared_expert_gate.weight.
    if name.endswith("mlp.gate.weight"):
        param.copy_(torch.randn(param.shape, generator=generator) * 4 / param.shape[-1] ** 0.5)
    elif ".mlp.experts." in name or ".mlp.shared_expert" in name:
        param.copy_(0.15 * torch.randn(param.shape, generator=generator))


# ---- GGUF ----------------------------------------------------------------------------------------


# Hugging Face name -> GGUF name, written out here independently of kvserve's own table.
def _gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    suffix = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3's fused ones
        "mlp.gate_up_proj.weight": "ffn_up.weight",
    }[rest]
    return f"blk.{layer}.{suffix}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows of llama-family models."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tiny_gguf_weights(
    family: str,
    *,
    tie: bool,
    seed: int,
    hidden: int,
    intermediate: int,
    vocab: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face names and orientation."""
    rng = np.random.default_rng(seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_size, hidden),
            p + "self_attn.k_proj.weight": (kv_size, hidden),
            p + "self_attn.v_proj.weight": (kv_size, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_size),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        }
        if family == "qwen2":
            shapes |= {
                p + f"self_attn.{x}_proj.bias": (n,)
                for x, n in (("q", q_size), ("k", kv_size), ("v", kv_size))
            }
        if family == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
    shapes["model.norm.weight"] = (hidden,)
    if not tie:
        shapes["lm_head.weight"] = (vocab, hidden)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


# Byte offsets of the fp16 scale fields inside one block (ggml-common.h), for ``raw_matrices``.
_FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


def _random_blocks(rng: np.random.Generator, qtype: str, rows: int, row_bytes: int) -> np.ndarray:
    """Random quantised rows whose fp16 scales are small finite numbers (random bytes make inf/NaN)."""
    import gguf

    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, size=(rows * row_bytes // type_size, type_size), dtype=np.uint8)
    for offset in _FP16_FIELDS[qtype]:
        scales = rng.uniform(0.001, 0.1, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, row_bytes)


def make_tiny_gguf(
    path: Path,
    family: str = "llama",
    *,
    qtype: str = "F32",
    tie: bool = True,
    seed: int = 0,
    hidden: int = 256,
    intermediate: int = 512,
    vocab: int = 64,
    num_layers: int = 1,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    raw_matrices: bool = False,
    general_name: str = "tiny",
    extra: Callable[[Any], None] | None = None,
) -> dict[str, np.ndarray]:
    """Write a GGUF the way llama.cpp would and return the weights it holds (HF names, float32).

    ``qtype`` quantises the 2-D weights (norms and biases stay F32, as llama.cpp keeps them) with
    ``gguf.quants.quantize``. With ``raw_matrices`` the 2-D weights are random bytes of type
    ``qtype`` instead (for K-quants, which gguf cannot quantise; types in ``_FP16_FIELDS``); the
    returned arrays are then those bytes, shaped [rows, bytes_per_row], in GGUF row order. ``extra(writer)``
    adds metadata or tensors of its own before the file is written.
    """
    import gguf

    arch = "llama" if family == "mistral" else family
    qt = gguf.GGMLQuantizationType[qtype]
    head_dim = hidden // num_heads
    weights = tiny_gguf_weights(
        family,
        tie=tie,
        seed=seed,
        hidden=hidden,
        intermediate=intermediate,
        vocab=vocab,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    rng = np.random.default_rng(seed + 1)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(general_name)
    writer.add_block_count(num_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    for name, value in weights.items():
        data = value
        if family in ("llama", "mistral") and name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, num_heads)
        elif family in ("llama", "mistral") and name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, num_kv_heads)
        if data.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            if raw_matrices:
                block_size, type_size = gguf.GGML_QUANT_SIZES[qt]
                row_bytes = data.shape[1] // block_size * type_size
                data = _random_blocks(rng, qtype, data.shape[0], row_bytes)
                weights[name] = data
            else:
                data = gguf.quants.quantize(data, qt)
            writer.add_tensor(_gguf_name(name), data, raw_dtype=qt)
        else:
            writer.add_tensor(_gguf_name(name), data)
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


# ---- GGUF from a tiny checkpoint -------------------------------------------------------------------

# Hugging Face model_type -> llama.cpp's GGUF architecture (Mixtral is written as "llama").
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "smollm3": "smollm3",
              "granite": "granite", "phi3": "phi3", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_MOE_SUFFIXES = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# An expert's projection (Qwen MoE and Mixtral spellings) -> the stacked tensor it goes into.
_EXPERT_PROJECTIONS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                       "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _tiny_model_gguf_tensors(tensors: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """Checkpoint tensors under llama.cpp's names, experts stacked [num_experts, ...] per layer and projection."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    permuted = config["model_type"] in ("llama", "mistral", "mixtral", "smollm3", "granite")
    for name, value in tensors.items():
        if permuted and name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, config["num_attention_heads"])
        elif permuted and name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, config["num_key_value_heads"])
        if ".experts." in name:  # model.layers.{i}.{mlp|block_sparse_moe}.experts.{e}.{projection}.weight
            parts = name.split(".")
            stacked = f"blk.{parts[2]}.{_EXPERT_PROJECTIONS[parts[-2]]}.weight"
            experts.setdefault(stacked, {})[int(parts[-3])] = value
            continue
        rest = name.removeprefix("model.layers.").split(".", 1)[-1]
        moe = _MOE_SUFFIXES.get(rest)
        out[f"blk.{name.split('.')[2]}.{moe}" if moe else _gguf_name(name)] = value
    for stacked, by_expert in experts.items():
        out[stacked] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def gguf_from_tiny_model(model_dir: Path, path: Path, vector_shared_gate: bool = False) -> Path:
    """Write the F32 GGUF llama.cpp's convert_hf_to_gguf.py would make of a tiny checkpoint directory
    (dense or mixture of experts; Q/K rows permuted for the llama family, experts stacked), with the
    SmolLM2 GGUF's tokenizer metadata so that the engine can run it. ``vector_shared_gate``: a shared
    expert's gate written as a vector, as llama.cpp's converter squeezed it. Returns ``path``."""
    import json

    import gguf
    from safetensors.numpy import load_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    writer = gguf.GGUFWriter(str(path), _GGUF_ARCH[config["model_type"]])
    writer.add_name(f"tiny {config['model_type']}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    _add_yarn(writer, config["rope_parameters"])
    if config["model_type"] == "phi3":  # as llama.cpp's converter writes Phi-3: the rotating dimensions, LongRoPE
        _add_phi3(writer, config)
    if config["model_type"] == "granite":  # its scalars, as llama.cpp's converter writes them
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    num_experts = config.get("num_local_experts") or config.get("num_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    _add_smollm2_tokenizer(writer)
    for name, value in _tiny_model_gguf_tensors(tensors, config).items():
        if vector_shared_gate and name.endswith("ffn_gate_inp_shexp.weight"):
            value = value.reshape(-1)
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_phi3(writer, config: dict) -> None:
    rope = config["rope_parameters"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    if rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def _add_yarn(writer, rope: dict) -> None:
    """A YaRN block's keys, as llama.cpp's converter writes them (``attention_factor`` as yarn_attn_factor)."""
    import gguf

    if rope.get("rope_type") != "yarn":
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for name, add in (("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                      ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                      ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
        if rope.get(name) is not None:
            add(rope[name])


def _add_smollm2_tokenizer(writer) -> None:
    """The default model's GGUF tokenizer metadata (byte-level BPE), as a converter would write it."""
    from kvserve.formats.gguf import read_gguf_header

    meta = read_gguf_header(resolve_model_path(None)).metadata
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
