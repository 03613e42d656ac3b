"""The boundary between the model and the kernels that run it.

A ``Backend`` is chosen once per engine (``select.py``, the only module that names one) and gives the model
everything kernel-specific: one attention object per layer (each owning what it keeps across steps), the
per-token ops, the greedy sampler's argmax, an optional fused decode stack and the scope a step runs in.

Each step the runner describes its tokens in generic rows (``StepRows``); the backend turns them into the
metadata its own attention reads (``AttentionMetadata`` or a subclass of it). The runner never knows a
kernel's tile size, nor what a backend derives from the KV and keeps across steps. Token order in a step:

    [ d0 d1 ... d(B-1) | prefill chunk a (q_len_a) | prefill chunk b | ... ]

where the d's are single-token queries (decodes, their speculative drafts, one-token prefill chunks).
KV memory per layer is one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
``block_id * block_size + offset``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.model.ops import ModelOps

# Row-wise argmax of [B, V] logits -> int64 [B], ties to the lowest index (as torch's).
ArgMax = Callable[[torch.Tensor], torch.Tensor]
# In place: logits [B, V] -inf where a grammar's bitmask (int32 [R, W], for the rows int64 [R]) has a clear bit.
MaskLogits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One request's prefill chunk: step rows q_start..q_start+q_len-1 attend to keys 0..kv_len-1."""

    q_start: int
    q_len: int
    kv_len: int
    block_ids: list[int]  # the blocks holding keys 0..kv_len-1


@dataclass(frozen=True, slots=True)
class StepRows:
    """A step's tokens as the runner lays them out, the same for every backend."""

    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] on the device: where each new token's K/V is written
    # Per decode row: its request's block table (the rows of one request share the same list) and the
    # keys it sees (its own position + 1).
    decode_block_ids: list[list[int]] = field(default_factory=list)
    decode_kv_lens: list[int] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Every block whose KV this step rewrites (tier loads, then the blocks its tokens land in; repeats
    # allowed). A backend that keeps something derived from blocks' contents tells stale copies by it.
    written_block_ids: list[int] = field(default_factory=list)
    # The requests the decode rows belong to: a request's drafts are decode rows after its own.
    num_decode_requests: int | None = None

    def __post_init__(self) -> None:
        if self.num_decode_requests is None:  # one row each
            object.__setattr__(self, "num_decode_requests", self.num_decode_rows)

    @property
    def num_decode_rows(self) -> int:
        return len(self.decode_kv_lens)


@dataclass(slots=True)
class PrefillSpan:
    """One request's prefill chunk: queries q_start..q_start+q_len attend to keys 0..kv_len-1."""

    q_start: int
    q_len: int
    kv_len: int
    # None when the chunk starts at position 0: keys are exactly this chunk's, plain causal attention.
    block_ids: torch.Tensor | None = None  # [num_blocks] blocks holding keys 0..kv_len-1
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _window_mask: torch.Tensor | None = field(default=None, repr=False)

    def window_start_block(self, window: int, block_size: int) -> int:
        """The first block a sliding-window layer reads: the first query sees keys ``window`` - 1 back."""
        if self.block_ids is None:
            return 0
        return max(0, self.kv_len - self.q_len - window + 1) // block_size

    def window_mask(self, window: int, block_size: int, device: torch.device) -> torch.Tensor:
        """[q_len, kv_len - first key] bool, from the first key of ``window_start_block``: causal and within
        ``window`` keys back (a sliding-window layer's view)."""
        if self._window_mask is None:
            first_key = self.window_start_block(window, block_size) * block_size
            positions = torch.arange(self.kv_len - self.q_len, self.kv_len, device=device)[:, None]
            keys = torch.arange(first_key, self.kv_len, device=device)[None, :]
            self._window_mask = (keys <= positions) & (keys > positions - window)
        return self._window_mask

    def history_mask(self) -> torch.Tensor:
        """[q_len, kv_len] bool, True = attend: each query sees the keys up to its own position. Built on
        first use and kept for the step's other layers; kernels that take the paged runs never build it."""
        if self._mask is None:
            assert self.block_ids is not None, "a chunk from position 0 is plain causal attention"
            device = self.block_ids.device
            positions = torch.arange(self.kv_len - self.q_len, self.kv_len, device=device)
            self._mask = torch.arange(self.kv_len, device=device)[None, :] <= positions[:, None]
        return self._mask


@dataclass(frozen=True, slots=True)
class WindowLayout:
    """A step in which some row holds more keys than the model's sliding window: what its sliding-window
    layers read instead of the fast layout (each decode's blocks the window reaches, unsplit, and which keys
    of them it sees)."""

    window: int
    # [num_decodes, width]: each decode row's blocks from the one holding its first key in the window, padded
    decode_block_table: torch.Tensor | None
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, width * block_size]: True = in the window


