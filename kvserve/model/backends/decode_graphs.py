"""Decode steps replayed from CUDA graphs: the CUDA backend's fused decode.

A small model's decode step on a GPU is bound by launching its kernels (hundreds per step), not by reading
its weights. A CUDA graph records a step's launches once and replays them with one call. A graph holds
fixed shapes and fixed addresses, so the step runs on persistent buffers:

- **Sizes**: graphs are captured for decode steps of 1, 2, 4, 8, 16, 24, ... rows (requests and their
  drafts) up to ``cuda_graph_max_rows``; a step is padded to the next captured size. All of them are
  captured together at start-up, once the KV caches exist, largest first, sharing one memory pool.
- **Buffers**: the hidden rows, rotary cos/sin, slot mapping, block table and sequence lengths, copied in
  each step, and for cascade decode the shared prefix's block ids and their count. The block table and the
  prefix are each as wide as ``cuda_graph_max_seq_len`` keys need; the decode kernel reads only a row's own
  blocks, the prefix programs past the prefix's blocks (all of them, in a step without one) exit at once,
  and the merge reads only the splits that hold keys.
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

from kvserve.model.backends.base import AttentionMetadata
from kvserve.model.backends.triton_attention import SharedPrefix, TritonAttentionMetadata

logger = logging.getLogger(__name__)

PADDING_SLOT = -1
WARMUP_RUNS = 2  # before a capture: Triton compiles its kernels, torch settles its workspaces

Step = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # -> (hidden, residual) after the last layer


class DecoderStep(Protocol):
    """One decoder layer's forward, as the model's layers run it."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


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
class StepBuffers:
    """What a captured step reads, at the largest size; a size's step reads their first rows."""

    hidden: torch.Tensor  # [rows, hidden]
    cos: torch.Tensor  # [rows, 1, head_dim]
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # int64 [rows]
    block_table: torch.Tensor  # int32 [rows, table_width]
    seq_lens: torch.Tensor  # int32 [rows]
    shared_prefix: SharedPrefix | None  # block ids [table_width] and their count; None: no cascade decode

    @classmethod
    def allocate(cls, rows: int, hidden_size: int, head_dim: int, table_width: int, dtype: torch.dtype,
                 device: torch.device, cascade: bool) -> StepBuffers:
        """Every row a padding row: no KV written, one key read; no shared prefix."""
        prefix = (SharedPrefix(torch.zeros(table_width, dtype=torch.int32, device=device),
                               torch.zeros(1, dtype=torch.int32, device=device)) if cascade else None)
        return cls(hidden=torch.zeros((rows, hidden_size), dtype=dtype, device=device),
                   cos=torch.zeros((rows, 1, head_dim), dtype=dtype, device=device),
                   sin=torch.zeros((rows, 1, head_dim), dtype=dtype, device=device),
                   slot_mapping=torch.full((rows,), PADDING_SLOT, dtype=torch.long, device=device),
                   block_table=torch.zeros((rows, table_width), dtype=torch.int32, device=device),
                   seq_lens=torch.ones(rows, dtype=torch.int32, device=device), shared_prefix=prefix)

    def fill(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
             size: int) -> None:
        """This step's rows, then padding rows up to ``size``: no KV written, one key read."""
        n = hidden.shape[0]
        assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
        self.hidden[:n].copy_(hidden)
        self.cos[:n].copy_(cos)
        self.sin[:n].copy_(sin)
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


class DecodeGraphs:
    """The decoder layers of decode steps, replayed from captured graphs (``FusedDecode``)."""

    def __init__(self, layers: Sequence[DecoderStep], hidden_size: int, head_dim: int, max_rows: int,
                 max_seq_len: int, capture: GraphCapture, cascade: bool = False) -> None:
        self.layers = list(layers)
        self.cascade = cascade  # the steps read a shared prefix's blocks once (a buffer for its ids)
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

    def accepts(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        table = meta.decode_block_table
        prefix = getattr(meta, "decode_shared_prefix", None)
        return (self.buffers is not None and meta.num_decode_tokens == hidden.shape[0] and not meta.prefills
                and meta.window is None and meta.decode_prefix_blocks is None and table is not None
                and bucket_for(hidden.shape[0], self.sizes) is not None and table.shape[1] <= self.table_width
                and (prefix is None or (self.cascade and prefix.block_ids.shape[0] <= self.table_width)))

    def prepare(self, kv_caches: list[torch.Tensor]) -> None:
        """Every size's step captured on the buffers (whose padding rows write nothing to the caches). A
        capture that fails leaves every step eager, with a warning: serving goes on, slower."""
        cache = kv_caches[0]  # [2, blocks, block_size, kv_heads, head_dim], in the model's dtype
        self.table_width = -(-self.max_seq_len // cache.shape[2])
        self.buffers = StepBuffers.allocate(self.sizes[-1], self.hidden_size, self.head_dim, self.table_width,
                                            cache.dtype, cache.device, self.cascade)
        self._kv_caches = kv_caches
        try:
            with torch.inference_mode():  # as the steps run
                for size in reversed(self.sizes):  # the largest first: the smaller ones fit in its memory
                    self.steps[size] = self.capture(self._step(size))
        except Exception as error:  # any failure of a capture: the eager path still serves
            self.capture_error = f"{type(error).__name__}: {error}"
            self.buffers, self.steps = None, {}
            logger.warning("CUDA graphs: capture failed, decode steps run eagerly: %s", self.capture_error)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.buffers is not None and kv_caches is self._kv_caches, "graphs hold the caches they captured"
        rows = hidden.shape[0]
        size = bucket_for(rows, self.sizes)
        assert size is not None
        self.buffers.fill(hidden, cos, sin, meta, size)
        out, residual = self.steps[size]()
        self.num_replays += 1
        return out[:rows], residual[:rows]

    def _step(self, size: int) -> Step:
        buffers = self.buffers
        assert buffers is not None and self._kv_caches is not None
        meta, caches = buffers.metadata(size), self._kv_caches
        hidden, cos, sin = buffers.hidden[:size], buffers.cos[:size], buffers.sin[:size]

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            return self._layers(hidden, cos, sin, meta, caches)

        return step

    def _layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer.forward(hidden, residual, cos, sin, meta, kv_cache)
        assert residual is not None
        return hidden, residual
