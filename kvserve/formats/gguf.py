"""A GGUF file's header, parsed directly (no torch): metadata, tensor directory, the architecture.

``gguf.GGUFReader`` builds a numpy view per string, which is slow on a large vocabulary; this parser
decodes the strings straight from the mapped file (benchmarks/host_side_costs.py times both). The
loader, the tokenizer and the cost model all read GGUF files through ``read_gguf_header``;
``arch_from_gguf`` turns the metadata into an ``ArchConfig``.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.arch import ArchConfig, RopeScaling, yarn_magnitude
from kvserve.errors import ModelLoadError, UnsupportedModel

# --------------------------------------------------------------------------------------------------
# GGUF header
# --------------------------------------------------------------------------------------------------
#
# Layout (little-endian, versions 2 and 3):
#
#   "GGUF" | u32 version | u64 tensor_count | u64 kv_count
#   kv_count   x { string key | u32 value_type | value }
#   tensor_count x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset }
#   padding to `general.alignment` (default 32)            <- data_offset
#   tensor data; each tensor at data_offset + offset
#
# A string is u64 length + UTF-8 bytes; an array is u32 item_type + u64 count + items.
# `ne` lists dimensions innermost first (ne0 = row length), the reverse of torch's order.

_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(8, 13)
_NUMPY_TYPES: dict[int, Any] = {
    _UINT8: np.uint8,
    _INT8: np.int8,
    _UINT16: np.uint16,
    _INT16: np.int16,
    _UINT32: np.uint32,
    _INT32: np.int32,
    _FLOAT32: np.float32,
    _BOOL: np.bool_,
    _UINT64: np.uint64,
    _INT64: np.int64,
    _FLOAT64: np.float64,
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: [out_features, in_features] for a matrix
    ggml_type: int
    offset: int  # absolute byte offset in the file
    num_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    data_offset: int
    file_size: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Truncated(Exception):
    """The header claims more bytes than the file has."""


class _HeaderParser:
    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0

    def _need(self, num_bytes: int) -> None:
        if num_bytes < 0 or self.pos + num_bytes > self.size:
            raise _Truncated(f"needs {num_bytes} bytes at offset {self.pos}")

    def u32(self) -> int:
        self._need(4)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        self._need(8)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self) -> str:
        length = self.u64()
        self._need(length)
        start = self.pos
        self.pos += length
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        np_type = _NUMPY_TYPES.get(value_type)
        if np_type is None:
            raise ModelLoadError(f"unknown GGUF value type {value_type} at offset {self.pos}")
        item_size = np.dtype(np_type).itemsize
        self._need(item_size)
        value = np.frombuffer(self.buf, dtype=np_type, count=1, offset=self.pos)[0].item()
        self.pos += item_size
        return value

    def array(self) -> list[Any]:
        item_type = self.u32()
        count = self.u64()
        if item_type == _STRING:
            return self._string_array(count)
        np_type = _NUMPY_TYPES.get(item_type)
        if np_type is None:
            # Nested arrays: rare, parse item by item.
            return [self.value(item_type) for _ in range(count)]
        num_bytes = count * np.dtype(np_type).itemsize
        self._need(num_bytes)
        values = np.frombuffer(self.buf, dtype=np_type, count=count, offset=self.pos).tolist()
        self.pos += num_bytes
        return values

    def _string_array(self, count: int) -> list[str]:
        # The hot loop of the parser (vocabulary and merges): locals only, no method calls.
        self._need(count * 8)  # at least a length per item
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                raise _Truncated(f"string array item at offset {pos}")
            (length,) = unpack(buf, pos)
            pos += 8
            end = pos + length
            if end > size:
                raise _Truncated(f"string of {length} bytes at offset {pos}")
            append(buf[pos:end].decode("utf-8", errors="replace"))
            pos = end
        self.pos = pos
        return out


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table; check every tensor lies inside the file.

    Raises ``ModelLoadError`` (naming the file) for a truncated or corrupt file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelLoadError(f"{path} is not a GGUF file: only {size} bytes")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse_header(path, buf, size)
    except ModelLoadError:
        raise
    except _Truncated as e:
        raise ModelLoadError(
            f"GGUF file {path} is truncated or corrupt: header {e} past its end ({size} bytes)"
        ) from None
    except (struct.error, ValueError, OverflowError, IndexError, MemoryError) as e:
        raise ModelLoadError(f"GGUF file {path} is corrupt: {type(e).__name__}: {e}") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from None


def _parse_header(path: Path, buf: mmap.mmap, size: int) -> GGUFHeader:
    parser = _HeaderParser(buf, size)
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
    parser.pos = 4
    version = parser.u32()
    if version & 0xFFFF == 0:
        raise UnsupportedModel(f"{path} is a big-endian GGUF; only little-endian files are supported")
    if version not in (2, 3):
        raise UnsupportedModel(f"{path} is GGUF version {version}; versions 2 and 3 are supported")
    tensor_count = parser.u64()
    kv_count = parser.u64()
    if tensor_count > size or kv_count > size:
        raise ModelLoadError(f"GGUF file {path} is corrupt: {tensor_count} tensors, {kv_count} keys")

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = parser.string()
        metadata[key] = parser.value(parser.u32())

    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(tensor_count):
        name = parser.string()
        n_dims = parser.u32()
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelLoadError(f"GGUF file {path} is corrupt: tensor {name!r} has {n_dims} dimensions")
        dims = tuple(parser.u64() for _ in range(n_dims))  # ne0 first
        infos.append((name, dims, parser.u32(), parser.u64()))

    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"GGUF file {path} is corrupt: alignment {alignment}")
    data_offset = -(-parser.pos // alignment) * alignment

    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, ggml_type, rel_offset in infos:
        if name in tensors:
            raise ModelLoadError(f"GGUF file {path} is corrupt: tensor {name!r} is listed twice")
        if rel_offset % alignment:
            raise ModelLoadError(f"GGUF file {path} is corrupt: tensor {name!r} starts at {rel_offset}, not a "
                                 f"multiple of the file's alignment {alignment}")
        num_bytes = _tensor_num_bytes(path, name, dims, ggml_type)
        offset = data_offset + rel_offset
        if offset + num_bytes > size:
            raise ModelLoadError(
                f"GGUF file {path} is truncated: tensor {name!r} needs bytes [{offset}, {offset + num_bytes}) "
                f"but the file has {size} bytes"
            )
        tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, offset, num_bytes)
    by_offset = sorted(tensors.values(), key=lambda t: t.offset)
    for first, second in zip(by_offset, by_offset[1:], strict=False):
        if first.offset + first.num_bytes > second.offset:
            raise ModelLoadError(f"GGUF file {path} is corrupt: tensors {first.name!r} and {second.name!r} overlap")
    return GGUFHeader(path, version, metadata, tensors, data_offset, size)


def _tensor_num_bytes(path: Path, name: str, dims: tuple[int, ...], ggml_type: int) -> int:
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise UnsupportedModel(f"tensor {name!r} in {path} has unknown GGML type {ggml_type}") from None
    # Exact integers: a flipped bit in a dimension must not wrap around and pass the size check.
    num_elements = math.prod(dims)
    if dims[0] % block_size:
        raise ModelLoadError(
            f"GGUF file {path} is corrupt: tensor {name!r} rows of {dims[0]} are not a multiple of the "
            f"{GGMLQuantizationType(ggml_type).name} block size {block_size}"
        )
    return num_elements // block_size * type_size


# --------------------------------------------------------------------------------------------------
# Architecture
# --------------------------------------------------------------------------------------------------


def _rope_scaling(header: GGUFHeader, key: Callable[..., Any]) -> RopeScaling | None:
    """The rotary stretch a GGUF file records: linear by its factor, YaRN's (llama.cpp's keys; its converter
    writes transformers' ``attention_factor`` as ``yarn_attn_factor``, read back as that, times
    ``rope.scaling.attn_factor`` where a file has one), Phi-3's LongRoPE (rope_factors_short.weight), or llama.cpp's
    per-frequency factors (rope_freqs.weight, what a Llama 3.1+ conversion writes for its llama3 parameters)."""
    kind, factor = key("rope.scaling.type"), key("rope.scaling.factor", 1.0)
    short = header.tensors.get("rope_factors_short.weight")
    if short is not None:  # Phi-3's LongRoPE (its long factors serve past the original context: not served)
        context, original = int(key("context_length", 2048)), int(key("rope.scaling.original_context_length") or 0)
        if not original:
            raise ModelLoadError(f"{header.path}: rope_factors_short.weight without "
                                 f"rope.scaling.original_context_length")
        stretch = context / original
        attention = key("rope.scaling.attn_factor")
        if attention is None:
            attention = 1.0 if stretch <= 1.0 else math.sqrt(1 + math.log(stretch) / math.log(original))
        return RopeScaling("longrope", factor=stretch, original_max_position_embeddings=original,
                           freq_factors=tuple(float(v) for v in _f32_tensor(header, short)),
                           attention_factor=_shortest_float(attention))
    freqs = header.tensors.get("rope_freqs.weight")
    if freqs is not None:
        return RopeScaling("freq_factors", freq_factors=tuple(float(v) for v in _f32_tensor(header, freqs)))
    if kind == "linear" and float(factor) != 1.0:
        return RopeScaling("linear", factor=float(factor))
    if kind == "yarn":
        if float(key("rope.scaling.yarn_log_multiplier", 0.0)) or float(key("rope.scaling.yarn_ext_factor", 1.0)) != 1.0:
            raise UnsupportedModel(f"{header.path}: YaRN with a log multiplier or an extrapolation mix other than "
                                   f"1 (DeepSeek's) is not supported")
        factor = _shortest_float(factor)
        attention = _shortest_float(key("rope.scaling.yarn_attn_factor", 0.0)) or yarn_magnitude(factor)
        attention *= _shortest_float(key("rope.scaling.attn_factor", 1.0))
        return RopeScaling("yarn", factor=factor,
                           original_max_position_embeddings=int(key("rope.scaling.original_context_length")
                                                                or key("context_length", 2048)),
                           beta_fast=_shortest_float(key("rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=_shortest_float(key("rope.scaling.yarn_beta_slow", 1.0)),
                           attention_factor=attention)
    return None


def _f32_tensor(header: GGUFHeader, info: GGUFTensorInfo) -> np.ndarray:
    """A small F32 tensor's values, read from the file (rope factors)."""
    if info.ggml_type != GGMLQuantizationType.F32:
        raise ModelLoadError(f"{header.path}: {info.name} is not F32")
    with open(header.path, "rb") as f:
        f.seek(info.offset)
        return np.frombuffer(f.read(info.num_bytes), dtype=np.float32)


