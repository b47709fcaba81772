"""YaRN as the producers trained with it: frequencies and magnitude equal Hugging Face's own function.

``mscale`` / ``mscale_all_dim`` (DeepSeek's magnitude convention) and ``truncate: false`` used to be
accepted and ignored: with mscale = mscale_all_dim = 1 the rope scaled cos/sin by 1.277 where
transformers scales by 1.0, and truncate: false moved inverse frequencies by up to 31%.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_dspark.model.rope import rope_inv_freq_and_scale

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import _compute_yarn_parameters  # noqa: E402

# (head_dim, rope_theta, YaRN keys); max_position_embeddings is factor x original (no HF warning).
CASES = [
    (64, 10000.0, {"factor": 16.0, "original_max_position_embeddings": 4096}),
    (64, 10000.0, {"factor": 16.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}),
    (128, 1e6, {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707}),
    (192, 10000.0, {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    (128, 1e7, {"factor": 32.0, "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False}),
    (64, 10000.0, {"factor": 16.0, "original_max_position_embeddings": 4096, "truncate": False}),
    (128, 1e6, {"factor": 4.0, "original_max_position_embeddings": 128, "attention_factor": 1.5}),
    (64, 5e5, {"factor": 8.0, "original_max_position_embeddings": 2048, "mscale": 1.0, "mscale_all_dim": 0.0}),
    (128, 1e6, {"factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2}),
]


def _hf(head_dim: int, theta: float, keys: dict) -> tuple[torch.Tensor, float]:
    max_pos = int(keys["factor"] * keys["original_max_position_embeddings"])
    cfg = transformers.Qwen3Config(head_dim=head_dim, hidden_size=head_dim * 4, num_attention_heads=4,
                                   max_position_embeddings=max_pos,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": theta, **keys})
    return _compute_yarn_parameters(cfg, "cpu")


@pytest.mark.parametrize("head_dim,theta,keys", CASES, ids=[str(i) for i in range(len(CASES))])
def test_yarn_equals_transformers(head_dim, theta, keys):
    want_freq, want_scale = _hf(head_dim, theta, keys)
    freq, scale = rope_inv_freq_and_scale(head_dim, theta, {"rope_type": "yarn", **keys})
    assert torch.equal(freq, want_freq)  # the same fp32 operations in the same order
    assert scale == pytest.approx(want_scale, rel=1e-15)
    freq64, scale64 = rope_inv_freq_and_scale(head_dim, theta, {"rope_type": "yarn", **keys}, torch.float64)
    # The long-context path: the same frequencies to fp32 rounding of theta ** x (a few ulps).
    torch.testing.assert_close(freq64.float(), want_freq, rtol=1e-6, atol=0)
    assert scale64 == scale


def test_equal_mscales_cancel_as_in_transformers():
    keys = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096}
    assert rope_inv_freq_and_scale(64, 1e4, keys)[1] == pytest.approx(0.1 * math.log(16) + 1)  # 1.277
    assert rope_inv_freq_and_scale(64, 1e4, {**keys, "mscale": 1.0, "mscale_all_dim": 1.0})[1] == 1.0


def test_truncate_false_moves_the_ramp():
    keys = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096}
    on, _ = rope_inv_freq_and_scale(64, 1e4, keys)
    off, _ = rope_inv_freq_and_scale(64, 1e4, {**keys, "truncate": False})
    assert float(((off - on).abs() / on).max()) > 0.05


def test_partial_rotary_and_missing_original_context_are_refused_by_name():
    keys = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_inv_freq_and_scale(64, 1e4, {**keys, "partial_rotary_factor": 0.5})
    del keys["original_max_position_embeddings"]
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_inv_freq_and_scale(64, 1e4, keys)
