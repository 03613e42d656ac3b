"""Quantised weights held interleaved sixteen rows at a time (model/quantized_layout.py,
csrc/quantized_interleaved.cpp): the layout against the file's blocks, and its kernels against float64
references built from gguf's own dequantiser, for every format.

The int8 dot products quantise the activations per sixteen values (scale max|x| / 127) and are compared
against exactly that; past the few-row limit they add the activations' int8 residuals (about 16 bits), and
are compared against the exact products; wider inputs than the interleaved limit take the slabs, dequantised
from this layout to bf16, compared against bf16 activations times the weights rounded to bf16. With int8
activations (--quantized-activations int8) every width quantises them per 32 values, one level, compared
against exactly that. Tolerance as in test_quantized_kernels.py (the output is rounded to bf16):
rtol = atol / max|ref| = 2^-7.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from kvserve.config import ArchConfig
from kvserve.model.backends.cpu_kernels import (
    QUANTIZED_FUSED_MAX_ROWS,
    QUANTIZED_INT8_MAX_ROWS,
    QUANTIZED_INTERLEAVED_MAX_ROWS,
    plan_kernels,
)
from kvserve.model.backends.cpu_ops import ActivationLevels
from kvserve.model.cpu_kernels import CpuKernels
from kvserve.model.quantized import QuantizedWeight, concat_rows, held_row_bytes
from kvserve.model.quantized_layout import can_interleave, from_interleaved, to_interleaved
from tests.model.test_quantized_kernels import (
    FORMATS,
    RTOL,
    T,
    assert_close,
    int8_activations,
    kernels,
    random_blocks,
)

INTERLEAVED = kernels is not None and kernels.quantized_interleave_rows == 16
needs_interleaved = pytest.mark.skipif(not INTERLEAVED, reason="the interleaved kernels need AVX512-VNNI")
GEMV_ROWS, FUSED_ROWS = 4, 24


def int8_half_chunks(x: torch.Tensor) -> torch.Tensor:
    """What the interleaved dot products multiply: x quantised per sixteen values to int8, in float64."""
    return int8_activations(x, block=16)


# Inner sizes: an odd number of 32-blocks (96, 608); several super-blocks (768).
SHAPES = {32: [(16, 96), (48, 608)], 256: [(16, 256), (32, 768)]}


def shapes_of(qtype):
    return SHAPES[GGML_QUANT_SIZES[qtype][0]]


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_the_layout_round_trips_and_dequantises_as_gguf_does(qtype) -> None:
    for rows, cols in shapes_of(qtype):
        blocks = random_blocks(qtype, rows, cols, seed=rows)
        held = to_interleaved(int(qtype), blocks)
        assert held.shape == (rows, held_row_bytes(int(qtype), cols))
        assert np.array_equal(from_interleaved(int(qtype), held, cols), blocks)
        weight = QuantizedWeight.from_blocks(int(qtype), blocks, cols, interleave=True)
        assert weight.interleaved and weight.types == (int(qtype) | 0x100,)
        assert torch.equal(weight.dequantize(), torch.from_numpy(dequantize(blocks, qtype)))


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "planar"])
def test_leading_rows_are_views_of_the_first_rows(interleave: bool) -> None:
    """A pruned output projection: the first rows, cut after whole groups of sixteen where interleaved, and
    the products of those rows are the full weight's first columns."""
    first = QuantizedWeight.from_blocks(int(T.Q4_K), random_blocks(T.Q4_K, 32, 256, seed=4), 256, interleave)
    rest = QuantizedWeight.from_blocks(int(T.Q6_K), random_blocks(T.Q6_K, 32, 256, seed=5), 256, interleave)
    weight = concat_rows([first, rest])
    reference = weight.dequantize()
    for rows, held in [(16, 16), (20, 32 if interleave else 20), (32, 32), (40, 48 if interleave else 40), (64, 64)]:
        head = weight.leading_rows(rows)
        assert head.shape == (held, 256)
        assert torch.equal(head.dequantize(), reference[:held])
        assert head.segments[0].data.data_ptr() == weight.segments[0].data.data_ptr()  # nothing copied
    if kernels is not None and (INTERLEAVED or not interleave):  # the products, where this build has their kernels
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
        head = weight.leading_rows(40)
        full = torch.ops.kvserve.quant_linear(x, weight.data, weight.types, 256, None, GEMV_ROWS, FUSED_ROWS)
        got = torch.ops.kvserve.quant_linear(x, head.data, head.types, 256, None, GEMV_ROWS, FUSED_ROWS)
        assert torch.equal(got, full[:, : head.shape[0]])


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "planar"])
def test_gathered_rows_are_those_rows_of_every_segment(interleave: bool) -> None:
    """A draft's frequency-pruned output projection: any rows, across segments of two formats, copied into a
    weight of their own, held as the source where they make whole groups; its products are the full
    weight's columns at those rows."""
    first = QuantizedWeight.from_blocks(int(T.Q4_K), random_blocks(T.Q4_K, 32, 256, seed=4), 256, interleave)
    rest = QuantizedWeight.from_blocks(int(T.Q6_K), random_blocks(T.Q6_K, 32, 256, seed=5), 256, interleave)
    weight = concat_rows([first, rest])
    reference = weight.dequantize()
    ids = [1, 2, 5, 8, 13, 17, 20, 21, 22, 30, 31, 33, 35, 40, 41, 42, 47, 50, 53, 60, 61, 62, 63]
    for chosen, whole_groups in [(ids, False), (list(range(3, 19)) + list(range(40, 56)), True)]:
        gathered = weight.gather_rows(chosen)
        assert gathered.shape == (len(chosen), 256)
        assert torch.equal(gathered.dequantize(), reference[chosen])
        assert gathered.interleaved == (interleave and whole_groups)
        if kernels is not None and (INTERLEAVED or not interleave):
            x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
            full = torch.ops.kvserve.quant_linear(x, weight.data, weight.types, 256, None, GEMV_ROWS, FUSED_ROWS)
            got = torch.ops.kvserve.quant_linear(x, gathered.data, gathered.types, 256, None, GEMV_ROWS, FUSED_ROWS)
            if gathered.interleaved == weight.interleaved:  # the same kernel, row for row
                assert torch.equal(got, full[:, chosen])
            else:
                assert_close(got, full[:, chosen].double())


