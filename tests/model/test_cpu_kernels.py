"""The C++ CPU kernels against the torch reference: paged decode attention, its cascade merge, bf16 GEMV,
the many-row attention kernels at every head size they take, and the fused decode stack against the layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.config import ArchConfig, BackendConfig
from kvserve.model.attention import TorchAttentionMetadata, TorchPagedAttention, merge_by_lse
from kvserve.model.backends.cpu_attention import CpuAttentionMetadata, CpuKernelPagedAttention, PagedRuns
from kvserve.model.backends.cpu_kernels import CpuKernelsBackend, plan_kernels
from kvserve.model.backends.cpu_ops import DecodeRows, PackedGateUpSilu, PackedKernels, PackedLinear
from kvserve.model.backends.select import select_backend
from kvserve.model.backends.torch_ref import TorchRefBackend
from kvserve.model.cpu_kernels import CpuKernels, load_cpu_kernels
from kvserve.model.ops import torch_add_rms_norm, torch_gelu_tanh_mul, torch_silu_mul

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernels did not build on this machine")
# What each packed projection family needs of the CPU; AMX machines run all three, Zen 4/5 the last two.
FAMILY_RUNS = {"amx": lambda k: k.amx, "bf16dot": lambda k: k.gemv_bf16 and k.avx512, "avx512": lambda k: k.avx512,
               "avx2": lambda k: k.avx2}
# The plan each family comes from: the kernels a CPU that has it (and nothing above it) offers.
FAMILY_CPUS = {"amx": CpuKernels(gemv_bf16=True, amx=True, avx512=True, avx2=True),
               "bf16dot": CpuKernels(gemv_bf16=True, amx=False, avx512=True, avx2=True),
               "avx512": CpuKernels(gemv_bf16=False, amx=False, avx512=True, avx2=True),
               "avx2": CpuKernels(gemv_bf16=False, amx=False, avx512=False, avx2=True)}
packed_families = [pytest.param(name, marks=pytest.mark.skipif(
    kernels is None or not runs(kernels), reason=f"no {name} on this CPU (or the kernel refused it)"))
    for name, runs in FAMILY_RUNS.items()]
# The many-row attention kernels: AMX, AVX-512 (which the BF16 dot-product family's CPUs run) and AVX2.
attention_families = [param for param in packed_families if param.values[0] in ("amx", "avx512", "avx2")]


def family(name: str) -> PackedKernels:
    return getattr(PackedKernels, name)()


def arch(heads: int = 9, kv_heads: int = 3, dim: int = 64) -> ArchConfig:
    return ArchConfig("llama", vocab_size=256, hidden_size=heads * dim, intermediate_size=256, num_layers=2,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, max_position_embeddings=4096)


def kernel_backend(name: str | None, heads: int = 9, kv_heads: int = 3, dim: int = 64) -> CpuKernelsBackend:
    """The cpu_kernels backend as it plans for a bf16 model on a CPU whose many-row attention kernel is
    ``name`` ("amx", "avx512", "avx2"; None: this machine's)."""
    offered = {"amx": FAMILY_CPUS["amx"], "avx512": FAMILY_CPUS["avx512"], "avx2": FAMILY_CPUS["avx2"]}.get(name, kernels)
    shape = arch(heads, kv_heads, dim)
    return CpuKernelsBackend(plan_kernels(offered, torch.bfloat16, shape), shape, torch.device("cpu"),
                             BackendConfig())


def random_cache(num_blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, num_blocks, block_size, kv_heads, dim, dtype=dtype)


def reference_attention(q, k_cache, v_cache, table, lens, scale):
    """Gather, mask, softmax in float64: output and log-sum-exp per query head."""
    batch = q.shape[0]
    key = k_cache[table.long()].flatten(1, 2).transpose(1, 2).double()  # [B, H, L, D]
    value = v_cache[table.long()].flatten(1, 2).transpose(1, 2).double()
    scores = (q.double() @ key.transpose(2, 3)) * scale  # [B, H, G, L]
    mask = torch.arange(key.shape[2])[None, :] < lens[:, None].long()
    scores = scores.masked_fill(~mask.view(batch, 1, 1, -1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ value, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 256, 40])  # the vectorised head sizes and the portable loop
# group: query heads per KV head; the kernel takes them in runs of at most four (8 = 4 + 4, 7 = 4 + 3).
@pytest.mark.parametrize(("split_size", "group"), [(16, 3), (48, 3), (1024, 3), (48, 1), (48, 8), (48, 7)])
def test_paged_decode_matches_reference(dtype, dim, split_size, group) -> None:
    torch.manual_seed(dim + split_size + group)
    block_size, kv_heads, batch = 16, 2, 5
    cache = random_cache(128, block_size, kv_heads, dim, dtype)
    lens = torch.tensor([1, 16, 17, 200, 333], dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // block_size)
    table = torch.randperm(128)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    q = torch.randn(batch, kv_heads, group, dim, dtype=dtype)
    out, lse = torch.ops.kvserve.paged_decode(q, cache[0], cache[1], table, lens, dim**-0.5, split_size)
    ref_out, ref_lse = reference_attention(q, cache[0], cache[1], table, lens, dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_size", [48, 256])
def test_a_sequences_attention_does_not_depend_on_the_batch_beside_it(dtype, split_size) -> None:
    """A sequence's key splits follow its own length, not the batch's: alone (where its splits shorten so that
    every thread has work) and beside longer and shorter ones, bit for bit the same output and log-sum-exp,
    so a request's drafts verified beside it, or other requests, change none of its logits."""
    torch.manual_seed(split_size)
    block_size, kv_heads, dim = 16, 2, 64
    cache = random_cache(128, block_size, kv_heads, dim, dtype)
    lens = torch.tensor([40, 1, 333, 40, 17, 200], dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // block_size)
    table = torch.randperm(128)[: len(lens) * max_blocks].view(len(lens), max_blocks).to(torch.int32)
    q = torch.randn(len(lens), kv_heads, 3, dim, dtype=dtype)
    out, lse = torch.ops.kvserve.paged_decode(q, cache[0], cache[1], table, lens, dim**-0.5, split_size)
    for b in range(len(lens)):
        alone, alone_lse = torch.ops.kvserve.paged_decode(q[b : b + 1], cache[0], cache[1], table[b : b + 1],
                                                          lens[b : b + 1], dim**-0.5, split_size)
        assert torch.equal(out[b : b + 1], alone) and torch.equal(lse[b : b + 1], alone_lse)
    # The first sequence's drafts: the same block table, one key longer each.
    rows = torch.tensor([40, 41, 42, 43], dtype=torch.int32)
    together, _ = torch.ops.kvserve.paged_decode(q[:1].expand(4, -1, -1, -1).contiguous(), cache[0], cache[1],
                                                 table[:1].expand(4, -1).contiguous(), rows, dim**-0.5, split_size)
    assert torch.equal(together[:1], out[:1])


def test_empty_sequence_gives_zero_output_and_minus_infinite_lse() -> None:
    """A request whose keys all live in the shared prefix has an empty suffix: it must not poison the merge."""
    cache = random_cache(4, 16, 1, 64, torch.float32)
    q = torch.randn(2, 1, 2, 64)
    lens = torch.tensor([0, 5], dtype=torch.int32)
    out, lse = torch.ops.kvserve.paged_decode(q, cache[0], cache[1], torch.zeros(2, 1, dtype=torch.int32), lens,
                                              0.125, 256)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()


def test_sequence_longer_than_its_table_is_refused() -> None:
    cache = random_cache(4, 16, 1, 64, torch.float32)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        torch.ops.kvserve.paged_decode(torch.randn(1, 1, 1, 64), cache[0], cache[1],
                                       torch.zeros(1, 1, dtype=torch.int32), torch.tensor([17], dtype=torch.int32),
                                       0.125, 256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared_blocks", [0, 3])
def test_kernel_backend_decode_matches_torch_backend(dtype, shared_blocks) -> None:
    """The whole decode path (cascade merge included) against the reference backend on one paged cache."""
    torch.manual_seed(shared_blocks)
    heads, kv_heads, dim, block_size, batch = 6, 2, 64, 16, 4
    cache = random_cache(40, block_size, kv_heads, dim, dtype)
    lens = [shared_blocks * block_size + extra for extra in (1, 16, 30, 70)]
    if shared_blocks:
        lens[1] = shared_blocks * block_size  # all of this request's keys are shared: empty suffix
    tables = [list(range(shared_blocks)) + list(range(shared_blocks + 8 * i, shared_blocks + 8 * i + 8))
              for i in range(batch)]
    suffix = [length - shared_blocks * block_size for length in lens]
    max_blocks = -(-max(suffix) // block_size)
    table = torch.tensor([t[shared_blocks : shared_blocks + max_blocks] for t in tables], dtype=torch.int32)
    mask = (torch.arange(max_blocks * block_size)[None, :] < torch.tensor(suffix)[:, None])[:, None, None, :]
    layout = dict(
        slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=batch, decode_block_table=table,
        decode_seq_lens=torch.tensor(suffix, dtype=torch.int32),
        decode_prefix_blocks=torch.arange(shared_blocks) if shared_blocks else None,
    )
    q = torch.randn(batch, heads, dim, dtype=dtype)
    empty = torch.empty(0, kv_heads, dim, dtype=dtype)
    expected = TorchPagedAttention(heads, kv_heads, dim).forward(q, empty, empty, cache,
                                                                 TorchAttentionMetadata(**layout, decode_mask=mask))
    got = CpuKernelPagedAttention(heads, kv_heads, dim).forward(q, empty, empty, cache, CpuAttentionMetadata(**layout))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(kernels is None or not kernels.gemv_bf16, reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 576, 576), (2, 77, 100), (4, 1536, 576),
                                                                   (7, 33, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_bf16_matches_float_matmul(rows, out_features, in_features, with_bias) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
    got = torch.ops.kvserve.gemv_bf16(x, weight, bias)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # fp32 accumulation, one bf16 rounding of the result: within bf16's relative precision (2^-8).
    torch.testing.assert_close(got.double(), expected, atol=1e-2 * expected.abs().max().item(), rtol=2**-7)


def test_decode_rows_route_narrow_inputs_to_the_kernel() -> None:
    rows_seen = []
    ops = DecodeRows(lambda x, w, b: rows_seen.append(x.shape[0]) or F.linear(x, w, b), F.linear, max_rows=2)
    weight = torch.randn(8, 16)
    for rows in (1, 2, 3, 64):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(ops(x, weight, None), F.linear(x, weight))
    assert rows_seen == [1, 2]


@pytest.mark.parametrize("rows", [1, 3, 130])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [576, 40])  # vector body only; vector body plus a scalar tail
def test_add_rms_norm_matches_torch(rows, with_residual, hidden) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, hidden, dtype=torch.bfloat16) * 3
    residual = torch.randn(rows, hidden, dtype=torch.bfloat16) if with_residual else None
    weight = torch.rand(hidden, dtype=torch.bfloat16) + 0.5
    normed, summed = torch.ops.kvserve.add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_summed = torch_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, expected_summed)
    # Same two bf16 roundings; the fp32 sum of squares may differ in order, which can move each rounding
    # by one step.
    torch.testing.assert_close(normed.float(), expected_normed.float(), atol=0, rtol=2**-6)


@pytest.mark.parametrize("width", [1536, 37])  # vector body only; vector body plus a scalar tail
def test_silu_mul_matches_torch(width) -> None:
    gate_up = torch.randn(5, 2 * width, dtype=torch.bfloat16) * 4
    torch.testing.assert_close(torch.ops.kvserve.silu_mul(gate_up).float(), torch_silu_mul(gate_up).float(),
                               atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("width", [1024, 37])  # vector body only; vector body plus a scalar tail
def test_gelu_tanh_mul_matches_torch(width) -> None:
    # Gates from far negative (GELU ~ 0) to far positive (GELU ~ g): the exp form must not overflow either way.
    gate = torch.linspace(-12, 12, 7 * width).view(7, width)
    gate_up = torch.cat((gate, torch.randn(7, width) * 3), dim=-1).to(torch.bfloat16)
    # One bf16 rounding of the activation, one of the product: the exp form may move each by one step.
    torch.testing.assert_close(torch.ops.kvserve.gelu_tanh_mul(gate_up).float(),
                               torch_gelu_tanh_mul(gate_up).float(), atol=1e-6, rtol=2**-6)


@pytest.mark.skipif(kernels is None or not kernels.amx, reason="no AMX on this CPU (or the kernel refused it)")
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 45, 140, 177, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (48, 64), (96, 576), (576, 1536)])
def test_amx_linear_matches_float_matmul(rows, out_features, in_features) -> None:
    """1 or 2 row tiles, with 1-4 weight column blocks per task (48 = 3 blocks leaves a ragged task); from
    128 rows the blocked path: a last chunk of 12 (140) or 17 (177) rows, two row tasks (300), depths of
    one, two and six blocks (1,536 = 5 x 288 + 96)."""
    torch.manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    packed = torch.ops.kvserve.amx_pack(weight)
    got = torch.ops.kvserve.amx_linear(x, packed, bias)
    expected = F.linear(x.double(), weight.double(), bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    torch.testing.assert_close(got.double(), expected, atol=1e-2 * expected.abs().max().item(), rtol=2**-7)


@pytest.mark.parametrize("name", packed_families)
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (576, 1536)])
def test_packed_linear_rows_do_not_depend_on_the_batch(name, out_features, in_features) -> None:
    """AMX: many rows take the blocked path, a few the per-task one; AVX-512: rows go in micro-tiles of up
    to twelve. A row's output is bit-identical either way (the same multiplies in the same order; AMX's fp32
    round trips between depth blocks are exact), so a token's result does not depend on what else is in
    the step."""
    torch.manual_seed(out_features)
    kernels_ = family(name)
    x = torch.randn(300, in_features, dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    packed = kernels_.pack(weight)
    whole = kernels_.linear(x, packed, bias)
    for start, stop in ((0, 16), (16, 48), (280, 300), (299, 300), (5, 18)):
        assert torch.equal(whole[start:stop], kernels_.linear(x[start:stop], packed, bias))


@pytest.mark.parametrize("name", packed_families)
@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 576, 576), (3, 960, 576), (13, 48, 1536), (100, 16, 64), (257, 1552, 578)])
def test_packed_linear_matches_an_fp32_reference(name, rows, out_features, in_features) -> None:
    """Every product of two bf16 values is exact in fp32 and the sums stay fp32: the output is the fp32
    product rounded once, up to the order of the additions. 1,552 columns end in a lone block of 16; 578 is
    not a multiple of 32 (AVX-512 only: AMX needs whole 32-deep tiles)."""
    if in_features % family(name).depth_multiple:
        pytest.skip(f"{name} packs only depths that are multiples of {family(name).depth_multiple}")
    torch.manual_seed(rows + out_features)
    kernels_ = family(name)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    got = kernels_.linear(x.view(1, rows, in_features), kernels_.pack(weight), bias)
    assert got.shape == (1, rows, out_features) and got.dtype == torch.bfloat16
    reference = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(got[0].double(), reference, atol=1e-3, rtol=2**-8)  # one bf16 rounding


