"""The quantised projection kernels (csrc/quantized.cpp) against float64 references built from gguf's own
dequantiser, for every format they take, at tail shapes; the held layout; the ops and the plan around them.

Tolerances: the kernels round their output to bf16 (a relative 2^-9), so results are compared with
rtol = atol / max|ref| = 2^-7. The few-row path is compared against the same int8-quantised activations it
uses (per block of 32, scale max|x| / 127); the many-row path against bf16 activations times the weights
rounded to bf16, which is what its dequantised panels hold; the mid-width path, where it multiplies the
weights' integers (AVX512-BF16), against the exact weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvserve.config import ArchConfig
from kvserve.model.backends.cpu_kernels import QUANTIZED_FUSED_MAX_ROWS, plan_kernels
from kvserve.model.backends.cpu_ops import QuantizedWidths, build_cpu_ops
from kvserve.model.cpu_kernels import CpuKernels, load_cpu_kernels
from kvserve.model.quantized import (
    KERNEL_TYPES,
    QuantizedWeight,
    concat_rows,
    from_planar,
    held_row_bytes,
    to_planar,
)

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="the C++ CPU kernels did not build on this machine")
T = GGMLQuantizationType
FORMATS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
# Byte offsets of each block's fp16 scales (random bytes there could be NaN or huge).
HALF_OFFSETS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q4_K: [0, 2],
                T.Q5_K: [0, 2], T.Q6_K: [208]}
GEMV_ROWS = 4
FUSED_ROWS = 64
# Where the fused mid-width path multiplies the weights' integers on VDPBF16PS (AVX512-BF16 builds; the plan
# gives AMX CPUs the slabs instead), without rounding the weights to bf16.
INTEGER_WEIGHTS = kernels is not None and kernels.gemv_bf16
RTOL = 2**-7


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, row_bytes] of random blocks: random quants and sub-scales, moderate fp16 scales."""
    rng = np.random.default_rng(seed)
    values, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[qtype]:
        scales = rng.uniform(0.002, 0.02, size=(rows, cols // values)).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // values, 2)
    return blocks.reshape(rows, -1)


def int8_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """What the few-row path multiplies: x quantised per block of 32 (or ``block``) to int8, in float64."""
    blocks = x.double().reshape(x.shape[0], -1, block)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1)), 0)
    return (q * scale).reshape(x.shape)


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), ref, rtol=RTOL, atol=RTOL * ref.abs().max().item())


# Shapes: columns with an odd number of 32-blocks (96); rows off every tile (33, 17, 40: the many-row path's
# torch panels) and in whole blocks of 16 (48: its AMX slabs, the last one half a panel).
SHAPES = {32: [(33, 96), (48, 512)], 256: [(17, 256), (40, 768)]}


def shapes_of(qtype):
    return SHAPES[GGML_QUANT_SIZES[qtype][0]]


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_the_held_layout_round_trips_and_dequantises_as_gguf_does(qtype) -> None:
    for rows, cols in shapes_of(qtype):
        blocks = random_blocks(qtype, rows, cols)
        assert np.array_equal(from_planar(int(qtype), to_planar(int(qtype), blocks)), blocks)
        weight = QuantizedWeight.from_blocks(int(qtype), blocks, cols)
        assert weight.shape == (rows, cols) and weight.nbytes == rows * held_row_bytes(int(qtype), cols)
        assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(blocks, qtype)))


@needs_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_the_kernel_dequantiser_is_exact(qtype) -> None:
    for rows, cols in shapes_of(qtype):
        blocks = random_blocks(qtype, rows, cols, seed=1)
        weight = QuantizedWeight.from_blocks(int(qtype), blocks, cols)
        ids = torch.tensor([rows - 1, 0, rows // 2, 0])
        got = torch.ops.kvserve.quant_dequantize(weight.data[0], int(qtype), cols, ids, torch.float32)
        assert torch.equal(got, torch.from_numpy(dequantize(blocks, qtype))[ids])


@needs_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 16, 40])
def test_quant_linear_matches_a_float64_reference(qtype, num_rows) -> None:
    for rows, cols in shapes_of(qtype):
        blocks = random_blocks(qtype, rows, cols, seed=num_rows)
        weight = QuantizedWeight.from_blocks(int(qtype), blocks, cols)
        w = torch.from_numpy(dequantize(blocks, qtype)).double()
        x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(rows)).bfloat16()
        bias = torch.randn(rows).bfloat16()
        got = torch.ops.kvserve.quant_linear(x, weight.data, weight.types, cols, bias, GEMV_ROWS, FUSED_ROWS)
        if num_rows <= GEMV_ROWS and kernels.quantized_gemv:
            ref = int8_activations(x) @ w.T
        elif INTEGER_WEIGHTS and rows % 16 == 0:
            ref = x.double() @ w.T
            slabs = torch.ops.kvserve.quant_linear(x, weight.data, weight.types, cols, bias, 0, 0)
            assert_close(slabs, x.double() @ w.bfloat16().double().T + bias.double())
        else:
            ref = x.double() @ w.bfloat16().double().T
        assert_close(got, ref + bias.double())