def test_rows_that_are_not_whole_groups_stay_planar() -> None:
    assert not can_interleave(int(T.Q4_K), 17) and can_interleave(int(T.Q4_K), 32)
    weight = QuantizedWeight.from_blocks(int(T.Q8_0), random_blocks(T.Q8_0, 17, 64), 64, interleave=True)
    assert not weight.interleaved and weight.types == (int(T.Q8_0),)


def test_fusing_keeps_the_layout_or_makes_both_planar() -> None:
    a = QuantizedWeight.from_blocks(int(T.Q4_K), random_blocks(T.Q4_K, 32, 256, seed=1), 256, interleave=True)
    b = QuantizedWeight.from_blocks(int(T.Q4_K), random_blocks(T.Q4_K, 16, 256, seed=2), 256, interleave=True)
    c = QuantizedWeight.from_blocks(int(T.Q6_K), random_blocks(T.Q6_K, 17, 256, seed=3), 256, interleave=True)
    reference = torch.cat([w.dequantize() for w in (a, b, c)])
    both = concat_rows([a, b])
    assert both.interleaved and len(both.segments) == 1
    assert torch.equal(both.dequantize(), reference[:48])
    mixed = concat_rows([a, b, c])
    assert not any(s.interleaved for s in mixed.segments) and len(mixed.segments) == 2
    assert torch.equal(mixed.dequantize(), reference)


