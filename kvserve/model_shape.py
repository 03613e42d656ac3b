"""A model's shape for the cost model: the counts and sizes FLOPs and bytes per token depend on.

``ModelShape`` comes from an ``ArchConfig`` (``as_shape``), a preset (``PRESETS``: shapes from each
model's published config.json) or a model on disk, a GGUF file or a Hugging Face directory
(``load_model_shape``), read from metadata only: no weights are loaded.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.config import ArchConfig
from kvserve.errors import InvalidRequest

# --------------------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the cost model needs to know about a model: ``ArchConfig`` plus MoE and MLA details.

    Dense models leave the MoE / MLA fields at zero. For MoE, ``num_dense_layers`` leading layers use a
    dense MLP of ``intermediate_size``; the rest route each token to ``num_experts_per_token`` of
    ``num_experts`` experts of ``moe_intermediate_size`` plus ``num_shared_experts`` always-on ones.
    MLA (DeepSeek-V2/V3) caches one latent of ``kv_lora_rank + qk_rope_head_dim`` per token per layer.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 4096
    # Mixture of experts
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0  # 0: intermediate_size
    num_shared_experts: int = 0
    num_dense_layers: int = 0
    # Multi-head latent attention (0: ordinary multi-head / grouped-query attention)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    @classmethod
    def from_arch(cls, arch: ArchConfig, name: str = "") -> ModelShape:
        return cls(
            name=name or arch.architecture,
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            intermediate_size=arch.intermediate_size,
            num_layers=arch.num_layers,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            tie_word_embeddings=arch.tie_word_embeddings,
            qkv_bias=arch.qkv_bias,
            max_position_embeddings=arch.max_position_embeddings,
            num_experts=arch.num_experts,
            num_experts_per_token=arch.num_experts_per_token,
        )

    # ---- derived sizes -------------------------------------------------------------------------

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
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    def attention_params(self) -> int:
        """Weights of one layer's attention projections."""
        h, n = self.hidden_size, self.num_heads
        if self.is_mla:
            q = (h * self.q_lora_rank + self.q_lora_rank * n * self.qk_head_dim) if self.q_lora_rank else (
                h * n * self.qk_head_dim)
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * n * (
                self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + n * self.v_head_dim * h
        q, kv = n * self.head_dim, self.num_kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return h * (q + 2 * kv) + q * h + bias

    def mlp_params(self, intermediate: int) -> int:
        """A gated (SwiGLU) MLP: gate, up and down projections."""
        return 3 * self.hidden_size * intermediate

    def layer_mlp_params(self, active: bool) -> list[int]:
        """MLP weights per layer: all of them, or the ones one token uses (``active``)."""
        out = []
        for layer in range(self.num_layers):
            if not self.is_moe or layer < self.num_dense_layers:
                out.append(self.mlp_params(self.intermediate_size))
                continue
            routed = self.num_experts_per_token if active else self.num_experts
            experts = (routed + self.num_shared_experts) * self.mlp_params(self.expert_size)
            out.append(experts + self.hidden_size * self.num_experts)  # + the router
        return out

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def total_params(self) -> int:
        """All weights (norm vectors included), the number a model card quotes."""
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        return self.num_layers * self.attention_params() + sum(self.layer_mlp_params(False)) + \
            self.embedding_params() + norms

    def active_params(self) -> int:
        """Weights one token uses (MoE: the routed experts it goes to), embeddings included."""
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        return self.num_layers * self.attention_params() + sum(self.layer_mlp_params(True)) + \
            self.embedding_params() + norms

    def matmul_params_per_token(self) -> int:
        """Weights that take part in a matmul for one token: active layers plus the LM head."""
        return self.num_layers * self.attention_params() + sum(self.layer_mlp_params(True)) + \
            self.vocab_size * self.hidden_size

    def kv_elements_per_token(self) -> int:
        """Cached values per token across all layers (K and V; MLA: the latent and the rope key)."""
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: float = 2) -> float:
        return self.kv_elements_per_token() * dtype_bytes

    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair over all layers: QKᵀ and P·V."""
        return 2 * self.num_heads * (self.qk_head_dim + self.v_dim) * self.num_layers


def as_shape(model: ModelShape | ArchConfig) -> ModelShape:
    return model if isinstance(model, ModelShape) else ModelShape.from_arch(model)


# --------------------------------------------------------------------------------------------------
# Presets. Shapes from each model's published config.json.
# --------------------------------------------------------------------------------------------------

PRESETS: dict[str, ModelShape] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": ModelShape("smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                               num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                               tie_word_embeddings=True, max_position_embeddings=8192),
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": ModelShape("llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192),
    # meta-llama/Meta-Llama-3-70B
    "llama3-70b": ModelShape("llama3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                             num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=8192),
    # Qwen/Qwen3-30B-A3B (MoE, 128 experts, 8 active)
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                                max_position_embeddings=40960, num_experts=128, num_experts_per_token=8,
                                moe_intermediate_size=768),
    # deepseek-ai/DeepSeek-V3 (671B total, 37B active; the 14B multi-token-prediction module is not counted)
    "deepseek-v3": ModelShape("deepseek-v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                              num_layers=61, num_heads=128, num_kv_heads=128, head_dim=128,
                              max_position_embeddings=163840, num_experts=256, num_experts_per_token=8,
                              moe_intermediate_size=2048, num_shared_experts=1, num_dense_layers=3,
                              kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                              v_head_dim=128),
}


def load_model_shape(spec: str | Path) -> ModelShape:
    """A preset name, a Hugging Face directory / ``config.json``, or a GGUF file / directory with one."""
    key = str(spec).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return shape_from_hf_config(path / "config.json")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return shape_from_gguf(ggufs[0])
        raise InvalidRequest(f"{path}: expected a config.json or exactly one .gguf file", "model_config")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return shape_from_gguf(path)
        return shape_from_hf_config(path)
    raise InvalidRequest(f"{spec!r} is neither a preset ({', '.join(PRESETS)}) nor a path that exists", "model_config")


def shape_from_hf_config(path: Path) -> ModelShape:
    """Read a Hugging Face ``config.json`` (llama-like, Mixtral, Qwen MoE, DeepSeek-V2/V3)."""
    try:
        cfg: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        shape = ModelShape(
            name=str(cfg.get("model_type") or Path(path).parent.name),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            num_experts=int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
            num_experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            num_shared_experts=int(cfg.get("n_shared_experts") or 0),
            num_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
            kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or 0),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(f"cannot read a model shape from {path}: {exc}", "model_config") from None
    return shape


def shape_from_gguf(path: Path) -> ModelShape:
    """Read the shape from a GGUF file's metadata (``{arch}.block_count`` and friends)."""
    meta, tensor_names = read_gguf_metadata(Path(path))
    arch = str(meta.get("general.architecture", "llama"))

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    try:
        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        kv_heads = key("attention.head_count_kv", heads)
        vocab = key("vocab_size") or meta.get("tokenizer.ggml.tokens.count")
        return ModelShape(
            name=str(meta.get("general.name") or Path(path).stem),
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads if not isinstance(kv_heads, list) else max(kv_heads)),
            head_dim=int(key("attention.key_length", hidden // heads)),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            max_position_embeddings=int(key("context_length", 4096)),
            num_experts=int(key("expert_count", 0)),
            num_experts_per_token=int(key("expert_used_count", 0)),
            moe_intermediate_size=int(key("expert_feed_forward_length", 0)),
            num_shared_experts=int(key("expert_shared_count", 0)),
            num_dense_layers=int(key("leading_dense_block_count", 0)),
            kv_lora_rank=int(key("attention.kv_lora_rank", 0)),
            q_lora_rank=int(key("attention.q_lora_rank", 0)),
            qk_rope_head_dim=int(key("rope.dimension_count", 0)) if key("attention.kv_lora_rank") else 0,
        )
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{path}: GGUF metadata lacks the model shape ({exc})", "model_config") from None


# GGUF value types -> struct format (scalars); 8 = string, 9 = array.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_metadata(path: Path) -> tuple[dict[str, Any], set[str]]:
    """GGUF key/values and tensor names, without the tensors.

    A small parser of its own: ``gguf.GGUFReader`` builds a numpy view per vocabulary string and takes
    seconds on a 49k-token vocabulary. String arrays are skipped; their length is kept as ``KEY.count``.
    """
    with open(path, "rb") as f:
        data = f.read(min(path.stat().st_size, 64 << 20))  # metadata lives in the first few MB
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return data[pos - n:pos].decode("utf-8", errors="replace")

    def value(kind: int) -> Any:
        if kind in _GGUF_SCALARS:
            return take(_GGUF_SCALARS[kind])
        if kind == 8:
            return string()
        if kind == 9:
            item_kind, count = take("<I"), take("<Q")
            if item_kind == 8:
                for _ in range(count):
                    string()
                return _SkippedArray(count)
            return [value(item_kind) for _ in range(count)]
        raise InvalidRequest(f"{path}: unknown GGUF value type {kind}", "model_config")

    try:
        if data[:4] != b"GGUF":
            raise InvalidRequest(f"{path} is not a GGUF file", "model_config")
        pos = 4
        take("<I")  # version
        num_tensors, num_kv = take("<Q"), take("<Q")
        meta: dict[str, Any] = {}
        for _ in range(num_kv):
            name = string()
            item = value(take("<I"))
            if isinstance(item, _SkippedArray):
                meta[f"{name}.count"] = item.count
            else:
                meta[name] = item
        names = set()
        for _ in range(num_tensors):
            names.add(string())
            ndim = take("<I")
            pos += 8 * ndim + 4 + 8  # dims, type, offset
    except struct.error as exc:
        raise InvalidRequest(f"{path}: truncated GGUF header ({exc})", "model_config") from None
    return meta, names


@dataclass(frozen=True, slots=True)
class _SkippedArray:
    count: int
