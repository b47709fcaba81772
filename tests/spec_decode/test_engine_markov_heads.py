"""A gated Markov head inside vLLM's V1 runner: the V1 model loads ``markov_head.gate_proj``, the stage
drafts its greedy rows on the compiled op with the head's arguments ("compiled" in the trace; a fallback
would say "reference-gated"), the output is still the target's own, and an exact oracle (the whole bigram
table, the gate open) is accepted almost always.

Two engines (the session's target-alone baseline and one DSpark engine)."""

from __future__ import annotations

import pytest

from tests.helpers import traced_family_run

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def gated_run(qwen_pair, prompts, tmp_path_factory):
    return traced_family_run(qwen_pair, prompts, tmp_path_factory.mktemp("gated"), "specforge", head="gated")


def test_a_gated_drafter_is_lossless_and_drafts_through_its_head(gated_run, qwen_baseline):
    cfg, _, tokens, _, records = gated_run
    assert cfg.markov_head_type == "gated"
    assert tokens == qwen_baseline
    paths = {r.get("path") for r in records if "draft" in r}
    # The Markov stage's greedy rows reach the op with the gated head's arguments (tests/ops and
    # tests/spec_decode/test_markov_heads.py check that it drafts the head, not a vanilla one).
    assert "compiled" in paths and None not in paths and "reference" not in paths, paths


def test_a_gated_oracle_is_accepted_almost_always(gated_run):
    cfg, _, _, s, _ = gated_run
    drafts = cfg.num_draft_tokens
    assert s["num_draft_tokens"] == drafts * s["num_drafts"] > 0, s
    assert s["mean_acceptance_length"] >= 1 + 0.9 * drafts, s
