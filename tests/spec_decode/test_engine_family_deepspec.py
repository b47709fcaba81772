"""A DeepSpec-native checkpoint (``Qwen3DSparkModel``, flat keys, the target's ``embed_tokens`` / ``lm_head``
saved beside the drafter) served through ``LLM.generate`` with ``method: "dspark"`` on the V1 runner: presented
to vLLM as a SpecForge export, its copies found equal to the target's and dropped, the output the target's own,
and an oracle drafter accepted almost always.

Two engines (the session's target-alone baseline and one DSpark engine)."""

from __future__ import annotations

import pytest

from tests.helpers import family_draft, greedy_fixed_run
from vllm_dspark.config import DSparkConfig

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def deepspec_run(qwen_pair, prompts, tmp_path_factory):
    draft, _ = family_draft(qwen_pair, tmp_path_factory.mktemp("deepspec"), "deepspec")
    return (DSparkConfig.from_json(draft), *greedy_fixed_run(qwen_pair["target"], draft, prompts))


def test_a_deepspec_checkpoint_is_lossless(deepspec_run, qwen_baseline):
    cfg, tokens, _ = deepspec_run
    assert cfg.family == "deepspec" and cfg.sample_from_anchor  # absent from its config.json: true
    assert tokens == qwen_baseline


def test_a_deepspec_oracle_is_accepted_almost_always(deepspec_run):
    cfg, _, s = deepspec_run
    drafts = cfg.num_draft_tokens  # 7: anchor-first, block 7
    assert s["num_draft_tokens"] == drafts * s["num_drafts"], s
    # The table is exact (Markov rank = the vocabulary: tests.helpers.family_draft). With rank 64 the random
    # rows' crosstalk mapped a few tokens wrongly and the cycling greedy answers met them again and again:
    # 1 + 0.85 x drafts at best.
    assert s["mean_acceptance_length"] >= 1 + 0.9 * drafts, s