@needs_interleaved
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_the_kernel_dequantiser_reads_rows_exactly(qtype) -> None:
    for rows, cols in shapes_of(qtype):
        blocks = random_blocks(qtype, rows, cols, seed=2)
        weight = QuantizedWeight.from_blocks(int(qtype), blocks, cols, interleave=True)
        ids = torch.tensor([rows - 1, 0, 5, rows // 2, 0])
        ref = torch.from_numpy(dequantize(blocks, qtype))[ids]
        got = torch.ops.kvserve.quant_dequantize(weight.data[0], weight.types[0], cols, ids, torch.float32)
        assert torch.equal(got, ref)
        got = torch.ops.kvserve.quant_dequantize(weight.data[0], weight.types[0], cols, ids, torch.bfloat16)
        assert torch.equal(got, ref.bfloat16())


@needs_interleaved
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 13, 24, 25, 40])
def test_quant_linear_matches_a_float64_reference(qtype, num_rows) -> None:
    for rows, cols in shapes_of(qtype):
        blocks = random_blocks(qtype, rows, cols, seed=num_rows)
        weight = QuantizedWeight.from_blocks(int(qtype), blocks, cols, interleave=True)
        w = torch.from_numpy(dequantize(blocks, qtype)).double()
        x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(rows)).bfloat16()
        bias = torch.randn(rows).bfloat16()
        got = torch.ops.kvserve.quant_linear(x, weight.data, weight.types, cols, bias, GEMV_ROWS, FUSED_ROWS)
        assert_close(got, reference(x, w) + bias.double())


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T as the interleaved path computes it at x's number of rows."""
    if len(x) <= GEMV_ROWS:
        return int8_half_chunks(x) @ w.T
    if len(x) <= FUSED_ROWS:
        return x.double() @ w.T
    return x.double() @ w.bfloat16().double().T


@needs_interleaved
def test_the_residual_level_makes_batches_as_accurate_as_bf16_activations() -> None:
    """Past the few rows, every row's products are nearer the exact ones than int8 activations' are, and
    as near as the planar layout's panels, which multiply the bf16 activations themselves."""
    cols = 512
    blocks = random_blocks(T.Q4_K, 64, cols, seed=5)
    planar = QuantizedWeight.from_blocks(int(T.Q4_K), blocks, cols)
    interleaved = QuantizedWeight.from_blocks(int(T.Q4_K), blocks, cols, interleave=True)
    # Activations with outlier channels, as a model's hidden states have.
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(8, cols, generator=gen) * (1 + 30 * (torch.rand(8, cols, generator=gen) < 0.02))).bfloat16()
    exact = x.double() @ planar.dequantize(torch.float64).T

    def error(weight: QuantizedWeight, gemv_rows: int, fused_rows: int) -> float:
        got = torch.ops.kvserve.quant_linear(x, weight.data, weight.types, cols, None, gemv_rows, fused_rows)
        return ((got.double() - exact).norm() / exact.norm()).item()

    int8_only = error(interleaved, 8, 8)
    two_levels = error(interleaved, GEMV_ROWS, FUSED_ROWS)
    panels = error(planar, 0, 64)
    assert two_levels < int8_only / 3 and two_levels < 1.1 * panels, (two_levels, int8_only, panels)


@needs_interleaved
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_the_slabs_multiply_exactly_the_planar_layouts_weight(qtype) -> None:
    """Wider inputs dequantise the groups straight into the packed tiles: the same bf16 weights, bit for bit,
    as the planar layout's slabs, so the same products."""
    cols = {32: 608, 256: 768}[GGML_QUANT_SIZES[qtype][0]]
    blocks = random_blocks(qtype, 48, cols, seed=3)
    planar = QuantizedWeight.from_blocks(int(qtype), blocks, cols)
    interleaved = QuantizedWeight.from_blocks(int(qtype), blocks, cols, interleave=True)
    x = torch.randn(80, cols, generator=torch.Generator().manual_seed(4)).bfloat16()
    expected = torch.ops.kvserve.quant_linear(x, planar.data, planar.types, cols, None, 0, 0)
    got = torch.ops.kvserve.quant_linear(x, interleaved.data, interleaved.types, cols, None, GEMV_ROWS, FUSED_ROWS)
    assert torch.equal(got, expected)