@dataclass(slots=True)
class AttentionMetadata:
    """A step's attention layout, built once by the backend and reused by every layer. These fields are
    what the torch reference attention reads (every backend may fall back to it); a backend subclasses it
    with what its own kernels need."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decode_tokens: int = 0
    decode_block_table: torch.Tensor | None = None  # int32 [num_decodes, max_blocks], padded with block 0
    decode_seq_lens: torch.Tensor | None = None  # int32 [num_decodes]: keys the table above covers
    # Blocks every decode shares, read once for all of them (cascade attention); the table above then
    # covers only the blocks after them. None: no shared prefix (or too short to be worth it).
    decode_prefix_blocks: torch.Tensor | None = None  # [num_shared_blocks]
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Set when the window binds this step (a sliding-window model); its window layers then take the
    # reference path over it, its other layers the usual one.
    window: WindowLayout | None = None


class PagedAttention(Protocol):
    """One layer's attention: writes the new K/V into their slots and attends over each request's blocks."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        ...


class DenseMLPWeights(Protocol):
    gate_up_weight: torch.Tensor  # [2 * intermediate, hidden]
    down_weight: torch.Tensor  # [hidden, intermediate]


class DecoderWeights(Protocol):
    """What a fused decode stack reads of each decoder layer, once its weights are loaded and prepared."""

    attention: PagedAttention
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None  # Qwen2
    q_norm: torch.Tensor | None  # QK-norm weights (Qwen3); both or neither
    k_norm: torch.Tensor | None
    o_weight: torch.Tensor
    mlp: DenseMLPWeights  # a dense MLP: backends refuse the fused stack for mixtures of experts
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor


@dataclass(frozen=True, slots=True)
class DecoderLayout:
    """What a fused decode needs to know of a model's decoder layers besides their weights."""

    # Llama's layer (two norms, a SiLU-gated MLP), which a kernel stack may run itself; a family with more
    # (Gemma 3's four norms) only runs as its layers' own forwards.
    llama_layers: bool
    # Per layer, which of the step's rotations it takes: 0 the model's, 1 the local one (Gemma 3's window layers),
    # NO_ROTATION none (SmolLM3's NoPE layers).
    layer_rotations: tuple[int, ...]


NO_ROTATION = -1


class FusedDecode(Protocol):
    """Every decoder layer of the steps it accepts in one call, bit for bit what the layers would give. A step
    has one attention layout per KV group (``metas``: the step's own first) and one rotation per rope base."""

    def prepare(self, kv_caches: list[torch.Tensor], layer_tables: Sequence[int]) -> None:
        """Called once the KV caches exist, before the first step, with each layer's KV group (the index of the
        layout it reads in ``metas``): one that records its steps (CUDA graphs) records them now."""
        ...

    def accepts(self, hidden: torch.Tensor, metas: Sequence[AttentionMetadata]) -> bool: ...

    def __call__(self, hidden: torch.Tensor, rotations: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 metas: Sequence[AttentionMetadata], kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the last layer; ``rotations``: (cos, sin) of each rope base."""
        ...


class Backend(Protocol):
    """Everything kernel-specific a model and its runner use; one per engine."""

    name: str
    description: str  # the name and what it picked, for the log
    ops: ModelOps
    argmax: ArgMax | None  # None: torch's
    mask_logits: MaskLogits | None  # None: torch's ops (structured/masks.py)
    # The GGML types whose weights ``ops`` runs in their blocks (model/quantized.py); the loader dequantises
    # every other type. Empty: every weight is dequantised at load.
    quantized_types: frozenset[int]
    # Whether --quantization auto keeps quantised weights in their blocks (else only --quantization gguf does).
    quantized_by_default: bool
    # Whether its kernels read quantised weights held interleaved sixteen rows at a time (model/quantized_layout.py).
    quantized_interleaved: bool
    # Whether those kernels take int8 activations, one level per 32 values, at every width (else as exact as bf16
    # in prompt chunks): with the weights' blocks, what decides the KV a prompt leaves besides the dtype.
    quantized_int8_activations: bool

    def build_metadata(self, rows: StepRows) -> AttentionMetadata:
        """This step's layout for this backend's attention (called once per step that writes KV)."""
        ...

    def make_attention(self, layer_index: int) -> PagedAttention:
        """The attention of one layer; it keeps its own state across steps."""
        ...

    def build_fused_decode(self, layers: Sequence[DecoderWeights], layout: DecoderLayout) -> FusedDecode | None:
        """The fused decode stack for these layers, or None; called once their weights are prepared."""
        ...

    def step_scope(self) -> AbstractContextManager[None]:
        """Entered around each step's forward and sampling; asked once the fused stack is built."""
        ...

    def packed_weight_nbytes(self) -> int:
        """The bytes of the copies of weights its kernels packed in layouts of their own."""
        ...