@pytest.mark.parametrize("name", packed_families)
@pytest.mark.parametrize("rows", [1, 2, 16, 17, 45, 140, 300])
@pytest.mark.parametrize("intermediate", [32, 48, 1536])
def test_fused_gate_up_silu_is_bit_identical_to_the_unfused_pair(name, rows, intermediate) -> None:
    """Few rows and the blocked path; 48 columns = 3 gate/up pairs, a ragged four-block task."""
    torch.manual_seed(rows + intermediate)
    kernels_ = family(name)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    weight = torch.randn(2 * intermediate, 576, dtype=torch.bfloat16) * 0.1  # [gate | up]
    fused = PackedGateUpSilu(kernels_, fallback=lambda *_: pytest.fail("the fused kernel should take these"))
    fused.prepare(weight)
    unfused = torch.ops.kvserve.silu_mul(kernels_.linear(x, kernels_.pack(weight), None))
    assert torch.equal(fused(x, weight), unfused)
    torch.testing.assert_close(fused(x, weight).float(), torch_silu_mul(F.linear(x.float(), weight.float())),
                               atol=0.05, rtol=0.02)


@pytest.mark.skipif(kernels is None or not kernels.amx, reason="no AMX on this CPU (or the kernel refused it)")
def test_model_ops_route_gate_up_silu_by_rows_and_weight() -> None:
    """One row takes the GEMV and silu_mul; a weight the kernel cannot interleave (rows not a multiple of
    32) gets the plain projection's packing and takes the unfused pair at every width; the results agree
    with the reference either way."""
    ops = select_backend(torch.device("cpu"), torch.bfloat16, arch(), True, BackendConfig()).ops
    packable = torch.randn(64, 64, dtype=torch.bfloat16) * 0.1
    odd = torch.randn(48, 64, dtype=torch.bfloat16) * 0.1
    ops.prepare_gate_up(packable)
    ops.prepare_gate_up(odd)
    assert list(ops.fused_gate_up_silu.dense.packed) == [packable.data_ptr()]
    assert list(ops.linear.dense.wider.packed) == [odd.data_ptr()]  # the unfused pair keeps the AMX projection
    for weight in (packable, odd):
        for rows in (1, 2, 200):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            torch.testing.assert_close(ops.gate_up_silu(x, weight).float(),
                                       torch_silu_mul(F.linear(x.float(), weight.float())), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("name", [param for param in packed_families if param.values[0] != "amx"])
def test_model_ops_take_the_packed_kernels_at_every_width_without_amx(name) -> None:
    """Without AMX the plan's family (BF16 dot products where the CPU has them, else the widening AVX-512
    kernel, else the AVX2 one) takes every width, one row included, and the fused stack runs on it where the
    CPU has a many-row attention kernel (AVX-512)."""
    backend = CpuKernelsBackend(plan_kernels(FAMILY_CPUS[name], torch.bfloat16, arch()), arch(),
                                torch.device("cpu"), BackendConfig())
    ops = backend.ops
    # Behind the quantised kernels where the CPU runs quantised weights packed (AVX-512)
    linear = ops.linear.dense if backend.plan.quantized_gemv_max_rows is not None else ops.linear
    assert isinstance(linear, PackedLinear) and linear.kernels.name == name
    assert backend.plan.fused_decode and backend.plan.gemv_max_rows == 0
    weight = torch.randn(64, 64, dtype=torch.bfloat16) * 0.1
    ops.prepare_weight(weight)
    ops.prepare_gate_up(weight)
    for rows in (1, 2, 200):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(ops.gate_up_silu(x, weight).float(),
                                   torch_silu_mul(F.linear(x.float(), weight.float())), atol=0.05, rtol=0.02)
        assert torch.equal(ops.linear(x, weight, None), getattr(torch.ops.kvserve, f"{name}_linear")(
            x, linear.packed[weight.data_ptr()], None))


@pytest.mark.parametrize("name", packed_families)
def test_packed_linear_falls_back_for_weights_it_cannot_pack(name) -> None:
    linear = PackedLinear(family(name), fallback=F.linear)
    weight = torch.randn(32, 64, dtype=torch.bfloat16)
    odd = torch.randn(10, 64, dtype=torch.bfloat16)  # 10 rows: not a whole block, stays unpacked
    linear.prepare(weight)
    linear.prepare(odd)
    assert list(linear.packed) == [weight.data_ptr()]
    for rows in (1, 32, 33, 100):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(linear(x, weight).float(), F.linear(x, weight).float(), atol=0.1, rtol=0.02)
        torch.testing.assert_close(linear(x, odd).float(), F.linear(x, odd).float(), atol=0.1, rtol=0.02)


@pytest.mark.parametrize("dim", [64, 40])  # vector path (half a multiple of 16); scalar path
def test_rotary_matches_torch_exactly_on_strided_rows(dim) -> None:
    """Q and K arrive as a view into the fused QKV output (strided rows), as in the model."""
    from kvserve.model.layers import RotaryEmbedding, apply_rotary

    torch.manual_seed(dim)
    tokens, heads = 7, 5
    qkv = torch.randn(tokens, (heads + 2) * dim, dtype=torch.bfloat16) * 3
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)
    rope = RotaryEmbedding(dim, 4096, 10000.0, torch.bfloat16, torch.device("cpu"))
    cos, sin = rope.lookup(torch.tensor([0, 1, 5, 17, 300, 2047, 4095]))
    assert torch.equal(torch.ops.kvserve.rotary(qk, cos, sin), apply_rotary(qk, cos, sin))


