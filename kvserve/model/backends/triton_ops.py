"""The CUDA backend's element-wise ops in Triton, each one kernel where torch takes several: add + RMSNorm
(torch: the add, a float32 copy, the norm, the copy back, the weight's product), SiLU-and-multiply (the
activation and the product) and rotary (two products, a concatenation and a sum). A small model's decode
step runs a few of each per layer, and on a GPU each torch kernel costs microseconds however few values it
touches.

Each rounds where the torch reference (model/ops.py, model/layers.py) rounds in bf16, so that the two agree to
the order of a sum; in float32 they agree to rounding. Inputs whose rows are not contiguous take the
reference ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.model.layers import apply_rotary
from kvserve.model.ops import torch_add_rms_norm, torch_silu_mul

SILU_BLOCK = 1024  # columns per program of SiLU-and-multiply
# How a kernel rounds to the model's dtype where torch's ops round: not at all (float32), to bf16, to fp16.
NO_ROUNDING, BF16, FP16 = 0, 1, 2


@triton.jit
def _round(x, ROUNDING: tl.constexpr):
    """x (float32) rounded to the model's dtype, to nearest with ties to even, kept in float32. bf16 by its
    bits: Triton's interpreter (the tests) truncates a bf16 cast, where a GPU rounds it."""
    if ROUNDING == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    elif ROUNDING == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, stride_x, stride_residual, eps,
                         N: tl.constexpr, N_PAD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROUNDING: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, N_PAD)
    inside = i < N
    x = tl.load(x_ptr + row * stride_x + i, mask=inside, other=0.0)
    xf = x.to(tl.float32)
    if HAS_RESIDUAL:  # the sum in the model's dtype, as torch's add rounds it
        xf = _round(xf + tl.load(residual_ptr + row * stride_residual + i, mask=inside, other=0.0).to(tl.float32),
                    ROUNDING)
        tl.store(sum_ptr + row * N + i, xf.to(sum_ptr.dtype.element_ty), mask=inside)
    # the reference normalises in float32 and rounds before the weight's product
    normed = _round(xf / tl.sqrt(tl.sum(xf * xf, 0) / N + eps), ROUNDING)
    weight = tl.load(weight_ptr + i, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + i, _round(normed * weight, ROUNDING).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, width, BLOCK: tl.constexpr, ROUNDING: tl.constexpr):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = col < width
    gate = tl.load(x_ptr + row * stride_x + col, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + col, mask=inside, other=0.0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), ROUNDING)  # torch's SiLU rounds its output before the product
    tl.store(out_ptr + row * width + col, _round(silu * up, ROUNDING).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_token, num_heads, HEAD_DIM: tl.constexpr,
                   HEADS_PAD: tl.constexpr, ROUNDING: tl.constexpr):
    token = tl.program_id(0)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    inside = h < num_heads
    at = x_ptr + token * stride_token + h * HEAD_DIM
    x = tl.load(at + d, mask=inside, other=0.0).to(tl.float32)
    rotated = tl.load(at + (d + HEAD_DIM // 2) % HEAD_DIM, mask=inside, other=0.0).to(tl.float32)  # cat(x2, x1)
    cos = tl.load(cos_ptr + token * HEAD_DIM + d).to(tl.float32)
    sin = tl.load(sin_ptr + token * HEAD_DIM + d).to(tl.float32)
    # each product rounded, as torch's ops in the model's dtype round them
    total = _round(_round(x * cos, ROUNDING) + _round(rotated * sin, ROUNDING), ROUNDING)
    tl.store(out_ptr + (token * num_heads + h) * HEAD_DIM + d, total.to(out_ptr.dtype.element_ty), mask=inside)


def _rounding(dtype: torch.dtype) -> int:
    return BF16 if dtype == torch.bfloat16 else FP16 if dtype == torch.float16 else NO_ROUNDING


def _has_contiguous_rows(x: torch.Tensor) -> bool:
    """A 2-D tensor whose rows are each contiguous (any row stride)."""
    return x.dim() == 2 and x.stride(1) == 1


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual), as model/ops.py's torch_add_rms_norm."""
    if not _has_contiguous_rows(x) or (residual is not None and not _has_contiguous_rows(residual)):
        return torch_add_rms_norm(x, residual, weight, eps)
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    total = x if residual is None else torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _add_rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, total, x.stride(0),
                                  0 if residual is None else residual.stride(0), eps, N=n,
                                  N_PAD=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
                                  ROUNDING=_rounding(x.dtype))
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim, as model/ops.py's torch_silu_mul."""
    if not _has_contiguous_rows(gate_up):
        return torch_silu_mul(gate_up)
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(rows, triton.cdiv(width, SILU_BLOCK))](gate_up, out, gate_up.stride(0), width,
                                                             BLOCK=SILU_BLOCK, ROUNDING=_rounding(gate_up.dtype))
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (each token's heads contiguous) rotated, as model/layers.py's apply_rotary."""
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or dim & (dim - 1) or not cos.is_contiguous():
        return apply_rotary(x, cos, signed_sin)
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    _rotary_kernel[(tokens,)](x, cos, signed_sin.contiguous(), out, x.stride(0), heads, HEAD_DIM=dim,
                              HEADS_PAD=triton.next_power_of_2(heads), ROUNDING=_rounding(x.dtype))
    return out

