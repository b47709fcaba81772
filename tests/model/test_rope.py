"""Rotary angles far past the trained context: exact to fp32 rounding at position 1,048,575."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import K3_CONFIG
from vllm_dspark.config import DSparkConfig
from vllm_dspark.model.rope import rope_cos_sin, rope_inv_freq_and_scale

FAR = 1_048_575


def _reference(pos: int, inv_freq64: torch.Tensor, mscale: float) -> np.ndarray:
    """cos/sin in x87 extended precision (64-bit mantissa) from the fp64 frequencies."""
    ang = np.array([np.longdouble(pos) * np.longdouble(float(f)) for f in inv_freq64])
    return np.concatenate([np.cos(ang), np.sin(ang)]).astype(np.float64) * mscale


@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 60, reason="needs x87 extended precision")
def test_k3_yarn_rope_is_exact_at_one_million():
    cfg = DSparkConfig.from_json(K3_CONFIG)
    f64, mscale = rope_inv_freq_and_scale(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, torch.float64)
    got = rope_cos_sin(torch.tensor([FAR]), f64, mscale)[0].double().numpy()
    err = np.abs(got - _reference(FAR, f64, mscale)).max()
    assert err <= 1.2e-7 * mscale, err  # fp32 rounding of values of magnitude <= mscale
    # What a table built the usual way (fp32 frequencies, fp32 position x frequency) loses there:
    f32, _ = rope_inv_freq_and_scale(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    naive = (torch.tensor([float(FAR)]) * f32).double().numpy()
    exact = np.array([float(np.longdouble(FAR) * np.longdouble(float(f))) for f in f64])
    assert np.abs(naive - exact).max() > 0.01  # ~0.04 rad: the FACTS.md figure


def test_exact_table_matches_small_positions_of_the_fp32_formula():
    cfg = DSparkConfig.from_json(K3_CONFIG)
    f64, mscale = rope_inv_freq_and_scale(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, torch.float64)
    f32, m32 = rope_inv_freq_and_scale(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert mscale == pytest.approx(m32)
    torch.testing.assert_close(f64.float(), f32, rtol=2e-7, atol=0)
    pos = torch.arange(0, 64)
    ang = pos[:, None].double() * f64[None, :]
    want = torch.cat([ang.cos(), ang.sin()], dim=-1) * mscale
    torch.testing.assert_close(rope_cos_sin(pos, f64, mscale).double(), want, atol=1e-7, rtol=0)