amx_only = pytest.mark.skipif(kernels is None or not kernels.amx, reason="no AMX on this CPU (or the kernel refused it)")


def reference_runs(q, k_cache, v_cache, tables, kv_lens, q_lens, scale, causal):
    """Each run's queries against its keys in float64; causal runs end at their last key."""
    group = q.shape[1] // k_cache.shape[2]
    outs, lses, start = [], [], 0
    for table, kv_len, q_len in zip(tables, kv_lens, q_lens, strict=True):
        key = k_cache[table].flatten(0, 1)[:kv_len].double().repeat_interleave(group, dim=1)  # [L, H, D]
        value = v_cache[table].flatten(0, 1)[:kv_len].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + q_len].double(), key) * scale
        if causal:
            positions = torch.arange(kv_len - q_len, kv_len)
            scores = scores.masked_fill(torch.arange(kv_len)[None, None, :] > positions[None, :, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), value))
        lses.append(torch.logsumexp(scores, -1).transpose(0, 1))
        start += q_len
    return torch.cat(outs), torch.cat(lses)


many_row_kernels = [pytest.param("paged_attention_amx", marks=amx_only), pytest.param(
    "paged_attention_avx512", marks=pytest.mark.skipif(kernels is None or not kernels.avx512, reason="no AVX-512")),
    pytest.param("paged_attention_avx2", marks=pytest.mark.skipif(kernels is None or not kernels.avx2,
                                                                  reason="no AVX2 and FMA"))]


