"""The copy source inside the V1 proposer (``copy: auto``), on the tiny Qwen3 pair.

The target is (almost) a bigram model, so its greedy answers fall into short cycles within a few
tokens (cycle lengths 2-25 on these prompts): text the copy source can draft from the answer
itself. The drafter is confidently wrong (its Markov table off by one everywhere, its head saying
0.9): every DSpark draft is rejected, so whatever is accepted came from the copy.

One engine, costs pinned (a verified token costs a twentieth of a decode step), greedy requests
then sampled ones (T = 1, some seeded):

* greedy output identical to the target alone, the DSpark drafts never accepted, the copies
  accepted on many steps, and steps on which only the copy drafted (no block forward);
* the trace names the source of every draft, and the report splits acceptance by source;
* sampled requests draft by copying too (a one-hot q: the rejection sampler's ratio test is
  exact), answers of full length, tokens inside the vocabulary; with ``copy_shared`` on, they copy
  from the greedy pass's answers to the same prompts (the cross-request index).
"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.harness.engine import (
    acceptance_summary,
    dspark_report,
    llm_engine,
    source_metrics,
    spec_metrics,
)
from tests.helpers import MAX_TOKENS, VOCAB

pytestmark = pytest.mark.engine

CHEAP_VERIFY = {"verify": [[1, 0.01], [512, 0.01 + 511 * 0.0005]], "draft": [[1, 0.004], [64, 0.004]]}


@pytest.fixture(scope="module")
def copy_run(qwen_pair, prompts, tmp_path_factory):
    from safetensors.torch import load_file, save_file
    from vllm import SamplingParams

    from tests.tiny_pair import make_drafter

    root = tmp_path_factory.mktemp("copy")
    draft = make_drafter(root / "draft", qwen_pair["config"], mode="oracle", bigram=(qwen_pair["bigram"] + 1) % VOCAB,
                         backbone_scale=0.0, seed=5)
    path = draft / "model.safetensors"
    state = load_file(str(path))
    state["confidence_head.proj.weight"].zero_()
    state["confidence_head.proj.bias"].fill_(float(torch.logit(torch.tensor(0.9))))
    save_file(state, str(path), metadata={"format": "pt"})
    trace = root / "trace.jsonl"
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 7,
            "dspark": {"verification": "budget", "costs": CHEAP_VERIFY, "copy": "auto", "copy_shared": 4096,
                       "trace": str(trace)}}
    with llm_engine(qwen_pair["target"], speculative_config=spec) as llm:
        earlier = source_metrics(llm)  # the session's earlier engines of this target, in this process's registry
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        greedy = [list(o.outputs[0].token_ids) for o in outs], spec_metrics(llm), dspark_report(llm)
        published = _minus(source_metrics(llm), earlier)  # the report above published this engine's counts
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11 + i if i % 2 else None,
                                 ignore_eos=True) for i in range(8)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params)
        sampled = [list(o.outputs[0].token_ids) for o in outs], dspark_report(llm)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    return greedy, sampled, records, published


def _minus(after: dict, before: dict) -> dict:
    out = {s: {k: v - before.get(s, {}).get(k, 0) for k, v in c.items()} for s, c in after.items()}
    return _nonzero(out)


def _nonzero(per_source: dict) -> dict:
    return {s: dict(c) for s, c in per_source.items() if any(c.values())}


def test_greedy_copies_are_lossless_and_accepted(copy_run, qwen_baseline):
    (tokens, metrics, report), *_ = copy_run
    assert tokens == qwen_baseline
    by = report["stats"]["by_source"]
    assert by.get("dspark", {}).get("accepted", 0) == 0, by  # the wrong drafter: never accepted
    copy = by["copy"]
    # The answers cycle: most copied tokens are right, and they carry a good share of the output.
    assert copy["accepted"] >= 0.6 * copy["verified"] > 0, by
    generated = sum(len(t) for t in tokens)
    assert copy["accepted"] >= 0.25 * generated, (copy, generated)
    s = acceptance_summary(metrics)
    assert s["num_accepted_tokens"] == report["stats"]["tokens_accepted"], (s, report["stats"])
    pol = report["copy"]
    assert pol["steps_sent"] > 0 and pol["calibration"]["count"][0] > 0, pol


def test_steps_with_copies_only_skip_the_drafters_forward(copy_run):
    (_, _, report), _, records, _ = copy_run
    st = report["stats"]
    drafted = [r for r in records if "draft" in r and r["kept"] > 0]
    copied_steps = {r["step"] for r in drafted if r["source"] == "copy"}
    dspark_steps = {r["step"] for r in drafted if r["source"] == "dspark"}
    assert copied_steps and copied_steps - dspark_steps, (len(copied_steps), len(dspark_steps))
    # The drafter was blocked by its rejections, yet the copies went on: its forward ran on far
    # fewer steps than drafts were sent (block_forward time accrues only when it runs).
    assert len(copied_steps - dspark_steps) > len(dspark_steps), (len(copied_steps), len(dspark_steps))
    assert report["timings_s"]["copy_source"] > 0
    # Those steps kept their accepted context rows for the drafter's next store (several rows a request
    # after a verify), instead of storing them at once; greedy identity above says the store was exact.
    held = report["held_context"]
    assert held["copy_steps_held"] > 0 and held["held_tokens"] > held["held_steps"], held
    assert held["flushed_tokens"] > 0, held
    assert st["tokens_accepted"] > 0
    assert all(r["path"] == "copy" for r in drafted if r["source"] == "copy")
    assert all(r["path"] != "copy" for r in drafted if r["source"] == "dspark")
    verdicts = [r for r in records if "accepted" in r and "source" in r]
    assert {r["source"] for r in verdicts} >= {"copy"}


def test_sampled_requests_copy_too(copy_run):
    (_, _, greedy), (tokens, report), records, _ = copy_run
    assert all(len(t) == MAX_TOKENS and all(0 <= x < VOCAB for x in t) for t in tokens)
    before, after = greedy["stats"]["by_source"]["copy"], report["stats"]["by_source"]["copy"]
    assert after["verified"] > before["verified"], (before, after)
    sampled_copies = [r for r in records if r.get("sampled") and r.get("source") == "copy" and "draft" in r
                      and r["kept"] > 0]
    assert sampled_copies, "no sampled request drafted by copying"
    # The sampled requests repeat the greedy ones' prompts: the greedy answers, in the shared text
    # once those requests finished, are copied from (in the greedy pass only the requests that
    # finished late could copy the early ones).
    src_before, src_after = greedy["copy"]["source"], report["copy"]["source"]
    assert src_after["from_shared"] > src_before["from_shared"], (src_before, src_after)
    assert src_after["shared"]["texts"] >= 16, src_after


def test_metrics_carry_the_acceptance_of_each_source(copy_run):
    # The engine core is another process: the counts reach this process's registry through the
    # publishers' directory (serving/metrics.py), as they reach a server's /metrics.
    (_, _, report), _, _, published = copy_run
    by = report["stats"]["by_source"]
    assert published["copy"]["accepted"] > 0, published
    assert published == _nonzero(by), (published, by)
