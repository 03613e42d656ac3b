"""Decode steps replayed from CUDA graphs: the CUDA backend's fused decode.

A small model's decode step on a GPU is bound by launching its kernels (hundreds per step), not by reading
its weights. A CUDA graph records a step's launches once and replays them with one call. A graph holds
fixed shapes and fixed addresses, so the step runs on persistent buffers:

- **Sizes**: graphs are captured for decode steps of 1, 2, 4, 8, 16, 24, ... rows (requests and their
  drafts) up to ``cuda_graph_max_rows``; a step is padded to the next captured size. All of them are
  captured together at start-up, once the KV caches exist, largest first, sharing one memory pool.
- **Buffers**: the hidden rows and the rotary cos/sin of each rope base (Gemma 3's window layers have their
  own), and for each KV group (one, or Gemma 3's global and window groups, each with its own tables) the
  slot mapping, block table and sequence lengths, and for cascade decode the shared prefix's block ids and
  their count; copied in each step. The block table and the prefix are each as wide as
  ``cuda_graph_max_seq_len`` keys need; the decode kernel reads only a row's own blocks, the prefix
  programs past the prefix's blocks (all of them, in a step without one) exit at once, and the merge reads
  only the splits that hold keys.
- **Padding rows** write no KV (slot -1, which the Triton KV write skips) and attend to one key; their
  outputs are never read.

Steps a graph cannot take run eagerly: any prefill chunk, more rows than the largest size, a sequence longer
than the captured table; every step, when a capture failed. ``GraphCapture`` records a step: on a GPU into a
CUDA graph; on a CPU (the tests) it runs the same step on the same buffers again at each replay, so that
everything but the recording itself (sizes, padding, buffer reuse, what falls back) is tested without a GPU.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.model.backends.base import NO_ROTATION, AttentionMetadata
from kvserve.model.backends.triton_attention import SharedPrefix, TritonAttentionMetadata

logger = logging.getLogger(__name__)

PADDING_SLOT = -1
WARMUP_RUNS = 2  # before a capture: Triton compiles its kernels, torch settles its workspaces

Step = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # -> (hidden, residual) after the last layer


class DecoderStep(Protocol):
    """One decoder layer's forward, as the model's layers run it."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor | None,
                sin: torch.Tensor | None, meta: AttentionMetadata, kv_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]: ...


class GraphCapture(Protocol):
    """Records a step once; the function it returns replays it and gives the step's outputs."""

    def __call__(self, step: Step) -> Step: ...


class CudaGraphCapture:
    """Records steps into CUDA graphs sharing one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: tuple[int, int] | None = None

    def __call__(self, step: Step) -> Step:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step()
        if self.pool is None:
            self.pool = graph.pool()

        def replay() -> tuple[torch.Tensor, torch.Tensor]:
            graph.replay()
            return outputs

        return replay


def replay_eagerly(step: Step) -> Step:
    """A CPU's stand-in for a capture: each replay runs the step again, on the same buffers."""
    return step