@needs_interleaved
@pytest.mark.parametrize("num_rows", [1, 6, 24, 70])
def test_fused_weights_and_the_gate_up(num_rows) -> None:
    """A QKV-like weight in two formats (Q4_K beside a Q6_K V) and a [gate | up] weight whose silu(gate) * up
    comes from the kernel."""
    cols = 512
    parts = [QuantizedWeight.from_blocks(int(t), random_blocks(t, rows, cols, seed=rows), cols, interleave=True)
             for t, rows in ((T.Q4_K, 64), (T.Q4_K, 16), (T.Q6_K, 16))]
    fused = concat_rows(parts)
    assert fused.interleaved and [s.rows for s in fused.segments] == [80, 16]
    w = torch.cat([p.dequantize(torch.float64) for p in parts])
    x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(num_rows)).bfloat16()
    got = torch.ops.kvserve.quant_linear(x, fused.data, fused.types, cols, None, GEMV_ROWS, FUSED_ROWS)
    assert_close(got, reference(x, w))

    gate_up = concat_rows([QuantizedWeight.from_blocks(int(T.Q4_K), random_blocks(T.Q4_K, 48, cols, seed=s), cols,
                                                       interleave=True) for s in (1, 2)])
    gate, up = reference(x, gate_up.dequantize(torch.float64)).chunk(2, dim=-1)
    got = torch.ops.kvserve.quant_linear_silu_mul(x, gate_up.data, gate_up.types, cols, GEMV_ROWS, FUSED_ROWS)
    ref = F.silu(gate) * up
    torch.testing.assert_close(got.double(), ref, rtol=2 * RTOL, atol=2 * RTOL * ref.abs().max().item())


@needs_interleaved
def test_bad_layouts_are_clear_errors() -> None:
    x = torch.randn(1, 256).bfloat16()
    inter = QuantizedWeight.from_blocks(int(T.Q4_K), random_blocks(T.Q4_K, 16, 256), 256, interleave=True)
    planar = QuantizedWeight.from_blocks(int(T.Q4_K), random_blocks(T.Q4_K, 16, 256), 256)
    with pytest.raises(RuntimeError, match="all interleaved or none"):
        torch.ops.kvserve.quant_linear(x, [*inter.data, *planar.data], [*inter.types, *planar.types], 256, None, 4, 64)
    with pytest.raises(RuntimeError, match="not whole groups of 16"):
        torch.ops.kvserve.quant_linear(x, [planar.data[0][:8].contiguous()], list(inter.types), 256, None, 4, 64)
    with pytest.raises(RuntimeError, match="whole groups of gate rows"):  # 8 gate rows, 8 up rows
        torch.ops.kvserve.quant_linear_silu_mul(x, list(inter.data), list(inter.types), 256, 4, 64)


def test_the_plan_interleaves_where_the_build_has_the_kernels() -> None:
    shape = ArchConfig("qwen2", vocab_size=256, hidden_size=896, intermediate_size=256, num_layers=2, num_heads=14,
                       num_kv_heads=2, head_dim=64, max_position_embeddings=4096)
    with_kernels = CpuKernels(gemv_bf16=True, avx512=True, quantized_gemv=True, quantized_interleave_rows=16)
    without = CpuKernels(gemv_bf16=True, avx512=True, quantized_gemv=True)
    plan = plan_kernels(with_kernels, torch.bfloat16, shape)
    assert plan.quantized_interleaved and plan.quantized_fused_max_rows == QUANTIZED_INTERLEAVED_MAX_ROWS
    assert f"interleaved, int8 dot products up to {QUANTIZED_INTERLEAVED_MAX_ROWS} rows" in plan.description
    amx = CpuKernels(gemv_bf16=True, amx=True, avx512=True, quantized_gemv=True, quantized_interleave_rows=16)
    plan = plan_kernels(amx, torch.bfloat16, shape)
    assert plan.quantized_interleaved and plan.quantized_fused_max_rows == 0  # the AMX slabs past the few rows
    assert not plan_kernels(without, torch.bfloat16, shape).quantized_interleaved
    assert not plan_kernels(with_kernels, torch.float32, shape).quantized_interleaved