# (query heads, KV heads, head size): SmolLM2's 3:1 at 64, Qwen2.5-Coder-1.5B's 6:1 at 128, Gemma 3 270M's
# 4:1 at 256, and the other ratios at each size.
HEAD_LAYOUTS = [(6, 2, 64), (12, 2, 64), (4, 1, 128), (12, 2, 128), (4, 1, 256), (6, 1, 256)]
LAYOUT_IDS = [f"{h}q{kv}kv-head{d}" for h, kv, d in HEAD_LAYOUTS]


@pytest.mark.parametrize("kernel", many_row_kernels)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), HEAD_LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fp32_out", [True, False])
def test_paged_attention_kernels_match_reference(kernel, heads, kv_heads, dim, causal, fp32_out) -> None:
    """Runs of every shape the row tiles and key steps meet: one token, partial tiles and key blocks, many
    tiles per work item, a query tensor with a token stride (Q and K heads side by side, as the model has).
    The AVX-512 and AVX2 kernels are the AMX one's stand-ins on CPUs without tiles: the same contract, fp32
    weights.
    At every head size the kernels take, with grouped-query ratios from 3:1 to 6:1."""
    torch.manual_seed(int(causal) * 2 + int(fp32_out) + dim + heads)
    block_size = 16
    cache = random_cache(200, block_size, kv_heads, dim, torch.bfloat16)
    cache[:, 150:] = float("nan")  # never-written blocks: padding reads of them must not leak into results
    shapes = [(1, 1), (5, 40), (17, 17), (33, 300), (16, 16), (250, 260)]  # (queries, keys)
    free = iter(torch.randperm(150).tolist())
    tables = [[next(free) for _ in range(-(-kv_len // block_size))] for _, kv_len in shapes]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [199] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = [q_len for q_len, _ in shapes]
    kv_lens = [kv_len for _, kv_len in shapes]
    q_starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads + kv_heads, dim, dtype=torch.bfloat16)[:, :heads]  # strided tokens
    out, lse = getattr(torch.ops.kvserve, kernel)(q, cache[0], cache[1], block_tables,
                                                  torch.tensor(kv_lens, dtype=torch.int32), q_starts,
                                                  dim**-0.5, causal, fp32_out)
    assert out.dtype == (torch.float32 if fp32_out else torch.bfloat16)
    ref_out, ref_lse = reference_runs(q, cache[0], cache[1], tables, kv_lens, q_lens, dim**-0.5, causal)
    tol = 2e-3 if fp32_out else 8e-3  # bf16 output: one rounding of values up to ~2
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kernel", many_row_kernels)
def test_paged_attention_kernels_refuse_head_sizes_they_do_not_take(kernel) -> None:
    cache = random_cache(4, 16, 1, 80, torch.bfloat16)
    q = torch.randn(2, 2, 80, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"D = 64, 128 or 256"):
        getattr(torch.ops.kvserve, kernel)(q, cache[0], cache[1], torch.zeros(1, 1, dtype=torch.int32),
                                           torch.tensor([2], dtype=torch.int32),
                                           torch.tensor([0, 2], dtype=torch.int32), 0.125, True, False)


@pytest.mark.parametrize("kernel", many_row_kernels)
def test_paged_attention_kernels_refuse_bad_runs(kernel) -> None:
    many_rows = getattr(torch.ops.kvserve, kernel)
    cache = random_cache(4, 16, 1, 64, torch.bfloat16)
    q = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="has 3 queries and 2 keys"):  # causal needs a key per query
        many_rows(q, cache[0], cache[1], table, torch.tensor([2], dtype=torch.int32),
                  torch.tensor([0, 3], dtype=torch.int32), 0.125, True, False)
    with pytest.raises(RuntimeError, match="must cover q"):
        many_rows(q, cache[0], cache[1], table, torch.tensor([2], dtype=torch.int32),
                  torch.tensor([0, 2], dtype=torch.int32), 0.125, False, False)


@amx_only
@pytest.mark.parametrize("kv_len", [1, 300, 1568])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (12, 2, 128), (4, 1, 256)],
                         ids=["head64", "head128", "head256"])