def capture_sizes(max_rows: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then every multiple of 8, up to the first that holds ``max_rows``."""
    sizes = [1, 2, 4, *range(8, max_rows + 8, 8)]
    return sizes[: bisect.bisect_left(sizes, max_rows) + 1]


def bucket_for(rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``rows``, or None when none does."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True, slots=True)
class TableBuffers:
    """One KV group's part of a captured step, at the largest size; a size's step reads their first rows."""

    slot_mapping: torch.Tensor  # int64 [rows]
    block_table: torch.Tensor  # int32 [rows, table_width]
    seq_lens: torch.Tensor  # int32 [rows]
    shared_prefix: SharedPrefix | None  # block ids [table_width] and their count; None: no cascade decode

    @classmethod
    def allocate(cls, rows: int, table_width: int, device: torch.device, cascade: bool) -> TableBuffers:
        """Every row a padding row: no KV written, one key read; no shared prefix."""
        prefix = (SharedPrefix(torch.zeros(table_width, dtype=torch.int32, device=device),
                               torch.zeros(1, dtype=torch.int32, device=device)) if cascade else None)
        return cls(slot_mapping=torch.full((rows,), PADDING_SLOT, dtype=torch.long, device=device),
                   block_table=torch.zeros((rows, table_width), dtype=torch.int32, device=device),
                   seq_lens=torch.ones(rows, dtype=torch.int32, device=device), shared_prefix=prefix)

    def fill(self, meta: AttentionMetadata, n: int, size: int) -> None:
        """This step's ``n`` rows, then padding rows up to ``size``: no KV written, one key read."""
        assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_table[:n, : meta.decode_block_table.shape[1]].copy_(meta.decode_block_table)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        if self.shared_prefix is not None:
            prefix = getattr(meta, "decode_shared_prefix", None)
            if prefix is None:
                self.shared_prefix.num_blocks.zero_()
            else:
                self.shared_prefix.block_ids[: prefix.block_ids.shape[0]].copy_(prefix.block_ids)
                self.shared_prefix.num_blocks.copy_(prefix.num_blocks)
        if size > n:
            self.slot_mapping[n:size].fill_(PADDING_SLOT)
            self.seq_lens[n:size].fill_(1)

    def metadata(self, size: int) -> TritonAttentionMetadata:
        """The attention layout a step of ``size`` rows reads: views of the buffers."""
        return TritonAttentionMetadata(slot_mapping=self.slot_mapping[:size], num_decode_tokens=size,
                                       decode_block_table=self.block_table[:size],
                                       decode_seq_lens=self.seq_lens[:size], decode_shared_prefix=self.shared_prefix)

    def takes(self, meta: AttentionMetadata) -> bool:
        """Whether a step's layout fits these buffers."""
        table, prefix = meta.decode_block_table, getattr(meta, "decode_shared_prefix", None)
        width = self.block_table.shape[1]
        return (meta.window is None and meta.decode_prefix_blocks is None and table is not None
                and table.shape[1] <= width
                and (prefix is None or (self.shared_prefix is not None and prefix.block_ids.shape[0] <= width)))


@dataclass(frozen=True, slots=True)
class StepBuffers:
    """What a captured step reads, at the largest size; a size's step reads their first rows."""

    hidden: torch.Tensor  # [rows, hidden]
    rotations: list[tuple[torch.Tensor, torch.Tensor]]  # per rope base: cos, sin [rows, 1, head_dim]
    tables: list[TableBuffers]  # per KV group

    @classmethod
    def allocate(cls, rows: int, hidden_size: int, head_dim: int, table_width: int, dtype: torch.dtype,
                 device: torch.device, cascade: bool, num_rotations: int = 1, num_tables: int = 1) -> StepBuffers:
        """Every row a padding row: no KV written, one key read; no shared prefix."""
        def rotary() -> torch.Tensor:
            return torch.zeros((rows, 1, head_dim), dtype=dtype, device=device)

        return cls(hidden=torch.zeros((rows, hidden_size), dtype=dtype, device=device),
                   rotations=[(rotary(), rotary()) for _ in range(num_rotations)],
                   tables=[TableBuffers.allocate(rows, table_width, device, cascade) for _ in range(num_tables)])

    def fill(self, hidden: torch.Tensor, rotations: Sequence[tuple[torch.Tensor, torch.Tensor]],
             metas: Sequence[AttentionMetadata], size: int) -> None:
        """This step's rows, then padding rows up to ``size``: no KV written, one key read."""
        n = hidden.shape[0]
        self.hidden[:n].copy_(hidden)
        for (cos, sin), (cos_buffer, sin_buffer) in zip(rotations, self.rotations, strict=True):
            cos_buffer[:n].copy_(cos)
            sin_buffer[:n].copy_(sin)
        for meta, table in zip(metas, self.tables, strict=True):
            table.fill(meta, n, size)

    def metadata(self, size: int) -> list[TritonAttentionMetadata]:
        """Each KV group's attention layout for a step of ``size`` rows: views of the buffers."""
        return [table.metadata(size) for table in self.tables]


class DecodeGraphs:
    """The decoder layers of decode steps, replayed from captured graphs (``FusedDecode``)."""

    def __init__(self, layers: Sequence[DecoderStep], hidden_size: int, head_dim: int, max_rows: int,
                 max_seq_len: int, capture: GraphCapture, cascade: bool = False,
                 layer_rotations: Sequence[int] | None = None) -> None:
        self.layers = list(layers)
        self.cascade = cascade  # the steps read a shared prefix's blocks once (a buffer for its ids)
        # Per layer: the rope base (index into a step's rotations) and, once prepared, the KV group it reads.
        self.layer_rotations = tuple(layer_rotations) if layer_rotations is not None else (0,) * len(self.layers)
        self.layer_tables: tuple[int, ...] = (0,) * len(self.layers)
        self.hidden_size = hidden_size
        self.head_dim = head_dim
        self.sizes = capture_sizes(max_rows)
        self.max_seq_len = max_seq_len
        self.capture = capture
        self.buffers: StepBuffers | None = None
        self.table_width = 0  # blocks per row of the captured table, known with the cache's block size
        self.steps: dict[int, Step] = {}
        self._kv_caches: list[torch.Tensor] | None = None
        self.num_replays = 0
        self.capture_error: str | None = None  # why the steps run eagerly, when a capture failed

    def accepts(self, hidden: torch.Tensor, metas: Sequence[AttentionMetadata]) -> bool:
        rows = hidden.shape[0]
        return (self.buffers is not None and len(metas) == len(self.buffers.tables)
                and bucket_for(rows, self.sizes) is not None
                and all(meta.num_decode_tokens == rows and not meta.prefills and table.takes(meta)
                        for meta, table in zip(metas, self.buffers.tables, strict=True)))

    def prepare(self, kv_caches: list[torch.Tensor], layer_tables: Sequence[int]) -> None:
        """Every size's step captured on the buffers (whose padding rows write nothing to the caches). A
        capture that fails leaves every step eager, with a warning: serving goes on, slower."""
        cache = kv_caches[0]  # [2, blocks, block_size, kv_heads, head_dim], in the model's dtype
        self.table_width = -(-self.max_seq_len // cache.shape[2])
        self.layer_tables = tuple(layer_tables)
        self.buffers = StepBuffers.allocate(self.sizes[-1], self.hidden_size, self.head_dim, self.table_width,
                                            cache.dtype, cache.device, self.cascade,
                                            num_rotations=max(self.layer_rotations) + 1,
                                            num_tables=max(self.layer_tables) + 1)
        self._kv_caches = kv_caches
        try:
            with torch.inference_mode():  # as the steps run
                for size in reversed(self.sizes):  # the largest first: the smaller ones fit in its memory
                    self.steps[size] = self.capture(self._step(size))
        except Exception as error:  # any failure of a capture: the eager path still serves
            self.capture_error = f"{type(error).__name__}: {error}"
            self.buffers, self.steps = None, {}
            logger.warning("CUDA graphs: capture failed, decode steps run eagerly: %s", self.capture_error)

    def __call__(self, hidden: torch.Tensor, rotations: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 metas: Sequence[AttentionMetadata], kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.buffers is not None and kv_caches is self._kv_caches, "graphs hold the caches they captured"
        rows = hidden.shape[0]
        size = bucket_for(rows, self.sizes)
        assert size is not None
        self.buffers.fill(hidden, rotations, metas, size)
        out, residual = self.steps[size]()
        self.num_replays += 1
        return out[:rows], residual[:rows]

    def _step(self, size: int) -> Step:
        buffers = self.buffers
        assert buffers is not None and self._kv_caches is not None
        metas, caches = buffers.metadata(size), self._kv_caches
        hidden = buffers.hidden[:size]
        rotations = [(cos[:size], sin[:size]) for cos, sin in buffers.rotations]

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            return self._layers(hidden, rotations, metas, caches)

        return step

    def _layers(self, hidden: torch.Tensor, rotations: Sequence[tuple[torch.Tensor, torch.Tensor]],
                metas: Sequence[AttentionMetadata], kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        residual: torch.Tensor | None = None
        for layer, kv_cache, t, r in zip(self.layers, kv_caches, self.layer_tables, self.layer_rotations, strict=True):
            cos, sin = rotations[r] if r != NO_ROTATION else (None, None)
            hidden, residual = layer.forward(hidden, residual, cos, sin, metas[t], kv_cache)
        assert residual is not None
        return hidden, residual
