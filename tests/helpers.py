"""Shared test data: the reference configs (inside the repository) and a tiny drafter config."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_dspark.config import DSparkConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures"
K3_CONFIG = FIXTURES / "kimi-k3-dspark.config.json"
QWEN3_CONFIG = FIXTURES / "qwen3-8b-dspark.config.json"
K3_PARAMS = 2_249_289_601


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


# The engine tests' tiny Qwen3 pair and prompts (fixtures in tests/conftest.py).
VOCAB = 384
NUM_PROMPTS = 16
MAX_TOKENS = 32


def make_prompts(n: int = NUM_PROMPTS, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = [3 + (7 * i) % 41 for i in range(n)]  # 3..43 tokens, all different
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in lengths]
