"""A speculators checkpoint whose ``d2t`` is deliberately shifted by one draft id: a valid map (inside the
target vocabulary, one-to-one, ``t2d`` agreeing), so start-up takes it, but every drafted token is the wrong
target id. Through ``LLM.generate`` it accepts almost nothing and the output is still the target's own.

Two engines (the session's target-alone baseline and one DSpark engine)."""

from __future__ import annotations

import pytest

from tests.helpers import MAX_TOKENS, family_draft
from vllm_dspark.tools.bench.engine import acceptance_summary, llm_engine, spec_metrics

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def shifted_run(qwen_pair, prompts, tmp_path_factory):
    from vllm import SamplingParams

    draft, _ = family_draft(qwen_pair, tmp_path_factory.mktemp("shifted"), "speculators", shift=1)
    spec = {"method": "dspark", "model": str(draft), "dspark": {"verification": "fixed"}}
    with llm_engine(qwen_pair["target"], speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        metrics = spec_metrics(llm)
    return tokens, acceptance_summary(metrics)


def test_a_shifted_d2t_accepts_almost_nothing_and_stays_lossless(shifted_run, qwen_baseline):
    tokens, s = shifted_run
    assert tokens == qwen_baseline
    assert s["num_drafts"] > 0 and s["mean_acceptance_length"] < 1.2, s