def test_the_plan_takes_int8_activations_at_every_width_where_it_can() -> None:
    shape = ArchConfig("qwen2", vocab_size=256, hidden_size=896, intermediate_size=256, num_layers=2, num_heads=14,
                       num_kv_heads=2, head_dim=64, max_position_embeddings=4096)
    with_kernels = CpuKernels(gemv_bf16=True, avx512=True, quantized_gemv=True, quantized_interleave_rows=16)
    plan = plan_kernels(with_kernels, torch.bfloat16, shape, int8_activations=True)
    assert plan.quantized_int8_activations and plan.quantized_fused_max_rows == QUANTIZED_INT8_MAX_ROWS
    assert plan.quantized_widths is not None and plan.quantized_widths.int8_activations
    assert "int8 dot products at every width, int8 activations" in plan.description and not plan.fallbacks
    assert not plan_kernels(with_kernels, torch.bfloat16, shape).quantized_int8_activations  # int16 unless asked
    amx = CpuKernels(gemv_bf16=True, amx=True, avx512=True, quantized_gemv=True, quantized_interleave_rows=16)
    plan = plan_kernels(amx, torch.bfloat16, shape, int8_activations=True)
    assert plan.quantized_int8_activations and plan.quantized_fused_max_rows == 0
    assert "int8 activations up to 4 rows: wider inputs take the AMX tiles" in plan.description
    planar = CpuKernels(gemv_bf16=True, avx512=True, quantized_gemv=True)
    plan = plan_kernels(planar, torch.bfloat16, shape, int8_activations=True)
    assert not plan.quantized_int8_activations and plan.quantized_fused_max_rows == QUANTIZED_FUSED_MAX_ROWS
    assert "int16 activations: int8 ones need the interleaved kernels" in plan.description


@needs_interleaved
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 3, 8, 13, 70])
def test_int8_activations_match_a_float64_reference(qtype, num_rows) -> None:
    """One int8 level per 32 values at every width (no residual, no slabs), against exactly that, the
    [gate | up] weight's silu(gate) * up included."""
    ops = torch.ops.kvserve
    for rows, cols in shapes_of(qtype):
        blocks = random_blocks(qtype, rows, cols, seed=num_rows + 1)
        weight = QuantizedWeight.from_blocks(int(qtype), blocks, cols, interleave=True)
        w = torch.from_numpy(dequantize(blocks, qtype)).double()
        x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(rows + 1)).bfloat16()
        bias = torch.randn(rows).bfloat16()
        got = ops.quant_linear(x, weight.data, weight.types, cols, None if num_rows == 8 else bias, GEMV_ROWS,
                               QUANTIZED_INT8_MAX_ROWS, True)
        assert_close(got, int8_activations(x, block=32) @ w.T + (0 if num_rows == 8 else bias.double()))
    gate_up = concat_rows([QuantizedWeight.from_blocks(int(qtype), random_blocks(qtype, rows, cols, seed=s), cols,
                                                       interleave=True) for s in (1, 2)])
    gate, up = (int8_activations(x, block=32) @ gate_up.dequantize(torch.float64).T).chunk(2, dim=-1)
    got = ops.quant_linear_silu_mul(x, gate_up.data, gate_up.types, cols, GEMV_ROWS, QUANTIZED_INT8_MAX_ROWS, True)
    ref = F.silu(gate) * up
    torch.testing.assert_close(got.double(), ref, rtol=2 * RTOL, atol=2 * RTOL * ref.abs().max().item())


