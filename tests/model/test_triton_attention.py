"""The CUDA backend's Triton attention kernels, run by Triton's interpreter on CPU tensors, against float64
references and against the torch reference attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.triton_interpreter import load_cuda_backend, triton_interpreter  # noqa: F401

load_cuda_backend()

from kvserve.arch import ArchConfig  # noqa: E402
from kvserve.config import BackendConfig  # noqa: E402
from kvserve.model.attention import TorchPagedAttention  # noqa: E402
from kvserve.model.backends import triton_attention  # noqa: E402
from kvserve.model.backends.base import PrefillChunk, StepRows  # noqa: E402
from kvserve.model.backends.cuda import CudaBackend, prefill_tables  # noqa: E402
from kvserve.model.backends.torch_ref import TorchRefBackend  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")
BLOCK_SIZE = 16


def random_cache(num_blocks: int, kv_heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, dim).to(dtype)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
              scale: float) -> torch.Tensor:
    """q [Q, H, D], keys/values [K, H_kv, D], visible [Q, K] bool -> [Q, H, D] in float64."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, K, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.double().transpose(0, 1) @ k.transpose(1, 2)) * scale  # [H, Q, K]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)


def keys_of(cache: torch.Tensor, blocks: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache[0][blocks].flatten(0, 1)[:n], cache[1][blocks].flatten(0, 1)[:n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 32), (4, 4, 16), (4, 1, 64)])
@pytest.mark.parametrize("split_blocks", [2, 16])  # several splits to merge; one split
def test_paged_decode_matches_reference(monkeypatch, dtype, heads, kv_heads, dim, split_blocks) -> None:
    monkeypatch.setattr(triton_attention, "DECODE_SPLIT_BLOCKS", split_blocks)
    torch.manual_seed(heads + dim)
    cache = random_cache(40, kv_heads, dim, dtype)
    lens = [1, 16, 17, 70]
    max_blocks = -(-max(lens) // BLOCK_SIZE)
    order = torch.randperm(40).tolist()
    tables = [order[i * max_blocks:(i + 1) * max_blocks] for i in range(len(lens))]
    q = torch.randn(len(lens), heads, dim).to(dtype)
    scale = dim**-0.5
    out = triton_attention.paged_decode(q, cache[0], cache[1], torch.tensor(tables, dtype=torch.int32),
                                        torch.tensor(lens, dtype=torch.int32), scale)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        keys, values = keys_of(cache, tables[i], n)
        expected = reference(q[i : i + 1], keys, values, torch.ones(1, n, dtype=torch.bool), scale)
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_matches_reference(dtype) -> None:
    """Chunks from position 0 and on cached history, longer than a tile, grouped-query heads."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 32
    cache = random_cache(32, kv_heads, dim, dtype)
    order = torch.randperm(32).tolist()
    # (q_len, kv_len): a fresh prompt, a chunk on 20 cached keys, a one-row chunk at a block's edge
    shapes = [(5, 5), (19, 39), (1, 33)]
    chunks, start, used = [], 0, 0
    for q_len, kv_len in shapes:
        n_blocks = -(-kv_len // BLOCK_SIZE)
        chunks.append(PrefillChunk(start, q_len, kv_len, order[used : used + n_blocks]))
        start, used = start + q_len, used + n_blocks
    q = torch.randn(start, heads, dim).to(dtype)
    rows = StepRows(BLOCK_SIZE, torch.zeros(start, dtype=torch.long), prefills=chunks)
    out = torch.zeros_like(q)
    scale = dim**-0.5
    tables = prefill_tables(rows, torch.device("cpu"))
    assert tables is not None
    triton_attention.paged_prefill(q, cache[0], cache[1], out, tables, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for chunk in chunks:
        keys, values = keys_of(cache, chunk.block_ids, chunk.kv_len)
        positions = torch.arange(chunk.kv_len - chunk.q_len, chunk.kv_len)[:, None]
        visible = torch.arange(chunk.kv_len)[None, :] <= positions
        rows_ = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        torch.testing.assert_close(out[rows_].double(), reference(q[rows_], keys, values, visible, scale),
                                   atol=tol, rtol=tol)


def test_a_mixed_step_matches_the_torch_reference_attention() -> None:
    """A layer's forward with decode rows and two prefill chunks: the Triton attention (with the CUDA
    backend's metadata, here on CPU) against the torch reference's (with its own), K/V written into the
    cache alike."""
    torch.manual_seed(1)
    arch = ArchConfig("llama", vocab_size=8, hidden_size=64, intermediate_size=16, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    backend = CudaBackend(arch, torch.device("cpu"), BackendConfig())
    heads, kv_heads, dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
    cache = random_cache(24, kv_heads, dim, torch.float32)
    # Two decode rows (20 and 33 keys), then chunks: 7 fresh rows, and 9 rows on 16 cached keys.
    decode_tables, decode_lens = [[3, 4], [5, 6, 7]], [20, 33]
    chunks = [PrefillChunk(2, 7, 7, [8]), PrefillChunk(9, 9, 25, [9, 10])]
    slots = [4 * BLOCK_SIZE + 3, 7 * BLOCK_SIZE + 0, *range(8 * BLOCK_SIZE, 8 * BLOCK_SIZE + 7),
             *range(10 * BLOCK_SIZE + 0, 10 * BLOCK_SIZE + 9)]
    rows = StepRows(BLOCK_SIZE, torch.tensor(slots), decode_block_ids=decode_tables, decode_kv_lens=decode_lens,
                    prefills=chunks)
    q, k, v = torch.randn(18, heads, dim), torch.randn(18, kv_heads, dim), torch.randn(18, kv_heads, dim)
    reference_layer = TorchPagedAttention(heads, kv_heads, dim)
    reference_meta = TorchRefBackend(arch, torch.device("cpu"), BackendConfig()).build_metadata(rows)
    expected = reference_layer.forward(q, k, v, cache.clone(), reference_meta)
    got = backend.make_attention(0).forward(q, k, v, cache.clone(), backend.build_metadata(rows))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_kv_write_skips_padding_rows_and_reads_rows_of_any_stride() -> None:
    """Rows of a wider tensor (as K and V are views of the QKV projection's output) into their slots; a
    negative slot (a CUDA graph's padding row) writes nothing."""
    torch.manual_seed(2)
    kv_heads, dim = 2, 16
    cache = random_cache(4, kv_heads, dim, torch.float32)
    qkv = torch.randn(4, 3 * kv_heads, dim)
    k, v = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    slots = torch.tensor([5, -1, 40, -1])
    expected = cache.clone()
    expected[0].view(-1, kv_heads, dim)[[5, 40]] = k[[0, 2]]
    expected[1].view(-1, kv_heads, dim)[[5, 40]] = v[[0, 2]]
    triton_attention.write_kv(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache, expected)


def test_prefill_reads_queries_of_a_wider_row_stride() -> None:
    """q a view of the rotated Q and K heads (a row stride past its own heads), the output contiguous."""
    torch.manual_seed(3)
    heads, kv_heads, dim = 4, 2, 16
    cache = random_cache(4, kv_heads, dim, torch.float32)
    qk = torch.randn(9, heads + kv_heads, dim)
    chunk = PrefillChunk(0, 9, 9, [2])
    tables = prefill_tables(StepRows(BLOCK_SIZE, torch.zeros(9, dtype=torch.long), prefills=[chunk]),
                            torch.device("cpu"))
    assert tables is not None
    out = torch.zeros(9, heads, dim)
    triton_attention.paged_prefill(qk[:, :heads], cache[0], cache[1], out, tables, dim**-0.5)
    keys, values = keys_of(cache, [2], 9)
    visible = torch.arange(9)[None, :] <= torch.arange(9)[:, None]
    torch.testing.assert_close(out.double(), reference(qk[:, :heads], keys, values, visible, dim**-0.5),
                               atol=1e-5, rtol=1e-5)


def test_a_table_padded_wider_gives_the_same_decode(monkeypatch) -> None:
    """A CUDA graph's block table is as wide as its longest sequence allows: the splits past a row's keys are
    neither computed nor merged, and the output is bit for bit the tight table's."""
    monkeypatch.setattr(triton_attention, "DECODE_SPLIT_BLOCKS", 2)
    torch.manual_seed(4)
    cache = random_cache(40, 2, 32, torch.float32)
    tables, lens = [[3, 9, 4], [7, 1, 0]], torch.tensor([40, 17], dtype=torch.int32)
    q = torch.randn(2, 6, 32)
    tight = triton_attention.paged_decode(q, cache[0], cache[1], torch.tensor(tables, dtype=torch.int32), lens, 0.2)
    wide_table = torch.tensor([row + [39] * 9 for row in tables], dtype=torch.int32)  # 6 splits, 2 used at most
    wide = triton_attention.paged_decode(q, cache[0], cache[1], wide_table, lens, 0.2)
    assert torch.equal(wide, tight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_with_a_window_reads_only_its_keys(monkeypatch, dtype) -> None:
    """Each row sees its last ``window`` keys; the blocks wholly before them are not read (they hold NaN
    here, as a freed window page may hold anything), over several splits counted from the window."""
    monkeypatch.setattr(triton_attention, "DECODE_SPLIT_BLOCKS", 2)
    torch.manual_seed(5)
    window, lens = 20, [7, 20, 21, 70]
    cache = random_cache(40, 2, 32, dtype)
    cache[:, 0] = float("nan")  # the page a freed block's table entry points to
    order = torch.randperm(39).add(1).tolist()
    tables = []
    for i, n in enumerate(lens):
        own = order[5 * i : 5 * i + 5]
        first_seen = max(0, n - window) // BLOCK_SIZE
        tables.append([0] * first_seen + own[first_seen:])
    q = torch.randn(len(lens), 6, 32).to(dtype)
    out = triton_attention.paged_decode(q, cache[0], cache[1], torch.tensor(tables, dtype=torch.int32),
                                        torch.tensor(lens, dtype=torch.int32), 0.2, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        keys, values = keys_of(cache, tables[i], n)
        visible = (torch.arange(n) >= n - window)[None, :]
        expected = reference(q[i : i + 1], keys.nan_to_num(), values.nan_to_num(), visible, 0.2)
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=tol, rtol=tol)


def test_paged_prefill_with_a_window() -> None:
    """A chunk on cached history longer than the window, and a fresh one: each row sees the keys within the
    window behind it; a tile's later rows start past blocks its first row still sees."""
    torch.manual_seed(6)
    heads, kv_heads, dim, window = 4, 2, 16, 11
    cache = random_cache(16, kv_heads, dim, torch.float32)
    chunks = [PrefillChunk(0, 21, 50, [3, 4, 5, 6]), PrefillChunk(21, 13, 13, [7])]
    q = torch.randn(34, heads, dim)
    tables = prefill_tables(StepRows(BLOCK_SIZE, torch.zeros(34, dtype=torch.long), prefills=chunks),
                            torch.device("cpu"))
    assert tables is not None
    out = torch.zeros_like(q)
    triton_attention.paged_prefill(q, cache[0], cache[1], out, tables, 0.25, window)
    for chunk in chunks:
        keys, values = keys_of(cache, chunk.block_ids, chunk.kv_len)
        positions = torch.arange(chunk.kv_len - chunk.q_len, chunk.kv_len)[:, None]
        key_positions = torch.arange(chunk.kv_len)[None, :]
        visible = (key_positions <= positions) & (key_positions > positions - window)
        rows_ = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        torch.testing.assert_close(out[rows_].double(), reference(q[rows_], keys, values, visible, 0.25),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_decode_reads_the_shared_prefix_once_for_every_row(monkeypatch, dtype) -> None:
    """Six requests (18 query rows of each KV head: two tiles) sharing a prefix of three blocks (two key splits)
    before their own keys (none, one, a block and more), the prefix's buffer wider than the prefix with NaN
    pages past it (never read): each row as if it read the prefix and its own keys in one table."""
    monkeypatch.setattr(triton_attention, "PREFIX_SPLIT_BLOCKS", 2)
    monkeypatch.setattr(triton_attention, "DECODE_SPLIT_BLOCKS", 2)
    monkeypatch.setattr(triton_attention, "MAX_PREFIX_TILE_ROWS", 16)
    torch.manual_seed(7)
    heads, kv_heads, dim, scale = 6, 2, 32, 0.2
    cache = random_cache(40, kv_heads, dim, dtype)
    cache[:, 39] = float("nan")
    prefix_blocks, own_lens = [5, 2, 11], [0, 1, 7, 16, 17, 40]
    order = [b for b in range(1, 39) if b not in prefix_blocks]
    own_tables = [order[3 * i : 3 * i + 3] for i in range(len(own_lens))]
    prefix = triton_attention.SharedPrefix(torch.tensor([*prefix_blocks, 39, 39, 39], dtype=torch.int32),
                                           torch.tensor([len(prefix_blocks)], dtype=torch.int32))
    q = torch.randn(len(own_lens), heads, dim).to(dtype)
    out = triton_attention.paged_decode(q, cache[0], cache[1], torch.tensor(own_tables, dtype=torch.int32),
                                        torch.tensor(own_lens, dtype=torch.int32), scale, prefix=prefix)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    whole_lens = [len(prefix_blocks) * BLOCK_SIZE + n for n in own_lens]
    for i, n in enumerate(whole_lens):
        keys, values = keys_of(cache, prefix_blocks + own_tables[i], n)
        expected = reference(q[i : i + 1], keys, values, torch.ones(1, n, dtype=torch.bool), scale)
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=tol, rtol=tol)
    # A step without a prefix on the same buffer (its count 0): every row reads its own table only.
    prefix.num_blocks.zero_()
    tables, lens = torch.tensor(own_tables[1:], dtype=torch.int32), torch.tensor(own_lens[1:], dtype=torch.int32)
    alone = triton_attention.paged_decode(q[1:], cache[0], cache[1], tables, lens, scale)
    without = triton_attention.paged_decode(q[1:], cache[0], cache[1], tables, lens, scale, prefix=prefix)
    torch.testing.assert_close(without, alone, atol=tol, rtol=tol)


def test_the_cuda_backend_splits_a_shared_prefix_off_unless_a_window_layer_reads_the_tables() -> None:
    """Three decode rows sharing two full blocks: the prefix split off when it is long enough; never for a
    model with sliding-window layers (a freed window page is shared by every row too)."""
    rows = StepRows(BLOCK_SIZE, torch.tensor([0, 1, 2]), decode_block_ids=[[4, 6, 1], [4, 6, 2], [4, 6, 3, 7]],
                    decode_kv_lens=[40, 35, 50], num_decode_requests=3)
    arch = ArchConfig("llama", vocab_size=8, hidden_size=64, intermediate_size=16, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    meta = CudaBackend(arch, torch.device("cpu"), BackendConfig(cascade_min_tokens=32)).build_metadata(rows)
    assert meta.decode_shared_prefix is not None and meta.decode_shared_prefix.block_ids.tolist() == [4, 6]
    assert meta.decode_shared_prefix.num_blocks.tolist() == [2]
    assert meta.decode_seq_lens.tolist() == [8, 3, 18] and meta.decode_block_table.tolist() == [[1, 0], [2, 0], [3, 7]]
    assert meta.decode_prefix_blocks is None  # not the reference's cascade
    assert CudaBackend(arch, torch.device("cpu"), BackendConfig(cascade_min_tokens=48)).build_metadata(
        rows).decode_shared_prefix is None
    windowed = dataclasses.replace(arch, sliding_window=8, sliding_layers=(0,))
    meta = CudaBackend(windowed, torch.device("cpu"), BackendConfig(cascade_min_tokens=32)).build_metadata(rows)
    assert meta.decode_shared_prefix is None and meta.decode_seq_lens.tolist() == [40, 35, 50]
