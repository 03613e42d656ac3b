"""A Gemma 3 GGUF written the way llama.cpp's converter writes one (its own tensor names, norm weights stored
as 1 + w, sliding window in the metadata) loads into the same weights and shape as the Hugging Face model."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from kvserve.model.loader import iter_weights, read_arch_config

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, INTERMEDIATE, VOCAB, WINDOW = 32, 2, 1, 16, 6, 48, 40, 8
# Hugging Face name suffix -> llama.cpp's Gemma 3 name suffix.
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _hf_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + n: (HIDDEN,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                               "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")}
        shapes |= {p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
                   p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                   p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _write_gguf(path: Path, weights: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(WINDOW)
    for name, array in weights.items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_NAMES[rest]}"
        # llama.cpp's converter stores Gemma's norms as 1 + w (ggml multiplies by the weight).
        writer.add_tensor(gguf_name, array + 1 if name.endswith("norm.weight") else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gemma3_gguf_loads_as_the_hugging_face_weights_and_shape(tmp_path: Path) -> None:
    weights = _hf_weights(np.random.default_rng(0))
    path = tmp_path / "tiny-gemma3.gguf"
    _write_gguf(path, weights)
    arch = read_arch_config(path)
    assert arch.architecture == "gemma3" and arch.head_dim == HEAD_DIM and arch.tie_word_embeddings
    assert arch.sliding_window == WINDOW and arch.sliding_layers == (0, 1, 2, 3, 4)  # every sixth is global
    assert arch.rope_theta == 1e6 and arch.rope_local_theta == 1e4 and arch.attention_scale == HEAD_DIM**-0.5
    assert arch.qk_norm and arch.layer_window(5) is None and arch.layer_window(4) == WINDOW
    loaded = dict(iter_weights(path, arch, torch.float32, show_progress=False))
    assert loaded.keys() == weights.keys()
    for name, expected in weights.items():
        torch.testing.assert_close(loaded[name], torch.from_numpy(expected), rtol=0, atol=1e-6, msg=name)