@needs_interleaved
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_int8_activations_give_each_row_what_it_gets_alone(qtype) -> None:
    """With int8 activations a row's products do not depend on how many rows come with it, at any width
    (drafts verified beside their request, a request decoded beside others, a prompt in chunks of any size);
    and they are not the int16 activations' products (the test can tell)."""
    rows, cols = shapes_of(qtype)[-1]
    weight = QuantizedWeight.from_blocks(int(qtype), random_blocks(qtype, rows, cols, seed=7), cols, interleave=True)
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(9)).bfloat16()
    ops = torch.ops.kvserve

    def products(inputs: torch.Tensor, int8: bool = True) -> torch.Tensor:
        return ops.quant_linear(inputs, weight.data, weight.types, cols, None, GEMV_ROWS, QUANTIZED_INT8_MAX_ROWS,
                                int8)

    together = products(x)
    for i in (0, 7, 8, 33, 69):
        assert torch.equal(together[i : i + 1], products(x[i : i + 1]))
    assert torch.equal(together[5:18], products(x[5:18]))
    assert not torch.equal(together[:8], products(x[:8], int8=False))


@needs_interleaved
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_each_rows_one_level_products_do_not_depend_on_the_rows_beside_it(qtype) -> None:
    """A request's drafts are verified as extra rows of one step: at one int8 level each row's products are
    bit for bit what the row alone gives, so speculation changes no logit of plain decoding."""
    rows, cols = shapes_of(qtype)[-1]
    weight = QuantizedWeight.from_blocks(int(qtype), random_blocks(qtype, rows, cols, seed=7), cols, interleave=True)
    gate_up = QuantizedWeight.from_blocks(int(qtype), random_blocks(qtype, 2 * rows, cols, seed=8), cols,
                                          interleave=True)
    x = torch.randn(13, cols, generator=torch.Generator().manual_seed(9)).bfloat16()
    ops = torch.ops.kvserve
    for num_rows in (5, 8, 13):
        together = ops.quant_linear(x[:num_rows], weight.data, weight.types, cols, None, num_rows, FUSED_ROWS)
        fused = ops.quant_linear_silu_mul(x[:num_rows], gate_up.data, gate_up.types, cols, num_rows, FUSED_ROWS)
        for i in range(num_rows):
            alone = ops.quant_linear(x[i : i + 1], weight.data, weight.types, cols, None, GEMV_ROWS, FUSED_ROWS)
            assert torch.equal(together[i : i + 1], alone)
            alone = ops.quant_linear_silu_mul(x[i : i + 1], gate_up.data, gate_up.types, cols, GEMV_ROWS, FUSED_ROWS)
            assert torch.equal(fused[i : i + 1], alone)
    # The residual level (the default past the few-row limit) does change them: the test can tell.
    two_levels = ops.quant_linear(x[:8], weight.data, weight.types, cols, None, GEMV_ROWS, FUSED_ROWS)
    one_level = ops.quant_linear(x[:8], weight.data, weight.types, cols, None, 8, FUSED_ROWS)
    assert not torch.equal(two_levels, one_level)


def test_a_decode_step_takes_one_level_for_every_row_and_a_prompt_chunk_two_past_the_few_rows() -> None:
    levels = ActivationLevels(few_rows=4)
    levels.set_step(num_decode_requests=1, num_rows=5, has_prefill=False)  # one request, four drafts
    assert levels.one_level_rows == 5
    levels.set_step(num_decode_requests=4, num_rows=20, has_prefill=False)
    assert levels.one_level_rows == 20
    levels.set_step(num_decode_requests=16, num_rows=16, has_prefill=False)  # plain decoding of 16: one level
    assert levels.one_level_rows == 16
    levels.set_step(num_decode_requests=16, num_rows=40, has_prefill=True)  # with a prompt chunk: two levels
    assert levels.one_level_rows == 4
    levels.set_step(num_decode_requests=2, num_rows=2, has_prefill=False)
    assert levels.one_level_rows == 4
    levels.set_step(num_decode_requests=0, num_rows=30, has_prefill=True)  # a prompt chunk alone
    assert levels.one_level_rows == 4
    # On AMX, whose tiles take the wider inputs, only a few requests' decode steps take one level.
    amx = ActivationLevels(few_rows=4, every_decode_step=False)
    amx.set_step(num_decode_requests=4, num_rows=20, has_prefill=False)
    assert amx.one_level_rows == 20
    amx.set_step(num_decode_requests=5, num_rows=10, has_prefill=False)
    assert amx.one_level_rows == 4