def _rotary_dim(dimension_count: int, head_dim: int) -> int:
    """llama.cpp's rope.dimension_count as ArchConfig.rotary_dim (0: the whole head)."""
    return dimension_count if 0 < dimension_count < head_dim else 0


def arch_from_gguf(header: GGUFHeader) -> ArchConfig:
    """The ``ArchConfig`` a GGUF file's ``{arch}.*`` metadata describes, for any architecture.

    Raises ``ModelLoadError`` (naming the file) when a key every model has is missing or malformed.
    """
    meta, path = header.metadata, header.path
    arch = header.architecture

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    name = str(meta.get("general.name", ""))
    try:
        hidden_size = int(key("embedding_length", required=True))
        num_heads = int(key("attention.head_count", required=True))
        if hidden_size < 1 or num_heads < 1:
            raise ModelLoadError(f"{path}: embedding_length {hidden_size} and head_count {num_heads} must be >= 1")
        kv_heads = key("attention.head_count_kv", num_heads)
        tokens = meta.get("tokenizer.ggml.tokens")
        embed = header.tensors.get("token_embd.weight")
        vocab_size = key("vocab_size") or (len(tokens) if tokens else None) or (embed.shape[0] if embed else None)
        if vocab_size is None:
            raise ModelLoadError(f"{path}: cannot tell the vocabulary size")
        if embed is not None and embed.shape[0] < int(vocab_size):  # an id past its rows would end the engine
            raise ModelLoadError(f"{path}: token_embd.weight has {embed.shape[0]} rows for a vocabulary of "
                                 f"{vocab_size} tokens")
        kv_lora_rank = int(key("attention.kv_lora_rank", 0))
        eos_ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
        num_layers = int(key("block_count", required=True))
        num_experts = int(key("expert_count", 0))
        num_dense_layers = int(key("leading_dense_block_count", 0))
        shared = "ffn_up_shexp.weight"
        window = int(key("attention.sliding_window", 0))
        if window >= int(key("context_length", 2048)):  # no window at all (Phi-3.5's and Phi-4-mini's 262,144)
            window = 0
        scaling = _rope_scaling(header, key)
        return ArchConfig(
            architecture=_architecture(arch, name, num_experts),
            name=name or path.stem,
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length", required=True)),
            num_layers=num_layers,
            num_heads=num_heads,
            # Some architectures give a count per layer; the largest one bounds the KV cache.
            num_kv_heads=int(max(kv_heads) if isinstance(kv_heads, list) else kv_heads),
            head_dim=int(key("attention.key_length", hidden_size // num_heads)),
            max_position_embeddings=(scaling.served_context(int(key("context_length", 2048))) if scaling
                                     else int(key("context_length", 2048))),
            rope_theta=_shortest_float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rms_norm_eps=_shortest_float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            tie_word_embeddings="output.weight" not in header.tensors,
            qkv_bias="blk.0.attn_q.bias" in header.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in header.tensors,
            sliding_window=window,
            sliding_layers=_gguf_sliding_layers(arch, num_layers) if window else (),
            # llama.cpp's rule for SmolLM3, whose files do not say: every fourth layer has no rotary.
            no_rope_layers=tuple(i for i in range(num_layers) if (i + 1) % 4 == 0) if arch == "smollm3" else (),
            # llama.cpp's values for Gemma 3, which its GGUF files do not carry.
            rope_local_theta=10000.0 if arch == "gemma3" else 0.0,
            rotary_dim=_rotary_dim(int(key("rope.dimension_count", 0)), int(key("attention.key_length",
                                                                                 hidden_size // num_heads))),
            fused_projections=arch == "phi3",
            # llama.cpp's rule: Gemma 3 27B (62 layers) scales queries by hidden / heads, the others by the head size.
            query_pre_attn_scalar=(float(hidden_size // num_heads) if num_layers == 62 else
                                   float(key("attention.key_length", 0))) if arch == "gemma3" else 0.0,
            final_logit_softcapping=float(key("final_logit_softcapping", 0.0) or 0.0),
            # Granite's scalars (llama.cpp's names; other architectures read logit_scale otherwise)
            embedding_multiplier=_shortest_float(key("embedding_scale", 1.0)) if arch == "granite" else 1.0,
            residual_multiplier=_shortest_float(key("residual_scale", 1.0)) if arch == "granite" else 1.0,
            logits_scaling=_shortest_float(key("logit_scale", 1.0)) if arch == "granite" else 1.0,
            attention_multiplier=_shortest_float(key("attention.scale", 0.0)),
            num_experts=num_experts,
            num_experts_per_token=int(key("expert_used_count", 0)),
            moe_intermediate_size=int(key("expert_feed_forward_length", 0)),
            # llama.cpp's Qwen2-MoE files have one shared expert and no count for it.
            num_shared_experts=int(key("expert_shared_count", 0)) or int(
                any(t.endswith(shared) for t in header.tensors)),
            shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)),
            shared_expert_gate=any(t.endswith("ffn_gate_inp_shexp.weight") for t in header.tensors),
            norm_topk_prob=bool(key("expert_weights_norm", _NORMALISED_TOP_K.get(arch, False))),
            num_dense_layers=num_dense_layers,
            # Layers without a router are dense (llama.cpp has no sparse-step key; the tensors tell).
            mlp_only_layers=tuple(i for i in range(num_dense_layers, num_layers)
                                  if num_experts and f"blk.{i}.ffn_gate_inp.weight" not in header.tensors),
            kv_lora_rank=kv_lora_rank,
            q_lora_rank=int(key("attention.q_lora_rank", 0)),
            qk_rope_head_dim=int(key("rope.dimension_count", 0)) if kv_lora_rank else 0,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: malformed GGUF metadata ({e})") from None


# Whether llama.cpp renormalises the top-k routing weights, for files without expert_weights_norm
# (build_moe_ffn's norm_w: true for Mixtral, stored as "llama", and Qwen3-MoE; false for Qwen2-MoE).
_NORMALISED_TOP_K = {"llama": True, "qwen3moe": True, "qwen2moe": False}
# GGUF architecture -> the Hugging Face model_type the engine names it by.
_MOE_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}


def _architecture(arch: str, name: str, num_experts: int) -> str:
    """llama.cpp stores Mistral and Mixtral as "llama"; its MoE names lack Hugging Face's underscore."""
    if arch == "llama" and num_experts > 0:
        return "mixtral"
    if arch == "llama" and "mistral" in name.lower():
        return "mistral"
    return _MOE_ARCHITECTURES.get(arch, arch)


def _gguf_sliding_layers(arch: str, num_layers: int) -> tuple[int, ...]:
    """Which layers use the sliding window. Gemma 3 files do not say: llama.cpp and transformers both take
    every sixth layer as global and the rest as sliding."""
    if arch == "gemma3":
        return tuple(i for i in range(num_layers) if (i + 1) % 6)
    return tuple(range(num_layers))


def _shortest_float(value: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974738e-06. Keep the intended value."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="0"))
