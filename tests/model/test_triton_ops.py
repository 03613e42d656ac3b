"""The CUDA backend's element-wise Triton kernels (model/backends/triton_ops.py), run by Triton's interpreter on
CPU tensors, against the torch reference ops they replace."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import load_cuda_backend, triton_interpreter  # noqa: F401

load_cuda_backend()

from kvserve.model.backends import triton_ops  # noqa: E402
from kvserve.model.layers import apply_rotary  # noqa: E402
from kvserve.model.ops import torch_add_rms_norm, torch_silu_mul  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")


BF16_ULP = 2.0**-7  # relative: one unit in the last place of a bf16 value, at most


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: to rounding; bf16: within one unit in the last place (a sum's order may differ)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), expected.float(), atol=0.0, rtol=BF16_ULP)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_the_reference(dtype, with_residual) -> None:
    torch.manual_seed(0)
    wide = torch.randn(5, 100, dtype=dtype)
    x = wide[:, :72]  # rows of a wider tensor
    residual = torch.randn(5, 72, dtype=dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(72)).to(dtype)
    out, total = triton_ops.add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_total = torch_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, expected_total)  # the sum rounds as torch's add
    close(out, expected_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_the_reference(dtype) -> None:
    torch.manual_seed(1)
    gate_up = 3 * torch.randn(3, 2 * 1100, dtype=dtype)  # wider than one program's columns
    close(triton_ops.silu_mul(gate_up), torch_silu_mul(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_the_reference(dtype) -> None:
    torch.manual_seed(2)
    qkv = torch.randn(4, 7, 32, dtype=dtype)
    qk = qkv[:, :6]  # the Q and K heads of the QKV projection's output
    angles = torch.randn(4, 1, 32)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got, expected = triton_ops.rotary(qk, cos, sin), apply_rotary(qk, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)  # the same products, rounded where torch rounds them
    else:
        close(got, expected)


def test_inputs_whose_rows_are_not_contiguous_take_the_reference_ops() -> None:
    heads = torch.randn(3, 4, 16)  # a QK-norm's [tokens, heads, dim]
    weight = torch.randn(16)
    out, total = triton_ops.add_rms_norm(heads, None, weight, 1e-6)
    expected, _ = torch_add_rms_norm(heads, None, weight, 1e-6)
    assert torch.equal(out, expected) and total is heads
    columns = torch.randn(8, 6).t()
    assert torch.equal(triton_ops.silu_mul(columns), torch_silu_mul(columns))
