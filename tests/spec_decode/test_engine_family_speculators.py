"""A vllm-project/speculators DSpark checkpoint (``speculators_model_type: "dspark"``, the layers in
``transformer_layer_config``, aux ids = layer ids + 1, the 1 + N layout, a draft vocabulary with its own
``lm_head`` [Vd, H], ``markov_w2`` [Vd, r] and ``d2t`` offsets) served through ``LLM.generate`` with
``method: "dspark"`` on the V1 runner: greedy output the target's own, an oracle accepted almost always,
every drafted id a target id inside the draft vocabulary, and sampled requests (q mapped to the target
vocabulary) served too.

Three engines (the session's target-alone baseline, one DSpark engine verifying every draft, and one with
the default settings, whose start-up profile used to crash on this layout)."""

from __future__ import annotations

import pytest

from benchmarks.harness.engine import acceptance_summary, dspark_report, llm_engine, read_trace, spec_metrics
from tests.helpers import MAX_TOKENS, VOCAB, family_draft
from vllm_dspark.config import DSparkConfig

pytestmark = pytest.mark.engine


def _delta(after: dict, before: dict) -> dict:
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    return {k: (after.get(k) or 0) - (before.get(k) or 0) for k in keys}


@pytest.fixture(scope="module")
def speculators_run(qwen_pair, prompts, tmp_path_factory):
    from vllm import SamplingParams

    root = tmp_path_factory.mktemp("speculators")
    draft, ids = family_draft(qwen_pair, root, "speculators")
    trace = root / "trace.jsonl"
    spec = {"method": "dspark", "model": str(draft), "dspark": {"verification": "fixed", "trace": str(trace)}}
    with llm_engine(qwen_pair["target"], speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        greedy = spec_metrics(llm)
        sampled_outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                                    SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True))
        sampled = _delta(spec_metrics(llm), greedy)
    sampled_tokens = [list(o.outputs[0].token_ids) for o in sampled_outs]
    return DSparkConfig.from_json(draft), ids, tokens, acceptance_summary(greedy), sampled, sampled_tokens, \
        read_trace(trace)


def test_a_speculators_checkpoint_with_a_draft_vocabulary_is_lossless(speculators_run, qwen_baseline):
    cfg, ids, tokens, *_ = speculators_run
    assert cfg.family == "speculators" and not cfg.sample_from_anchor  # absent from its config.json: false
    assert cfg.draft_vocab_size == ids.numel() < VOCAB
    assert tokens == qwen_baseline


def test_a_speculators_oracle_is_accepted_almost_always(speculators_run):
    cfg, _, _, s, *_ = speculators_run
    drafts = cfg.num_draft_tokens  # 6: the 1 + N layout of block 7
    assert drafts == 6 and s["num_draft_tokens"] == drafts * s["num_drafts"], s
    # The table is exact (Markov rank = the vocabulary: tests.helpers.family_draft). With rank 64 the random
    # rows' crosstalk mapped a few tokens wrongly and the cycling greedy answers met them again and again:
    # 1 + 0.85 x drafts at best.
    assert s["mean_acceptance_length"] >= 1 + 0.9 * drafts, s


def test_drafts_are_target_ids_inside_the_draft_vocabulary(speculators_run):
    _, ids, *_, records = speculators_run
    proposed = {t for r in records for t in r["draft"]}
    assert proposed and proposed <= set(ids.tolist()), sorted(proposed - set(ids.tolist()))[:10]
    # Draft ids are 0..Vd-1; unmapped they would mostly fall below the vocabulary's top ids.
    assert max(proposed) > ids.numel()


def test_sampled_requests_draft_through_the_draft_vocabulary(speculators_run):
    *_, sampled, sampled_tokens, _ = speculators_run
    assert all(len(t) == MAX_TOKENS and all(0 <= i < VOCAB for i in t) for t in sampled_tokens)
    assert sampled["num_drafts"] > 0 and sampled["num_accepted_tokens"] > 0, sampled


@pytest.fixture(scope="module")
def speculators_default_run(qwen_pair, prompts, tmp_path_factory):
    """The same layout with the default settings: the budget, whose start-up profile times the drafter on
    dummy rows before any request (the 1 + N layout with a d2t vocabulary crashed there)."""
    from vllm import SamplingParams

    draft, _ = family_draft(qwen_pair, tmp_path_factory.mktemp("speculators_default"), "speculators")
    with llm_engine(qwen_pair["target"], speculative_config={"method": "dspark", "model": str(draft)}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        report = dspark_report(llm)
    return [list(o.outputs[0].token_ids) for o in outs], report


def test_a_one_plus_n_d2t_checkpoint_starts_with_the_default_settings_and_is_lossless(speculators_default_run,
                                                                                       qwen_baseline):
    tokens, report = speculators_default_run
    assert report["settings"]["verification"] == "budget"
    assert report["profile"]["decision"] == "profiled" and report["costs"]["source"].startswith("start-up profile")
    assert tokens == qwen_baseline
