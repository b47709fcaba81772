"""Rotary position embeddings for the reference drafter (plain, linear, YaRN).

NeoX layout (rotate halves), as Qwen3 and vLLM's ``get_rope(is_neox_style=True)``
use. YaRN follows the paper's definition (arXiv 2309.00071) exactly as Hugging
Face's ``_compute_yarn_parameters`` (transformers' ``modeling_rope_utils``)
applies it, since that is what the drafters were trained with: a per-dimension
blend of interpolated and extrapolated frequencies over a linear ramp between
the ``beta_fast`` / ``beta_slow`` correction dimensions (floored / ceiled unless
``truncate`` is false), and cos/sin scaled by ``attention_factor``, else by
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set,
else by ``0.1 * ln(factor) + 1``. ``tests/model/test_rope_yarn.py`` compares
both against transformers' own function. ``partial_rotary_factor`` below 1 is
refused by name (the drafter rotates whole heads).
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``scale`` times (1 when not stretched)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """The cos/sin magnitude Hugging Face uses for a YaRN ``scaling`` dict.

    ``attention_factor`` when given; else, when ``mscale`` and ``mscale_all_dim``
    are both set and non-zero (DeepSeek's convention),
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, which is 1.0 for
    ``mscale == mscale_all_dim``; else ``0.1 * ln(factor) + 1``.
    """
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim)))
    return _yarn_mscale(factor)


def yarn_correction_range(head_dim: int, theta: float, scaling: dict) -> tuple[float, float]:
    """[low, high] dimensions of YaRN's ramp, floored / ceiled unless ``truncate`` is false, clipped to the head."""
    orig = scaling.get("original_max_position_embeddings")
    if orig is None:
        raise ValueError("rope_scaling.original_max_position_embeddings: missing for YaRN; Hugging Face takes "
                         "max_position_embeddings there (DSparkConfig fills it in); set it in the rope dict")
    beta_fast = float(scaling.get("beta_fast") or 32)  # HF: a missing or zero beta takes the paper's value
    beta_slow = float(scaling.get("beta_slow") or 1)
    low: float = _yarn_correction_dim(beta_fast, head_dim, theta, int(orig))
    high: float = _yarn_correction_dim(beta_slow, head_dim, theta, int(orig))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def rope_inv_freq_and_scale(head_dim: int, theta: float, scaling: dict | None,
                            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] in ``dtype`` and the cos/sin magnitude scale.

    fp32 gives the frequencies the reference drafter and Hugging Face use (the
    same operations in the same order as ``_compute_yarn_parameters``). fp64
    is the long-context path's: an fp32 frequency carries a relative error of up
    to 6e-8, which at position 1,048,575 alone moves the highest-frequency angle
    by ~0.06 rad; fp64 frequencies and angles keep every angle exact to fp32 rounding.

    Raises
    ------
    ValueError
        A rope type other than default / linear / yarn, a YaRN dict without
        ``original_max_position_embeddings``, or ``partial_rotary_factor`` != 1.
    """
    pos_freqs = float(theta) ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim)  # [head_dim // 2]
    inv_freq = 1.0 / pos_freqs
    rtype = None if not scaling else scaling.get("rope_type", scaling.get("type"))
    if rtype in (None, "default"):
        return inv_freq, 1.0
    assert scaling is not None  # rtype is None without scaling
    factor = float(scaling["factor"])
    if rtype == "linear":
        return inv_freq / factor, 1.0
    if rtype != "yarn":
        raise ValueError(f"rope_type {rtype!r} is not supported by the DSpark drafter")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"rope_scaling.partial_rotary_factor: got {scaling['partial_rotary_factor']!r}; the "
                         "DSpark drafter rotates whole heads (1.0)")
    low, high = yarn_correction_range(head_dim, theta, scaling)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=dtype) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1.0 - ramp  # 1 keeps the original (high) frequency
    interpolated = 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq, yarn_attention_factor(scaling)


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