def test_paged_attention_amx_on_packed_keys_is_bit_identical(kv_len, heads, kv_heads, dim) -> None:
    """pack_kv_amx's tile layouts, passed back in, give exactly the result of packing inside the kernel (the
    packed call also splits rows into more work items): cascade decode's shared prefix."""
    torch.manual_seed(kv_len + dim)
    block_size, decodes = 16, 16
    cache = random_cache(120, block_size, kv_heads, dim, torch.bfloat16)
    cache[:, 110:] = float("nan")  # past the run: padding must not read them
    table = torch.randperm(110)[: -(-kv_len // block_size)].to(torch.int32)
    q = torch.randn(decodes, heads, dim, dtype=torch.bfloat16)
    args = (q, cache[0], cache[1], table[None].contiguous(), torch.tensor([kv_len], dtype=torch.int32),
            torch.tensor([0, decodes], dtype=torch.int32), dim**-0.5, False, True)
    packed = torch.ops.kvserve.pack_kv_amx(cache[0], cache[1], table, kv_len)
    out, lse = torch.ops.kvserve.paged_attention_amx(*args)
    out_packed, lse_packed = torch.ops.kvserve.paged_attention_amx(*args, packed)
    assert torch.equal(out_packed, out) and torch.equal(lse_packed, lse)
    ref_out, _ = reference_runs(q, cache[0], cache[1], [table.tolist()], [kv_len], [decodes], dim**-0.5, False)
    torch.testing.assert_close(out_packed.double(), ref_out, atol=2e-3, rtol=2e-3)


@amx_only
@pytest.mark.parametrize("fp32_out", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (12, 2, 128), (4, 1, 256)],
                         ids=["head64", "head128", "head256"])
def test_prefill_chunks_on_a_packed_shared_prefix_are_bit_identical(fp32_out, heads, kv_heads, dim) -> None:
    """Causal chunks that share their leading blocks, with those keys passed packed (shared_keys): the same
    result, bit for bit, as packing every key inside the kernel. One chunk computes inside the shared part
    (the request that brings the system prompt), the others attend past it to keys of their own."""
    torch.manual_seed(7 + dim)
    block_size, shared_keys = 16, 96
    cache = random_cache(120, block_size, kv_heads, dim, torch.bfloat16)
    cache[:, 110:] = float("nan")
    free = iter(torch.randperm(110).tolist())
    shared = [next(free) for _ in range(7)]  # 112 keys of blocks in common; 96 of them packed
    shapes = [(40, 100), (33, 150), (1, 113), (70, 300)]  # (queries, keys); the first ends inside block 7
    tables = [shared + [next(free) for _ in range(-(-kv_len // block_size) - len(shared))] for _, kv_len in shapes]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [119] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = [q_len for q_len, _ in shapes]
    kv_lens = torch.tensor([kv_len for _, kv_len in shapes], dtype=torch.int32)
    q_starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, dim, dtype=torch.bfloat16)
    args = (q, cache[0], cache[1], block_tables, kv_lens, q_starts, dim**-0.5, True, fp32_out)
    packed = torch.ops.kvserve.pack_kv_amx(cache[0], cache[1], torch.tensor(shared[:6], dtype=torch.int32),
                                           shared_keys)
    out, lse = torch.ops.kvserve.paged_attention_amx(*args)
    out_shared, lse_shared = torch.ops.kvserve.paged_attention_amx(*args, packed, shared_keys)
    assert torch.equal(out_shared, out) and torch.equal(lse_shared, lse)
    ref_out, _ = reference_runs(q, cache[0], cache[1], tables, kv_lens.tolist(), q_lens, dim**-0.5, True)
    torch.testing.assert_close(out_shared.double(), ref_out, atol=2e-3 if fp32_out else 8e-3,
                               rtol=2e-3 if fp32_out else 8e-3)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.kvserve.paged_attention_amx(*args, packed, 80)
    other = block_tables.clone()
    other[2, 3] = 119  # a chunk that does not hold the shared blocks
    with pytest.raises(RuntimeError, match="span 2 does not hold the shared keys' blocks"):
        torch.ops.kvserve.paged_attention_amx(q, cache[0], cache[1], other, *args[4:], packed, shared_keys)


@amx_only
def test_packed_keys_are_refused_where_they_do_not_fit() -> None:
    cache = random_cache(8, 16, 1, 64, torch.bfloat16)
    q = torch.randn(2, 2, 64, dtype=torch.bfloat16)
    table = torch.tensor([3, 5], dtype=torch.int32)
    packed = torch.ops.kvserve.pack_kv_amx(cache[0], cache[1], table, 20)
    args = (q, cache[0], cache[1], table[None].contiguous(), torch.tensor([20], dtype=torch.int32),
            torch.tensor([0, 2], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="one non-causal span"):
        torch.ops.kvserve.paged_attention_amx(*args, True, False, packed)
    # Three blocks hold 40 keys, but the packed copy holds the first 20.
    wider = torch.tensor([[3, 5, 6]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="must come from pack_kv_amx for these 40 keys"):
        torch.ops.kvserve.paged_attention_amx(q, cache[0], cache[1], wider,
                                              torch.tensor([40], dtype=torch.int32),
                                              torch.tensor([0, 2], dtype=torch.int32), 0.125, False, True, packed)
    with pytest.raises(RuntimeError, match="covering kv_len"):
        torch.ops.kvserve.pack_kv_amx(cache[0], cache[1], table, 33)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.kvserve.pack_kv_amx(cache[0], cache[1], torch.tensor([9], dtype=torch.int32), 4)


@amx_only
def test_kernel_backend_keeps_the_packed_prefix_only_while_its_key_holds() -> None:
    """Cascade decode packs the shared prefix once per layer and reuses it for an equal key; a new key (a
    prefix block was written) packs again, so rewritten KV is never served from the old layout."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size, shared, batch = 9, 3, 64, 16, 20, 4
    cache = random_cache(60, block_size, kv_heads, dim, torch.bfloat16)
    tables = [list(range(shared)) + list(range(shared + 4 * i, shared + 4 * i + 4)) for i in range(batch)]
    suffix = [5, 16, 30, 64]
    table = torch.tensor([t[shared:] for t in tables], dtype=torch.int32)
    runs = PagedRuns(torch.arange(shared, dtype=torch.int32)[None], torch.tensor([shared * block_size], dtype=torch.int32),
                     torch.tensor([0, batch], dtype=torch.int32))

    def meta(key):
        return CpuAttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=batch, decode_block_table=table,
            decode_seq_lens=torch.tensor(suffix, dtype=torch.int32),
            decode_prefix_blocks=torch.arange(shared), decode_prefix_runs=runs, decode_prefix_key=key)

    backend = CpuKernelPagedAttention(heads, kv_heads, dim, many_rows="amx")
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16)
    empty = torch.empty(0, kv_heads, dim, dtype=torch.bfloat16)
    unpacked = backend.forward(q, empty, empty, cache, meta(None))
    assert backend._packed_prefix is None  # no key: nothing kept
    first = backend.forward(q, empty, empty, cache, meta((1,)))
    kept = backend._packed_prefix[1]
    again = backend.forward(q, empty, empty, cache, meta((1,)))
    assert backend._packed_prefix[1] is kept
    assert torch.equal(first, unpacked) and torch.equal(again, unpacked)

    cache[:, 7] = torch.randn_like(cache[:, 7])  # a prefix block rewritten: the runner gives a new key
    fresh = CpuKernelPagedAttention(heads, kv_heads, dim, many_rows="amx").forward(q, empty, empty, cache, meta(None))
    assert not torch.equal(fresh, unpacked)
    assert torch.equal(backend.forward(q, empty, empty, cache, meta((2,))), fresh)


@pytest.mark.parametrize("name", attention_families)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (12, 2, 128), (4, 1, 256)],
                         ids=["head64", "head128", "head256"])
def test_kernel_backend_mixed_step_matches_torch_backend(name, heads, kv_heads, dim) -> None:
    """One bf16 step as the runner builds it: decodes sharing a cached prefix (cascade), a prefill chunk from
    position 0 and one on cached history, through the AMX (AVX-512, AVX2) kernels and through the reference
    backend, at each head size the many-row kernels take."""
    from kvserve.batch import ScheduledRequest, SchedulerOutput
    from kvserve.runner.input_batch import build_inputs

    torch.manual_seed(5 + dim)
    block_size = 16
    cache = random_cache(64, block_size, kv_heads, dim, torch.bfloat16)
    shared = list(range(20))  # 320 tokens every decode shares: above the cascade threshold
    scheduled = [ScheduledRequest(f"d{i}", [1], 320 + 5 * i, shared + [20 + i, 30 + i], True) for i in range(4)]
    scheduled.append(ScheduledRequest("p0", [1] * 40, 0, [40, 41, 42], True))
    scheduled.append(ScheduledRequest("p1", [1] * 50, 100, [50, 51, 52, 53, 54, 55, 56, 57, 58, 59], True))
    inputs = build_inputs(SchedulerOutput(scheduled=scheduled), block_size, torch.device("cpu"))
    backend = kernel_backend(name, heads, kv_heads, dim)
    reference = TorchRefBackend(arch(heads, kv_heads, dim), torch.device("cpu"), BackendConfig())
    meta = backend.build_metadata(inputs.rows)
    assert meta.decode_prefix_runs is not None and meta.prefill_runs is not None
    assert not hasattr(meta, "decode_mask")  # the reference's alone
    num_tokens = inputs.input_ids.shape[0]
    q = torch.randn(num_tokens, heads, dim, dtype=torch.bfloat16)
    k = torch.randn(num_tokens, kv_heads, dim, dtype=torch.bfloat16)
    v = torch.randn(num_tokens, kv_heads, dim, dtype=torch.bfloat16)
    expected = reference.make_attention(0).forward(q, k, v, cache.clone(), reference.build_metadata(inputs.rows))
    attention = backend.make_attention(0)
    assert type(attention) is CpuKernelPagedAttention and attention.many_rows == name
    got = attention.forward(q, k, v, cache.clone(), meta)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows_equals_torch_argmax(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 1000, generator=gen).to(dtype)
    x[1, 17] = x[1, 900] = 50.0  # a tie: the lowest index wins
    x[2, 999] = 60.0  # the largest in the scalar tail
    x[2, 5] = 60.0  # ... and the same value earlier, in the vector part
    x[3] = float("-inf")  # nothing but -inf: index 0
    x[4, 333] = float("nan")  # a NaN counts as the largest
    x[4, 600] = float("nan")
    x[5, :] = 0.0
    x[5, 3] = 1.0  # a row shorter than a vector is handled below
    got = torch.ops.kvserve.argmax_rows(x)
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert got.tolist()[1:5] == [17, 5, 0, 333]
    wide = torch.randn(4, 49160, generator=gen).to(dtype)[:, :49152]  # strided rows, as the sampler's view
    assert torch.ops.kvserve.argmax_rows(wide).tolist() == wide.argmax(dim=-1).tolist()
    short = torch.tensor([[1.0, 3.0, 3.0, 2.0]], dtype=dtype)
    assert torch.ops.kvserve.argmax_rows(short).tolist() == [1]


@pytest.mark.parametrize("bf16_out", [False, True])
@pytest.mark.parametrize("batch", [5, 12, 25])  # 60 rows; 144 (one claim on the calling thread); 300 (claims of 64)
def test_merge_attention_matches_merge_by_lse(bf16_out: bool, batch: int) -> None:
    gen = torch.Generator().manual_seed(5)
    out_a, out_b = torch.randn(2, batch, 3, 4, 64, generator=gen)
    lse_a, lse_b = torch.randn(2, batch, 3, 4, generator=gen) * 4
    lse_b[0, 0, 0] = float("-inf")  # an empty half weighs nothing
    got = torch.ops.kvserve.merge_attention(out_a, lse_a, out_b, lse_b, bf16_out)
    expected = merge_by_lse(out_a, lse_a, out_b, lse_b)
    assert got.dtype == (torch.bfloat16 if bf16_out else torch.float32)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2 if bf16_out else 1e-5, atol=1e-2 if bf16_out else 1e-5)
    assert torch.equal(got[0, 0, 0].float(), out_a[0, 0, 0].to(got.dtype).float())
    both_empty = torch.full((1, 1), float("-inf"))
    assert torch.ops.kvserve.merge_attention(out_a[:1, :1, 0], both_empty, out_b[:1, :1, 0], both_empty,
                                             False).abs().max() == 0


def random_decoder_weights(shape: ArchConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A model's weights under Hugging Face names, bf16-representable, scaled so activations stay near 1."""

    def w(*size: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * scale).to(torch.bfloat16)

    def norm(size: int) -> torch.Tensor:
        return (1 + torch.randn(size, generator=gen) * 0.1).to(torch.bfloat16)

    hidden, inter = shape.hidden_size, shape.intermediate_size
    weights = {"model.embed_tokens.weight": w(shape.vocab_size, hidden, scale=1.0),
               "model.norm.weight": norm(hidden)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", shape.q_size), ("k", shape.kv_size), ("v", shape.kv_size)):
            weights[f"{p}self_attn.{name}_proj.weight"] = w(rows, hidden)
            if shape.qkv_bias:
                weights[f"{p}self_attn.{name}_proj.bias"] = w(rows, scale=0.5)
        if shape.qk_norm:
            weights[f"{p}self_attn.q_norm.weight"] = norm(shape.head_dim)
            weights[f"{p}self_attn.k_norm.weight"] = norm(shape.head_dim)
        weights[f"{p}self_attn.o_proj.weight"] = w(hidden, shape.q_size)
        weights[f"{p}mlp.gate_proj.weight"] = w(inter, hidden)
        weights[f"{p}mlp.up_proj.weight"] = w(inter, hidden)
        weights[f"{p}mlp.down_proj.weight"] = w(hidden, inter)
        weights[f"{p}input_layernorm.weight"] = norm(hidden)
        weights[f"{p}post_attention_layernorm.weight"] = norm(hidden)
    return weights


@pytest.mark.parametrize("name", packed_families)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (12, 2, 128), (4, 1, 256)],
                         ids=["head64", "head128", "head256"])
@pytest.mark.parametrize("layout", ["plain", "qkv_bias", "qk_norm"])
def test_fused_decode_stack_is_bit_identical_to_the_layers(name, heads, kv_heads, dim, layout) -> None:
    """The fused decode stack against the same model's Python layers, layer by layer, on the same caches, on
    each packed family's plan: one row (AMX: the GEMV, with the QKV bias where there is one), several rows,
    and decodes sharing a prefix (cascade; AMX: its packing made inside the stack's first step, kept for the
    next; AVX-512 and AVX2: their many-row kernels, nothing kept). Both paths run the same
    kernels in the same order, so hidden states and the KV written must match bit for bit."""
    from kvserve.batch import ScheduledRequest, SchedulerOutput
    from kvserve.model.llama import LlamaForCausalLM
    from kvserve.runner.input_batch import build_inputs

    gen = torch.Generator().manual_seed(dim + len(layout))
    shape = ArchConfig("llama", vocab_size=512, hidden_size=256, intermediate_size=256, num_layers=2,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, max_position_embeddings=4096,
                       tie_word_embeddings=True, qkv_bias=layout == "qkv_bias", qk_norm=layout == "qk_norm")
    plan = plan_kernels(FAMILY_CPUS[name], torch.bfloat16, shape)
    assert plan.fused_decode and plan.projections == name, plan.description
    backend = CpuKernelsBackend(plan, shape, torch.device("cpu"), BackendConfig(cascade_min_tokens=32))
    model = LlamaForCausalLM(shape, backend, torch.bfloat16, torch.device("cpu"))
    model.load_weights(random_decoder_weights(shape, gen).items())
    stack = model.fused_decode
    assert stack is not None
    block_size, num_blocks = 16, 48
    caches = [(torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen)).to(torch.bfloat16)
              for _ in range(shape.num_layers)]
    shared = [0, 1, 2, 3]  # 64 keys every request of the cascade steps holds
    steps = {
        "one row": [ScheduledRequest("a", [7], 40, [10, 11, 12], True)],
        "several rows": [ScheduledRequest(f"r{i}", [3 + i], 20 + 9 * i, list(range(13 + 4 * i, 17 + 4 * i)), True)
                         for i in range(5)],
        "cascade": [ScheduledRequest(f"c{i}", [9 + i], 64 + 5 * i, shared + [40 + i], True) for i in range(4)],
    }
    cascade_steps = 0
    for label, scheduled in [*steps.items(), ("cascade, prefix kept", steps["cascade"])]:
        inputs = build_inputs(SchedulerOutput(scheduled=scheduled), block_size, torch.device("cpu"))
        meta = backend.build_metadata(inputs.rows)
        python_caches = [cache.clone() for cache in caches]
        accepted = stack.accepts(torch.empty(len(scheduled), shape.hidden_size, dtype=torch.bfloat16), (meta,))
        cascade_steps += meta.decode_prefix_blocks is not None
        assert accepted, label
        with model.thread_scope:
            fused = model.forward(inputs.input_ids, inputs.positions, meta, caches)
            model.fused_decode = None
            try:
                hidden = model.forward(inputs.input_ids, inputs.positions, meta, python_caches)
            finally:
                model.fused_decode = stack
        assert torch.equal(fused, hidden), f"{label}: the fused stack's hidden states differ"
        assert all(torch.equal(a, b) for a, b in zip(caches, python_caches, strict=True)), f"{label}: KV differs"
    assert cascade_steps == 2
    kept = [attention.kept_prefix(meta.decode_prefix_key) for attention in stack.attentions]
    assert all((packing is not None) == (name == "amx") for packing in kept)  # only AMX keeps packed keys


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_the_environment_turns_the_kernels_off_in_any_usual_spelling(monkeypatch, value: str) -> None:
    from kvserve.model.cpu_kernels import _Loader

    monkeypatch.setenv("KVSERVE_CPU_KERNELS", value)
    assert _Loader().get() is None  # a fresh loader: nothing built or loaded


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_rows", [1, 3, 5, 37])
@pytest.mark.parametrize("subset", [False, True])
def test_lora_add_matches_float64_within_one_rounding(dtype, num_rows, subset) -> None:
    from kvserve.model.ops import torch_lora_add

    torch.manual_seed(num_rows)
    in_size, out_size = 200, 90  # neither a multiple of 16: the tails
    # Two parts, as a fused projection's: columns 0-39 on ranks 0-3, columns 40-89 on ranks 4-9 (zero elsewhere).
    a = torch.randn(10, in_size) / in_size ** 0.5
    bt = torch.zeros(10, out_size)
    bt[0:4, 0:40] = torch.randn(4, 40)
    bt[4:10, 40:90] = torch.randn(6, 50)
    parts = torch.tensor([[0, 40, 0, 4], [40, 90, 4, 10]])
    x = torch.randn(num_rows, in_size).to(dtype)
    out = torch.randn(num_rows, out_size).to(dtype)
    rows = torch.tensor(sorted(set(range(0, num_rows, 2)) | {num_rows - 1})) if subset else None
    kernel_out, torch_out = out.clone(), out.clone()
    torch.ops.kvserve.lora_add(kernel_out, x, a, bt, parts, rows)
    torch_lora_add(torch_out, x, a, bt, parts, rows)
    expected = out.double()
    chosen = rows if rows is not None else torch.arange(num_rows)
    expected[chosen] += (x[chosen].double() @ a.double().T) @ bt.double()
    # The kernel rounds once (bf16: half a unit in the last place of the result), plus float32 sums; torch's
    # reference rounds the update to the output's dtype before adding it, a second rounding of its size.
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-6
    update = expected - out.double()
    assert ((kernel_out.double() - expected).abs() <= expected.abs() * unit + 1e-5).all()
    assert ((torch_out.double() - expected).abs() <= (expected.abs() + update.abs()) * unit + 1e-5).all()
    if rows is not None:  # the rows not chosen are untouched
        untouched = torch.tensor([i for i in range(num_rows) if i not in set(rows.tolist())], dtype=torch.long)
        assert torch.equal(kernel_out[untouched], out[untouched])