@needs_kernels
@pytest.mark.skipif(kernels is None or not kernels.avx512, reason="the packed AVX-512 projection kernels")
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_the_panel_paths_multiply_exactly_the_dequantised_weight(qtype) -> None:
    """The fused panels (where they dequantise) and the slabs dequantise whole blocks of 16 rows straight
    into the packed layout: what they multiply must be, bit for bit, the row dequantiser's bf16 weight packed
    and run through the bf16 projection kernel. Where the mid widths take the integer weights instead, their
    results must be nearer the exact products than the dequantised weight's. Inner sizes end part-way
    through a group of chunk scales."""
    cols = {32: 608, 256: 768}[GGML_QUANT_SIZES[qtype][0]]
    blocks = random_blocks(qtype, 48, cols, seed=3)
    weight = QuantizedWeight.from_blocks(int(qtype), blocks, cols)
    (segment,) = weight.segments
    dense = torch.ops.kvserve.quant_dequantize(segment.data, int(qtype), cols, torch.arange(48), torch.bfloat16)
    packed = torch.ops.kvserve.pack_bf16_pairs(dense)
    linear = torch.ops.kvserve.bf16dot_linear if kernels.gemv_bf16 else torch.ops.kvserve.avx512_linear
    for num_rows in (5, 16, 40):
        x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
        expected = linear(x, packed, None)
        slabs = torch.ops.kvserve.quant_linear(x, weight.data, weight.types, cols, None, 0, 0)
        assert torch.equal(slabs, expected)
        fused = torch.ops.kvserve.quant_linear(x, weight.data, weight.types, cols, None, 0, FUSED_ROWS)
        if not INTEGER_WEIGHTS:
            assert torch.equal(fused, expected)
            continue
        exact = x.double() @ weight.dequantize(torch.float64).T
        assert_close(fused, exact)
        assert (fused.double() - exact).abs().mean() < (slabs.double() - exact).abs().mean()


@needs_kernels
@pytest.mark.parametrize(("gemv_rows", "fused_rows"), [(GEMV_ROWS, FUSED_ROWS), (0, FUSED_ROWS), (0, 0)],
                         ids=["int8-dots", "fused-panels", "slabs"])
def test_mixed_segments_and_the_fused_gate_up(gemv_rows, fused_rows) -> None:
    """A fused weight whose rows are in two formats (a Q5_0 Q/K beside a Q8_0 V), and a [gate | up] weight
    whose silu(gate) * up comes from the kernel, on every path."""
    cols = 256
    parts = [QuantizedWeight.from_blocks(int(t), random_blocks(t, rows, cols, seed=rows), cols)
             for t, rows in ((T.Q5_0, 48), (T.Q5_0, 16), (T.Q8_0, 17))]
    fused = concat_rows(parts)
    assert isinstance(fused, QuantizedWeight) and fused.types == (int(T.Q5_0), int(T.Q8_0))
    w = torch.cat([p.dequantize(torch.float64) for p in parts])
    for num_rows in (1, 3, 24):
        x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
        few = num_rows <= gemv_rows and kernels.quantized_gemv
        xr = int8_activations(x) if few else x.double()
        wr = w if few else w.bfloat16().double()
        got = torch.ops.kvserve.quant_linear(x, fused.data, fused.types, cols, None, gemv_rows, fused_rows)
        assert got.shape == (num_rows, 81)
        assert_close(got, xr @ wr.T)

    # 48 columns out: whole blocks of 16 (the AMX slabs); 40: not (torch's matmul on the panels).
    for width in (48, 40):
        gate_up = concat_rows([QuantizedWeight.from_blocks(int(T.Q4_K), random_blocks(T.Q4_K, width, cols, seed=s),
                                                           cols) for s in (1, 2)])
        w = gate_up.dequantize(torch.float64)
        for num_rows in (1, 24):
            x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(7)).bfloat16()
            few = num_rows <= gemv_rows and kernels.quantized_gemv
            product = (int8_activations(x) @ w.T) if few else (x.double() @ w.bfloat16().double().T)
            gate, up = product.chunk(2, dim=-1)
            got = torch.ops.kvserve.quant_linear_silu_mul(x, gate_up.data, gate_up.types, cols, gemv_rows, fused_rows)
            assert got.shape == (num_rows, width)
            ref = F.silu(gate) * up
            torch.testing.assert_close(got.double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())


