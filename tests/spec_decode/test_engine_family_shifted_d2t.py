"""A speculators checkpoint whose ``d2t`` is deliberately shifted by one draft id: a valid map (inside the
target vocabulary, one-to-one, ``t2d`` agreeing), so start-up takes it, but every drafted token is the wrong
target id. Through ``LLM.generate`` it accepts almost nothing and the output is still the target's own.

Two engines (the session's target-alone baseline and one DSpark engine)."""

from __future__ import annotations

import pytest

from tests.helpers import family_draft, greedy_fixed_run

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def shifted_run(qwen_pair, prompts, tmp_path_factory):
    draft, _ = family_draft(qwen_pair, tmp_path_factory.mktemp("shifted"), "speculators", shift=1)
    return greedy_fixed_run(qwen_pair["target"], draft, prompts)


def test_a_shifted_d2t_accepts_almost_nothing_and_stays_lossless(shifted_run, qwen_baseline):
    tokens, s = shifted_run
    assert tokens == qwen_baseline
    assert s["num_drafts"] > 0 and s["mean_acceptance_length"] < 1.2, s
