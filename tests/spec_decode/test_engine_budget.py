"""Budgeted verification inside vLLM's V1 runner (CPU), on the tiny Qwen3 pair.

Two engines:

* costs pinned so that no draft slot ever pays (every verified token costs as
  much as a decode step and the drafter costs a second): every step must be a
  plain decode step: nothing verified, the drafter's block forward skipped,
  outputs unchanged;
* the default: costs profiled at start-up (the worker hook), drafts admitted.
"""

from __future__ import annotations

import pytest

from tests.helpers import MAX_TOKENS
from vllm_dspark.testing.engine import acceptance_summary, dspark_report, llm_engine, spec_metrics

pytestmark = pytest.mark.engine

NEVER_PAYS = {"verify": [[1, 0.01], [512, 5.12]], "draft": [[1, 1.0], [64, 1.0]]}


def _run(pair, prompts, dspark, env=None):
    from vllm import SamplingParams

    spec = {"method": "dspark", "model": pair["draft"], "num_speculative_tokens": 7, "dspark": dspark}
    with llm_engine(pair["target"], speculative_config=spec, env=env or {}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs], spec_metrics(llm), dspark_report(llm)


@pytest.fixture(scope="module")
def never_pays(qwen_pair, prompts):
    return _run(qwen_pair, prompts, {"verification": "budget", "costs": NEVER_PAYS})


@pytest.fixture(scope="module")
def profiled(qwen_pair, prompts, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return _run(qwen_pair, prompts, {}, env={"VLLM_DSPARK_CACHE": str(cache)}), cache


def test_zero_admitted_drafts_make_plain_decode_steps(never_pays, qwen_baseline):
    tokens, metrics, report = never_pays
    assert tokens == qwen_baseline
    s = acceptance_summary(metrics)
    assert s["num_drafts"] == 0 and s["num_draft_tokens"] == 0  # the target verified nothing
    st = report["stats"]
    assert st["tokens_admitted"] == 0
    # After the first step's forecast the drafter's block forward does not run (a probe every 32
    # skipped steps refreshes the forecast).
    assert st["steps_skipped"] >= 0.8 * st["steps"], st
    assert report["timings_s"]["block_forward"] > 0 and report["timings_s"]["context_kv_only"] > 0
    assert report["costs"]["source"] == "speculative_config['dspark']['costs']"


def test_default_budget_profiles_costs_and_stays_lossless(profiled, qwen_baseline):
    (tokens, metrics, report), cache = profiled
    assert tokens == qwen_baseline
    assert report["settings"]["verification"] == "budget"
    assert report["costs"]["source"].startswith("start-up profile")
    assert len(report["costs"]["verify"]) >= 3 and len(report["costs"]["draft"]) >= 2
    assert list(cache.glob("budget/*.json"))  # cached for the next start
    s = acceptance_summary(metrics)
    st = report["stats"]
    # On this machine verifying 8 tokens costs little more than 1: the budget admits most drafts.
    assert st["tokens_admitted"] > 0.5 * st["tokens_drafted"], st
    # vLLM's count of verified draft tokens equals the proposer's own feedback count.
    assert s["num_draft_tokens"] == st["tokens_verified_observed"], (s, st)
    assert s["mean_acceptance_length"] > 2.0, s
    cal = report["calibration"]
    assert sum(cal["count"]) > 0 and 0.0 <= cal["ece"] <= 1.0
