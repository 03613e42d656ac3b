"""LoRA adapters in PEFT's format, run beside the base model's projections per request.

An adapter adds ``scale * B @ A @ x`` to the projections it targets (q/k/v/o, gate/up/down), where A is
[rank, in], B [out, rank] and scale is ``alpha / rank`` (``alpha / sqrt(rank)`` with rsLoRA). The base weights
are never touched, so requests with different adapters, and requests without one, share a batch: each
projection runs once on every row, then each adapter's low-rank product is added to its own rows. The model
fuses Q/K/V and gate/up into one matmul each; an adapter's matrices for them are joined the same way (A's
rows stacked, B placed block-diagonally on the fused output's rows), one product per fused projection.

The files are PEFT's ``save_pretrained`` output: ``adapter_config.json`` and ``adapter_model.safetensors``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load as load_safetensors

from kvserve.config import ArchConfig
from kvserve.errors import ModelLoadError
from kvserve.model.ops import LoRAAdd, torch_lora_add

Projection = Literal["qkv", "o", "gate_up", "down"]

# A Hugging Face module name -> (the fused projection it is part of, its place among the fused parts).
_MODULES: dict[str, tuple[Projection, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
_TENSOR_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoRALoadError(ModelLoadError):
    """An adapter that cannot be loaded: missing files, a layout kvserve does not run, or shapes that do not
    fit the base model."""

    http_status = 400


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One fused projection's low-rank update: ``out += (x @ a.T) @ bt``, the scale folded into ``bt`` (float32 on
    a CPU, else the model's dtype)."""

    a: torch.Tensor  # [total rank of its parts, in]
    bt: torch.Tensor  # [total rank, out]: B transposed, zero outside each part's own rank rows and output columns
    parts: torch.Tensor  # [parts, 4] int64 on the host: each part's output columns [c0, c1) and ranks [r0, r1)


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """A loaded adapter: its name, where it came from, a fingerprint of its files (what the prefix cache keys
    its KV by: a request's KV depends on its adapter), and its updates per layer and projection."""

    name: str
    path: str
    fingerprint: str
    rank: int  # the largest of its modules' ranks
    layers: tuple[dict[Projection, LoRAWeights], ...]

    @property
    def cache_key(self) -> bytes:
        """What a request with this adapter mixes into its block hashes, right after the engine's own extra and
        before any cache salt (so that no salt can spell an adapter's key)."""
        return b"\0lora:" + self.fingerprint.encode()


