"""Shared fixtures of the foundation tests: the reference configs and tiny checkpoints.

Everything here is small enough to build in well under a second on one core.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_dspark.config import DSparkConfig

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference"
K3_CONFIG = REFERENCE / "kimi-k3-dspark.config.json"
QWEN3_CONFIG = REFERENCE / "qwen3-8b-dspark.config.json"


def k3_dict() -> dict:
    return json.loads(K3_CONFIG.read_text())


def tiny_config(**changes) -> DSparkConfig:
    """A drafter small enough to run in milliseconds; every feature switched on."""
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=96, vocab_size=80, max_position_embeddings=512, rope_theta=10000.0,
              dtype="bfloat16", block_size=5, target_layer_ids=(0, 2), num_target_layers=4,
              mask_token_id=79, markov_rank=8, enable_confidence_head=True, confidence_head_with_markov=True)
    kw.update(changes)
    return DSparkConfig(**kw)


@pytest.fixture(scope="session", autouse=True)
def _reference_configs_present():
    if not K3_CONFIG.is_file() or not QWEN3_CONFIG.is_file():
        pytest.fail(f"reference configs missing under {REFERENCE}")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A tiny random checkpoint in SpecForge's export layout (read-only: copy before corrupting)."""
    from vllm_dspark.testing.tiny import make_drafter

    return make_drafter(tmp_path_factory.mktemp("ckpt") / "tiny", tiny_config(), mode="random", seed=1)
