"""Building blocks shared by the model families: RMSNorm and rotary embeddings.

Plain tensors and functions rather than nn.Modules: a decode step runs ~15 ops per layer, and module
call overhead is a visible share of a small model's step time on CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvserve.arch import RopeScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back, as the Hugging Face reference does."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return normed * weight


class RotaryEmbedding:
    """Neox-style rotary embedding (rotate halves), the Hugging Face Llama/Qwen layout.

    cos/sin tables are computed once in float32 for every position and cast to the model dtype; a step
    looks them up by position once and every layer reuses the result.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, dtype: torch.dtype, device: torch.device,
                 scaling: RopeScaling | None = None, rotary_dim: int = 0):
        """``rotary_dim``: the head's dimensions that rotate (0: all), those the loader put at the head of each
        half (``ArchConfig.rotary_dim``); the others get the identity (cos 1, sin 0)."""
        rotated = rotary_dim or head_dim
        wavelengths = theta ** (torch.arange(0, rotated, 2, dtype=torch.int64).float() / rotated)
        inv_freq = 1.0 / wavelengths
        if scaling is not None and scaling.kind == "yarn":
            inv_freq = yarn_inv_freq(wavelengths, theta, scaling)
        elif scaling is not None and scaling.kind == "longrope":  # transformers' order: factor, then reciprocal
            inv_freq = 1.0 / (torch.tensor(scaling.freq_factors, dtype=torch.float32) * wavelengths)
        elif scaling is not None:
            inv_freq = scaled_inv_freq(inv_freq, scaling)
        magnitude = scaling.magnitude if scaling is not None else 1.0
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)  # [max_positions, rotated / 2]
        cos, sin = freqs.cos(), freqs.sin()
        if magnitude != 1.0:
            cos, sin = cos * magnitude, sin * magnitude
        if rotated < head_dim:  # the dimensions that do not rotate: the identity, unscaled
            still = head_dim // 2 - rotated // 2
            cos = torch.cat((cos, torch.ones(max_positions, still)), dim=-1)
            sin = torch.cat((sin, torch.zeros(max_positions, still)), dim=-1)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        self.cos = cos.to(dtype=dtype, device=device)  # [max_positions, head_dim]
        # sin with its first half negated: rotate_half(x) * sin == cat(x2, x1) * signed_sin, one op fewer.
        sin[:, : head_dim // 2] *= -1
        self.signed_sin = sin.to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, head_dim]: broadcast over heads
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/signed_sin: [num_tokens, 1, head_dim] from ``lookup``.

    Same arithmetic as Hugging Face's ``x * cos + rotate_half(x) * sin`` (negation is exact).
    """
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """The rotary frequencies stretched as transformers' rope initialisers stretch them (see RopeScaling)."""
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "freq_factors":
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=inv_freq.dtype)
    assert scaling.kind == "llama3", scaling.kind
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(wavelengths: torch.Tensor, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's rotary frequencies, as transformers' ``_compute_yarn_parameters`` computes them
    (llama.cpp's ``rope_yarn`` is the same arithmetic): ``wavelengths`` are ``theta ** (2i / head_dim)``.
    Frequencies that turn fewer than ``beta_slow`` times over the original context are divided by the
    factor, those that turn more than ``beta_fast`` times kept, those between blended along a linear ramp."""
    dim = 2 * wavelengths.numel()

    def correction_dim(rotations: float) -> float:
        context = scaling.original_max_position_embeddings
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp's width, never zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of each frequency left as it was trained
    return 1.0 / (scaling.factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept
