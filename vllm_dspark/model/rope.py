"""Rotary position embeddings for the reference drafter (plain, linear, YaRN).

NeoX layout (rotate halves), as Qwen3 and vLLM's ``get_rope(is_neox_style=True)``
use. YaRN follows the paper's definition (arXiv 2309.00071): per-dimension
blend of interpolated and extrapolated frequencies over a linear ramp between
the beta_fast / beta_slow correction dimensions, and cos/sin scaled by
``0.1 * ln(factor) + 1``.
"""

from __future__ import annotations

import math

import torch


def rope_cos_sin(positions: torch.Tensor, inv_freq64: torch.Tensor, mscale: float,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, rot_dim]`` = cat(cos, sin) * mscale at ``positions``, angles in fp64.

    The layout of vLLM's ``cos_sin_cache`` rows, computed for just the positions
    asked for: exact to ``dtype`` rounding at any position (no table, no
    position limit). ``positions`` up to 2^53 are exact in fp64.
    """
    ang = positions.to(torch.float64).reshape(-1, 1) * inv_freq64.to(positions.device)[None, :]
    ang = torch.remainder(ang, 2 * math.pi)
    return (torch.cat([ang.cos(), ang.sin()], dim=-1) * mscale).to(dtype)


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def rope_inv_freq_and_scale(head_dim: int, theta: float, scaling: dict | None,
                            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] in ``dtype`` and the cos/sin magnitude scale.

    fp32 gives the frequencies the reference drafter and Hugging Face use. fp64
    is the long-context path's: an fp32 frequency carries a relative error of up
    to 6e-8, which at position 1,048,575 alone moves the highest-frequency angle
    by ~0.06 rad; fp64 frequencies and angles keep every angle exact to fp32 rounding.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=dtype) / head_dim
    inv_freq = 1.0 / (float(theta) ** exponents)
    rtype = None if not scaling else scaling.get("rope_type", scaling.get("type"))
    if rtype in (None, "default"):
        return inv_freq, 1.0
    assert scaling is not None  # rtype is None without scaling
    factor = float(scaling["factor"])
    if rtype == "linear":
        return inv_freq / factor, 1.0
    if rtype != "yarn":
        raise ValueError(f"rope_type {rtype!r} is not supported by the DSpark drafter")
    orig = int(scaling.get("original_max_position_embeddings", 4096))
    low = math.floor(_yarn_correction_dim(float(scaling.get("beta_fast", 32)), head_dim, theta, orig))
    high: float = math.ceil(_yarn_correction_dim(float(scaling.get("beta_slow", 1)), head_dim, theta, orig))
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=dtype) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1.0 - ramp  # 1 keeps the original (high) frequency
    inv_freq = (inv_freq / factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    mscale = float(scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0))
    return inv_freq, mscale


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float) -> torch.Tensor:
    """Rotate ``x`` [..., T, heads, head_dim] at ``positions`` [..., T] (NeoX halves).

    Angles are taken in fp64 so positions far past the trained context stay exact
    (``inv_freq`` may be the fp32 or the fp64 frequencies).
    """
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(x.device, torch.float64)  # [..., T, hd/2]
    cos = (angles.cos() * mscale).float().unsqueeze(-2)  # [..., T, 1, hd/2]
    sin = (angles.sin() * mscale).float().unsqueeze(-2)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