def load_adapter(name: str, path: str | Path, arch: ArchConfig, dtype: torch.dtype,
                 device: torch.device) -> LoRAAdapter:
    """Read a PEFT LoRA adapter directory and check it against ``arch``; LoRALoadError says what is wrong."""
    directory = Path(path).expanduser()
    config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not config_file.is_file():
        raise LoRALoadError(f"LoRA adapter '{name}': no {ADAPTER_CONFIG} in {directory}")
    if not weights_file.is_file():
        raise LoRALoadError(f"LoRA adapter '{name}': no {ADAPTER_WEIGHTS} in {directory} (PEFT's save_pretrained "
                            "writes it; a .bin adapter is not read)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRALoadError(f"LoRA adapter '{name}': {ADAPTER_CONFIG} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRALoadError(f"LoRA adapter '{name}': {ADAPTER_CONFIG} is not a JSON object")
    _check_config(name, config)
    try:
        config_bytes, weights_bytes = config_file.read_bytes(), weights_file.read_bytes()
        tensors = load_safetensors(weights_bytes)  # the bytes the fingerprint is of
    except Exception as exc:  # an unreadable file, or safetensors' own error types for a damaged one
        raise LoRALoadError(f"LoRA adapter '{name}': {ADAPTER_WEIGHTS} cannot be read: {exc}") from None
    fingerprint = hashlib.sha256(config_bytes + weights_bytes).hexdigest()[:32]
    parts = _pair_tensors(name, tensors, arch)
    layers: list[dict[Projection, LoRAWeights]] = [{} for _ in range(arch.num_layers)]
    ranks: list[int] = []
    for (layer, projection), modules in sorted(parts.items()):
        layers[layer][projection] = _fuse(name, layer, projection, modules, config, arch, dtype, device)
        ranks += [a.shape[0] for _, a, _ in modules]
    if not ranks:
        raise LoRALoadError(f"LoRA adapter '{name}': {ADAPTER_WEIGHTS} holds no LoRA matrices of the decoder "
                            "layers' projections")
    return LoRAAdapter(name, str(directory), fingerprint, max(ranks), tuple(layers))


def _check_config(name: str, config: dict[str, Any]) -> None:
    """Refuse what the adapter's configuration asks for and kvserve does not run."""
    def refuse(why: str) -> None:
        raise LoRALoadError(f"LoRA adapter '{name}': {why}")

    if config.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type is {config.get('peft_type')!r}; only LORA adapters run")
    if config.get("use_dora"):
        refuse("DoRA (use_dora) is not supported")
    # PEFT's variants whose forward is not plain LoRA's update on every token.
    for key in ("lora_bias", "use_qalora", "alora_invocation_tokens", "layer_replication", "velora_config",
                "monteclora_config", "kasa_config", "arrow_config", "use_bdlora", "trainable_token_indices",
                "target_parameters"):
        if config.get(key):
            refuse(f"{key} is set: that LoRA variant is not supported (only plain LoRA, rsLoRA and rank/alpha "
                   "patterns are)")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and (init in ("pissa", "olora", "corda", "loftq", "lora_ga")
                                  or init.startswith("pissa_niter_")):
        refuse(f"init_lora_weights {init!r} changes the base model's weights; convert the adapter to plain LoRA "
               "first (PEFT's path_initial_model_for_weight_conversion)")
    if config.get("bias", "none") != "none":
        refuse(f"bias {config.get('bias')!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out"):
        refuse("fan_in_fan_out is not supported (the Llama family's projections are nn.Linear)")
    if config.get("modules_to_save"):
        refuse(f"modules_to_save ({config['modules_to_save']}) would replace base weights; not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            refuse(f"{key} must be a positive number, got {value!r}")


def _pair_tensors(name: str, tensors: dict[str, torch.Tensor],
                  arch: ArchConfig) -> dict[tuple[int, Projection], list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """The file's A and B matrices, paired by module: (layer, fused projection) -> [(PEFT's module key, A, B)]."""
    found: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR_NAME.fullmatch(key)
        if match is None:
            raise LoRALoadError(f"LoRA adapter '{name}': tensor {key!r} is not a LoRA matrix of a decoder layer's "
                                "projection (embedding, output-head and DoRA weights are not supported)")
        layer, module, side = int(match.group(1)), match.group(2), match.group(3)
        if module not in _MODULES:
            raise LoRALoadError(f"LoRA adapter '{name}': it targets {module!r}; kvserve runs adapters on "
                                f"{', '.join(_MODULES)}")
        if layer >= arch.num_layers:
            raise LoRALoadError(f"LoRA adapter '{name}': it has layer {layer}; the model has {arch.num_layers}")
        if arch.rotary_dim and module in ("q_proj", "k_proj"):  # the loader reorders those rows of the model
            raise LoRALoadError(f"LoRA adapter '{name}': it targets {module!r} of a model that rotates part of each "
                                f"head; adapters on q_proj and k_proj are not supported there")
        if _MODULES[module][0] in ("gate_up", "down") and arch.is_moe_layer(layer):
            raise LoRALoadError(f"LoRA adapter '{name}': layer {layer}'s MLP is a mixture of experts; adapters on "
                                "experts are not supported (attention-only adapters are)")
        if tensor.dim() != 2:
            raise LoRALoadError(f"LoRA adapter '{name}': tensor {key!r} has shape {tuple(tensor.shape)}, not a matrix")
        sides = found.setdefault((layer, module), {})
        if side in sides:
            raise LoRALoadError(f"LoRA adapter '{name}': layer {layer}'s {module} has two lora_{side} tensors "
                                f"({sides[side][0]!r} and {key!r})")
        sides[side] = (key, tensor)
    parts: dict[tuple[int, Projection], list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), sides in found.items():
        if set(sides) != {"A", "B"}:
            raise LoRALoadError(f"LoRA adapter '{name}': layer {layer}'s {module} has lora_{''.join(sides)} "
                                "without its other half")
        parts.setdefault((layer, _MODULES[module][0]), []).append((_module_key(sides["A"][0]), sides["A"][1],
                                                                   sides["B"][1]))
    return parts


def _module_key(tensor_name: str) -> str:
    """The module's name as PEFT matches rank and alpha patterns against it: the tensor's name without PEFT's
    wrapper prefix and the LoRA suffix (``model.layers.3.self_attn.q_proj``)."""
    return tensor_name.removeprefix("base_model.model.").split(".lora_")[0]


def _pattern_value(name: str, patterns: Any, module_key: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the module's name, as PEFT matches it."""
    if not isinstance(patterns, dict):
        return default
    for pattern, value in patterns.items():
        try:
            matched = re.match(rf"(.*\.)?({pattern})$", module_key)
        except re.error as exc:
            raise LoRALoadError(f"LoRA adapter '{name}': pattern {pattern!r} is not a regular expression: {exc}") \
                from None
        if matched:
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise LoRALoadError(f"LoRA adapter '{name}': pattern {pattern!r} gives {value!r}, not a positive "
                                    "number")
            return float(value)
    return default


def module_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """Each module an adapter may target: its weight's [out, in] in ``arch``, as PEFT's lora_B and lora_A see it."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (arch.q_size, hidden), "k_proj": (arch.kv_size, hidden), "v_proj": (arch.kv_size, hidden),
            "o_proj": (hidden, arch.q_size), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def _fuse(name: str, layer: int, projection: Projection, modules: list[tuple[str, torch.Tensor, torch.Tensor]],
          config: dict[str, Any], arch: ArchConfig, dtype: torch.dtype, device: torch.device) -> LoRAWeights:
    """One fused projection's A and B from its modules' (PEFT's module key, A, B), shapes checked, scales
    folded."""
    shapes = module_shapes(arch)
    parts_of = [m for m, (p, _) in _MODULES.items() if p == projection]  # in the order the model fuses them
    in_size = shapes[parts_of[0]][1]
    out_size = sum(shapes[m][0] for m in parts_of)
    # Each part's first row in the fused output.
    first_rows = {m: sum(shapes[n][0] for n in parts_of[:i]) for i, m in enumerate(parts_of)}
    modules = sorted(modules, key=lambda m: _MODULES[m[0].rsplit(".", 1)[-1]][1])
    total_rank = sum(a.shape[0] for _, a, _ in modules)
    fused_a = torch.zeros(total_rank, in_size, dtype=torch.float32)
    fused_b = torch.zeros(out_size, total_rank, dtype=torch.float32)
    column = 0
    parts = []
    for module_key, a, b in modules:
        module = module_key.rsplit(".", 1)[-1]
        start, size = first_rows[module], shapes[module][0]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_size or b.shape != (size, rank):
            raise LoRALoadError(f"LoRA adapter '{name}': layer {layer}'s {module} has lora_A {tuple(a.shape)} and "
                                f"lora_B {tuple(b.shape)}; the model needs [{rank}, {in_size}] and [{size}, {rank}] "
                                "(an adapter of another base model?)")
        alpha = _pattern_value(name, config.get("alpha_pattern"), module_key, float(config["lora_alpha"]))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        fused_a[column:column + rank] = a.float()
        fused_b[start:start + size, column:column + rank] = b.float() * scale
        parts.append((start, start + size, column, column + rank))
        column += rank
    # On a CPU the low-rank products run in float32: torch's bf16 matmul costs several times float32's at these
    # skinny shapes (benchmarks/lora.py), and the product is a small share of the projection's FLOPs.
    compute = torch.float32 if device.type == "cpu" else dtype
    return LoRAWeights(fused_a.to(device=device, dtype=compute).contiguous(),
                       fused_b.T.to(device=device, dtype=compute).contiguous(), torch.tensor(parts, dtype=torch.long))


class LayerLoRA:
    """The adapters of one step's rows, at one layer: adds each one's update to the projections' outputs
    through the backend's ``lora_add``."""

    __slots__ = ("groups", "index", "lora_add")

    def __init__(self, groups: Sequence[tuple[LoRAAdapter, torch.Tensor | None]], index: int,
                 lora_add: LoRAAdd) -> None:
        self.groups = groups
        self.index = index
        self.lora_add = lora_add

    def targets(self, projection: Projection) -> bool:
        """Whether any adapter of the step updates ``projection`` at this layer."""
        return any(projection in adapter.layers[self.index] for adapter, _ in self.groups)

    def add(self, projection: Projection, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base projection of ``x``) with each adapter's update added to its rows, in place."""
        for adapter, rows in self.groups:
            weights = adapter.layers[self.index].get(projection)
            if weights is not None:
                self.lora_add(out, x, weights.a, weights.bt, weights.parts, rows)
        return out


@dataclass(frozen=True, slots=True)
class StepLoRA:
    """Which rows of a step run which adapter (rows None: all of them); rows without one run the base model."""

    groups: tuple[tuple[LoRAAdapter, torch.Tensor | None], ...]
    lora_add: LoRAAdd = torch_lora_add

    def layer(self, index: int) -> LayerLoRA:
        return LayerLoRA(self.groups, index, self.lora_add)

    @classmethod
    def for_rows(cls, spans: Sequence[tuple[LoRAAdapter | None, int, int]], num_rows: int, device: torch.device,
                 lora_add: LoRAAdd = torch_lora_add) -> StepLoRA | None:
        """From each request's (adapter, first row, row count); None when no row runs an adapter. The spans do
        not overlap, so an adapter's rows are distinct (the C++ update writes each row from one thread)."""
        by_adapter: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        for adapter, first, count in spans:
            if adapter is not None:
                by_adapter.setdefault(id(adapter), (adapter, []))[1].extend(range(first, first + count))
        if not by_adapter:
            return None
        groups = []
        for adapter, rows in by_adapter.values():
            whole = len(rows) == num_rows
            groups.append((adapter, None if whole else torch.tensor(rows, dtype=torch.long).to(device)))
        return cls(tuple(groups), lora_add)
