"""A serve-time draft vocabulary (``draft_vocab``) inside vLLM's V1 runner: the full-vocabulary tiny
drafter drafts over half of its vocabulary only, and the output is still the target's own.

Two engines (the session's target-alone baseline and one DSpark engine)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from benchmarks.harness.engine import acceptance_summary, dspark_report, llm_engine, spec_metrics
from tests.helpers import MAX_TOKENS, VOCAB
from tests.tiny_pair import TOKEN_IDS
from vllm_dspark.checkpoint.token_frequency import draft_vocab_ids, table_from_counts, write_frequency_table

pytestmark = pytest.mark.engine

N = VOCAB // 2


@pytest.fixture(scope="module")
def draft_vocab_run(qwen_pair, prompts, qwen_baseline, tmp_path_factory):
    from vllm import SamplingParams

    root = tmp_path_factory.mktemp("draft_vocab")
    # The table ranks the tokens the target writes (the test's stand-in for a training corpus); the
    # rest of the N ids are filled in id order and the end-of-sequence id replaces the least frequent.
    table = table_from_counts(Counter(t for out in qwen_baseline for t in out), vocab_size=VOCAB, source="test")
    path = write_frequency_table(root / "freq.json", table)
    trace = root / "trace.jsonl"
    spec = {"method": "dspark", "model": qwen_pair["draft"], "num_speculative_tokens": 7,
            "dspark": {"verification": "fixed", "draft_vocab": N, "draft_vocab_table": str(path),
                       "trace": str(trace)}}
    with llm_engine(qwen_pair["target"], speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        metrics, report = spec_metrics(llm), dspark_report(llm)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    ids = draft_vocab_ids(table, N, required=[TOKEN_IDS["eos"]])
    return tokens, metrics, report, records, ids


def test_a_draft_vocabulary_is_lossless_and_drafts_inside_it(draft_vocab_run, qwen_baseline):
    tokens, metrics, report, records, ids = draft_vocab_run
    assert tokens == qwen_baseline
    assert report["settings"]["draft_vocab"] == N
    s = acceptance_summary(metrics)
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] > 0, s
    proposed = [t for r in records if "draft" in r for t in r["draft"]]  # (acceptance records have none)
    assert proposed, "the trace holds no drafts"
    outside = sorted(set(proposed) - set(ids))
    assert not outside, f"drafts outside the draft vocabulary: {outside[:10]}"
    # The drafter's tokens are the 256 byte tokens (its Markov table; the 20% it gets wrong are random
    # ones): the draft vocabulary leaves some of them out, so the check above can fail.
    assert len(ids) == N and TOKEN_IDS["eos"] in ids and set(range(256)) - set(ids)
