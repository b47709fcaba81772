"""Tiny target/drafter pairs and the no-speculation baseline, shared by the engine tests.

Each test module starts its own engine once (module scope); the baseline
engine runs once per session and is shut down before the next one starts.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dspark.testing.engine import llm_engine
from vllm_dspark.testing.tiny import drafter_config_for, make_drafter, make_target, random_bigram

VOCAB = 384
NUM_PROMPTS = 16
MAX_TOKENS = 32


def make_prompts(n: int = NUM_PROMPTS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3 + (7 * i) % 41 for i in range(n)]  # 3..43 tokens, all different
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in lengths]


@pytest.fixture(scope="session")
def qwen_pair(tmp_path_factory):
    """Qwen3 target (bigram-like) + DSpark drafter: Markov head mostly right, backbone live."""
    root = tmp_path_factory.mktemp("qwen_pair")
    bigram = random_bigram(VOCAB, seed=3)
    target = make_target(root / "target", arch="qwen3", vocab_size=VOCAB, bigram=bigram, num_layers=4)
    cfg = drafter_config_for(target, block_size=7, markov_rank=64, target_layer_ids=(0, 1, 2))
    # A drafter that knows 80% of the table: real rejections, real acceptances.
    wrong = bigram.clone()
    g = torch.Generator().manual_seed(11)
    flip = torch.rand(VOCAB, generator=g) < 0.2
    wrong[flip] = torch.randint(0, 256, (int(flip.sum()),), generator=g)
    draft = make_drafter(root / "draft", cfg, mode="oracle", bigram=wrong, backbone_scale=0.05, seed=5)
    return {"target": str(target), "draft": str(draft), "bigram": bigram, "config": cfg}


@pytest.fixture(scope="session")
def prompts():
    return make_prompts()


@pytest.fixture(scope="session")
def qwen_baseline(qwen_pair, prompts):
    """Greedy tokens of the target alone, per prompt."""
    from vllm import SamplingParams

    with llm_engine(qwen_pair["target"]) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]
