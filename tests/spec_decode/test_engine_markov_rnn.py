"""An rnn Markov head and a SpecForge export with its own draft vocabulary, in one drafter, inside vLLM's V1
runner: the V1 model loads ``markov_head.joint_proj`` beside ``lm_head`` [Vd, H], ``markov_w2`` [Vd, r] and
``d2t``; the stage drafts greedy rows on the compiled op (the state carried along each block, draft ids
mapped to target ids); the output is the target's own; an exact oracle (the whole table, the rnn's output
read from the token) is accepted almost always; every drafted id is a target id inside the vocabulary.

Two engines (the session's target-alone baseline and one DSpark engine)."""

from __future__ import annotations

import pytest

from tests.helpers import VOCAB, traced_family_run

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def rnn_run(qwen_pair, prompts, tmp_path_factory):
    return traced_family_run(qwen_pair, prompts, tmp_path_factory.mktemp("rnn"), "specforge-vocab", head="rnn")


def test_an_rnn_drafter_with_a_draft_vocabulary_is_lossless(rnn_run, qwen_baseline):
    cfg, ids, tokens, _, records = rnn_run
    assert cfg.family == "specforge" and cfg.markov_head_type == "rnn"
    assert cfg.draft_vocab_size == ids.numel() < VOCAB
    assert tokens == qwen_baseline
    paths = {r.get("path") for r in records if "draft" in r}
    assert "compiled" in paths and None not in paths and "reference" not in paths, paths


def test_an_rnn_oracle_is_accepted_almost_always(rnn_run):
    cfg, _, _, s, _ = rnn_run
    drafts = cfg.num_draft_tokens
    assert s["num_draft_tokens"] == drafts * s["num_drafts"] > 0, s
    assert s["mean_acceptance_length"] >= 1 + 0.9 * drafts, s


def test_rnn_drafts_are_target_ids_inside_the_draft_vocabulary(rnn_run):
    _, ids, *_, records = rnn_run
    proposed = {t for r in records for t in r["draft"]}
    assert proposed and proposed <= set(ids.tolist()), sorted(proposed - set(ids.tolist()))[:10]
    assert max(proposed) > ids.numel()  # mapped: draft ids stop at Vd - 1