@needs_kernels
def test_bad_weights_are_clear_errors() -> None:
    blocks = random_blocks(T.Q4_0, 16, 64)
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="must be contiguous uint8"):
        torch.ops.kvserve.quant_linear(x, [torch.from_numpy(blocks[:, :-1].copy())], [int(T.Q4_0)], 64, None, 4, 0)
    with pytest.raises(RuntimeError, match="GGML type 1 has no kernel"):
        torch.ops.kvserve.quant_linear(x, [torch.from_numpy(blocks)], [1], 64, None, 4, 0)
    with pytest.raises(RuntimeError, match="inner dimensions differ"):
        torch.ops.kvserve.quant_linear(torch.randn(1, 32).bfloat16(), [torch.from_numpy(blocks)], [int(T.Q4_0)], 64,
                                       None, 4, 0)


@needs_kernels
def test_the_ops_run_quantised_weights_and_pass_dense_ones_through() -> None:
    ops = build_cpu_ops(None, 0, True, quantized=QuantizedWidths(GEMV_ROWS)).ops
    table = QuantizedWeight.from_blocks(int(T.Q8_0), random_blocks(T.Q8_0, 50, 64), 64)
    ids = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(ops.embedding(ids, table), table.dequantize(torch.bfloat16)[ids])
    dense = torch.randn(50, 64).bfloat16()
    assert torch.equal(ops.embedding(ids, dense), F.embedding(ids, dense))
    x = torch.randn(2, 64).bfloat16()
    assert torch.equal(ops.linear(x, dense, None), F.linear(x, dense))
    assert_close(ops.linear(x, table, None), int8_activations(x) @ table.dequantize(torch.float64).T
                 if kernels.quantized_gemv else x.double() @ table.dequantize(torch.bfloat16).double().T)
    ops.prepare_weight(table)  # a dense kernel's packing skips it
    assert KERNEL_TYPES == {int(t) for t in FORMATS}


def test_the_plan_runs_quantised_weights_where_the_kernels_keep_up() -> None:
    shape = ArchConfig("llama", vocab_size=256, hidden_size=576, intermediate_size=256, num_layers=2, num_heads=9,
                       num_kv_heads=3, head_dim=64, max_position_embeddings=4096)
    vnni = CpuKernels(gemv_bf16=True, amx=True, avx512=True, quantized_gemv=True)
    no_vnni = CpuKernels(gemv_bf16=False, amx=False, avx512=True, quantized_gemv=False)
    avx2 = CpuKernels(gemv_bf16=False, quantized_gemv=True, avx2=True)
    no_avx512 = CpuKernels(gemv_bf16=False)
    assert plan_kernels(vnni, torch.bfloat16, shape).quantized_gemv_max_rows == GEMV_ROWS
    plan = plan_kernels(avx2, torch.bfloat16, shape)
    assert plan.quantized_gemv_max_rows == GEMV_ROWS and not plan.quantized_by_default
    assert plan_kernels(vnni, torch.bfloat16, shape).quantized_by_default
    # Without AMX the mid widths take panels dequantised beside their products; AMX keeps its slabs.
    bf16dot = CpuKernels(gemv_bf16=True, amx=False, avx512=True, quantized_gemv=True)
    assert plan_kernels(bf16dot, torch.bfloat16, shape).quantized_widths == QuantizedWidths(
        GEMV_ROWS, QUANTIZED_FUSED_MAX_ROWS)
    assert plan_kernels(vnni, torch.bfloat16, shape).quantized_widths == QuantizedWidths(GEMV_ROWS, 0)
    assert plan_kernels(avx2, torch.bfloat16, shape).quantized_fused_max_rows == 0
    plan = plan_kernels(no_vnni, torch.bfloat16, shape)
    assert plan.quantized_gemv_max_rows == 0 and any("no AVX512-VNNI" in f for f in plan.fallbacks)
    assert plan.quantized_widths == QuantizedWidths(0, QUANTIZED_FUSED_MAX_ROWS)
    plan = plan_kernels(no_avx512, torch.bfloat16, shape)
    assert plan.quantized_gemv_max_rows is None and any("dequantised at load" in f for f in plan.fallbacks)
    plan = plan_kernels(vnni, torch.float32, shape)
    assert plan.quantized_gemv_max_rows is None and any("float32 model" in f for f in plan.fallbacks)
