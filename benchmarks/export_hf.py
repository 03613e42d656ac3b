"""Write the default GGUF model as a Hugging Face directory (for peers that need one, e.g. vLLM).

    python benchmarks/export_hf.py OUT_DIR [--model GGUF] [--dtype bfloat16]

Weights come from kvserve's own loader (dequantised, Q/K rotary permutation undone), so every engine
measured against kvserve runs the very same tensors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve.model.loader import iter_weights, read_arch_config, resolve_model_path
from kvserve.tokenizer import Tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = resolve_model_path(args.model)
    arch = read_arch_config(path)
    if arch.architecture not in ("llama", "mistral"):
        raise SystemExit(f"only the llama family is exported here, not {arch.architecture}")
    dtype = getattr(torch, args.dtype)
    tensors = {name: t.contiguous() for name, t in iter_weights(path, arch, dtype, show_progress=False)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = Tokenizer.from_model_path(path)
    tokenizer.save(out)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
        "max_position_embeddings": arch.max_position_embeddings, "rope_theta": arch.rope_theta,
        "rms_norm_eps": arch.rms_norm_eps, "tie_word_embeddings": arch.tie_word_embeddings,
        "hidden_act": "silu", "torch_dtype": args.dtype, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": list(tokenizer.eos_token_ids) if len(tokenizer.eos_token_ids) > 1
        else tokenizer.eos_token_ids[0],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    print(f"wrote {out} ({len(tensors)} tensors, {args.dtype})")


if __name__ == "__main__":
    main()
