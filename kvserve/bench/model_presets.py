"""Model descriptions for the cost model: published presets, or a model on disk read from metadata only.

``load_arch`` takes a preset name (``PRESETS``), a GGUF file or a Hugging Face directory /
``config.json``; no weights are loaded (the readers are ``kvserve.formats``).
"""

from __future__ import annotations

from pathlib import Path

from kvserve.arch import ArchConfig
from kvserve.errors import InvalidRequest, KVServeError
from kvserve.formats.gguf import arch_from_gguf, read_gguf_header
from kvserve.formats.hf_config import arch_from_hf_config, read_hf_json

# Shapes from each model's published config.json.
PRESETS: dict[str, ArchConfig] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": ArchConfig("llama", name="smollm2-135m", vocab_size=49152, hidden_size=576,
                               intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                               tie_word_embeddings=True, max_position_embeddings=8192),
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": ArchConfig("llama", name="llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192),
    # meta-llama/Meta-Llama-3-70B
    "llama3-70b": ArchConfig("llama", name="llama3-70b", vocab_size=128256, hidden_size=8192,
                             intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                             max_position_embeddings=8192),
    # Qwen/Qwen3-30B-A3B (MoE, 128 experts, 8 active)
    "qwen3-30b-a3b": ArchConfig("qwen3_moe", name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048,
                                intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                                max_position_embeddings=40960, num_experts=128, num_experts_per_token=8,
                                moe_intermediate_size=768),
    # deepseek-ai/DeepSeek-V3 (671B total, 37B active; the 14B multi-token-prediction module is not counted)
    "deepseek-v3": ArchConfig("deepseek_v3", name="deepseek-v3", vocab_size=129280, hidden_size=7168,
                              intermediate_size=18432, num_layers=61, num_heads=128, num_kv_heads=128, head_dim=128,
                              max_position_embeddings=163840, num_experts=256, num_experts_per_token=8,
                              moe_intermediate_size=2048, num_shared_experts=1, num_dense_layers=3,
                              kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                              v_head_dim=128),
}


def load_arch(spec: str | Path) -> ArchConfig:
    """A preset name, a Hugging Face directory / ``config.json``, or a GGUF file / directory with one.

    Raises ``InvalidRequest`` (param ``model_config``) for anything it cannot read.
    """
    key = str(spec).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(spec).expanduser()
    try:
        if path.is_dir():
            if (path / "config.json").is_file():
                return _from_hf_config(path / "config.json")
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return arch_from_gguf(read_gguf_header(ggufs[0]))
            raise InvalidRequest(f"{path}: expected a config.json or exactly one .gguf file", "model_config")
        if path.is_file():
            if path.suffix.lower() == ".gguf":
                return arch_from_gguf(read_gguf_header(path))
            return _from_hf_config(path)
    except InvalidRequest:
        raise
    except KVServeError as exc:
        raise InvalidRequest(f"cannot read a model shape from {path}: {exc}", "model_config") from None
    raise InvalidRequest(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a path that exists", "model_config")


def _from_hf_config(path: Path) -> ArchConfig:
    return arch_from_hf_config(read_hf_json(path), path)
