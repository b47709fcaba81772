"""Steps without drafts hold their context and store it when the drafter next runs (``context_kv``).

A drafter whose drafts depend on its context (random backbone, no Markov
head) runs twice on the same prompts, greedy:

* ``fixed`` verification: it drafts every step, so every step stores its
  context at once;
* the budget, pinned to costs under which drafting would pay, with a drafter
  that is never accepted: most steps draft nothing and only hold their context
  (the verify step after a probe, its accepted rows); probes (a few drafts, ever
  rarer) read it after up to ``max_steps`` held steps.

Both outputs equal the target's, and every probe's drafts equal the drafts the
``fixed`` engine made at the same request and position: the held context is
the one an eager store would have written. (Both engines run float32; the
stores batch different numbers of tokens, so a near-tie could in principle
round the other way; none does on these prompts.)
"""

from __future__ import annotations

import pytest

from benchmarks.harness.engine import dspark_report, llm_engine, read_trace
from tests.helpers import MAX_TOKENS

pytestmark = pytest.mark.engine

PAYS = {"verify": [[1, 0.01], [512, 0.0101]], "draft": [[1, 0.0001], [64, 0.0001]]}


@pytest.fixture(scope="module")
def context_drafter(qwen_pair, tmp_path_factory):
    from tests.tiny_pair import make_drafter

    cfg = qwen_pair["config"].replace(markov_rank=0, confidence_head_with_markov=False)
    return str(make_drafter(tmp_path_factory.mktemp("ctx_draft") / "draft", cfg, mode="random", scale=0.3,
                            seed=7))


def _run(target, draft, prompts, dspark, trace):
    from vllm import SamplingParams

    spec = {"method": "dspark", "model": draft, "num_speculative_tokens": 7,
            "dspark": {"copy": "off", **dspark, "trace": str(trace)}}  # the drafter's held context alone
    with llm_engine(target, speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS * 2, temperature=0.0, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs], read_trace(trace), dspark_report(llm)


@pytest.fixture(scope="module")
def runs(qwen_pair, context_drafter, prompts, tmp_path_factory):
    root = tmp_path_factory.mktemp("held")
    few = prompts[:4]
    fixed = _run(qwen_pair["target"], context_drafter, few, {"verification": "fixed"}, root / "fixed.jsonl")
    budget = _run(qwen_pair["target"], context_drafter, few, {"verification": "budget", "costs": PAYS},
                  root / "budget.jsonl")
    return fixed, budget


def test_outputs_stay_the_targets(runs, qwen_baseline):
    (fixed_tokens, _, _), (budget_tokens, _, _) = runs
    want = [t[:MAX_TOKENS] for t in fixed_tokens]
    assert want == qwen_baseline[:4]
    assert fixed_tokens == budget_tokens


def test_probes_read_the_context_an_eager_store_writes(runs):
    (_, fixed_trace, _), (_, budget_trace, report) = runs
    held = report["held_context"]
    assert held["enabled"] and held["held_steps"] > 0 and held["flushes"] > 0, held
    assert 0 < held["flushed_tokens"] <= held["held_tokens"], held
    # Most held steps were planned before the runner's draft glue (patch v1-runner-no-draft-glue).
    assert held["before_glue_steps"] > held["held_steps"] // 2, held
    # The verify steps after the probes sent nothing and held their accepted rows, which later probes read.
    assert held["verify_steps_held"] > 0, held
    eager = {(_prompt_of(fixed_trace, r), r["pos"]): r["draft"] for r in fixed_trace}
    probes = [r for r in budget_trace if r["kept"] > 0]
    assert len(probes) >= 3, "the budget never probed: nothing read a held context"
    compared = 0
    for r in probes:
        want = eager.get((_prompt_of(budget_trace, r), r["pos"]))
        if want is None:
            continue
        assert r["draft"][:r["kept"]] == want[:r["kept"]], (r, want)
        compared += 1
    assert compared >= 3


def _prompt_of(trace: list[dict], rec: dict) -> int:
    """The prompt a trace record belongs to: request ids differ between engines, their order does not
    (the first step drafts every prompt, in order)."""
    order = list(dict.fromkeys(r["req_id"] for r in trace))
    return order.index(rec["req_id"])


NEVER_PAYS = {"verify": [[1, 0.01], [512, 5.12]], "draft": [[1, 1.0], [64, 1.0]]}


def test_held_context_of_finished_requests_never_lands_in_reused_blocks(qwen_pair, prompts, qwen_baseline):
    """A draft window gives the drafter a KV group of its own, whose layers vLLM lays over the same
    memory as target layers. Requests that finished with context still held free their blocks; the
    next requests take them and write their TARGET cache there before the drafter runs. Storing the
    finished requests' held context then would overwrite it (seen on the default pair: the bf16
    step-cost check's verify logits went from 0.69 to 3.0 off the floor). Every step here holds its
    context (drafting never pays); the held tokens of the first batch must be dropped, and the second
    batch must decode exactly as the target alone. (On this tiny pair the old behaviour happened not
    to change the outputs; the dropped count is what catches it.)"""
    from vllm import SamplingParams

    from tests.helpers import make_prompts

    spec = {"method": "dspark", "model": qwen_pair["draft"], "num_speculative_tokens": 7,
            "dspark": {"verification": "budget", "costs": NEVER_PAYS, "window": 128, "copy": "off"}}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with llm_engine(qwen_pair["target"], speculative_config=spec, enable_prefix_caching=False) as llm:
        llm.generate([{"prompt_token_ids": p} for p in make_prompts(seed=1)], params)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        report = dspark_report(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == qwen_baseline
    held = report["held_context"]
    assert held["enabled"] and held["dropped_tokens"] > 0, held  # the first batch left context held
    assert held["before_glue_steps"] > 0, held  # and held it without the runner's draft glue


COPIES_PAY = {"verify": [[1, 0.01], [512, 0.0101]], "draft": [[1, 1.0], [64, 1.0]], "sources": {"copy": [[1, 0.0]]}}


def test_copy_steps_are_planned_and_sent_before_the_glue(qwen_pair, prompts, qwen_baseline):
    """With the copy on (the default), a decode-only step without drafts is planned before the runner's
    draft glue from the tokens the requests just sampled (patch v1-runner-no-draft-glue): it holds its
    context and sends what the copy offers, or nothing. Verification is free and the drafter's forward
    never pays here, so every draft is a copy; the output must be the target's, and some copies must
    have been sent from that path (else the test proves nothing about it)."""
    from vllm import SamplingParams

    spec = {"method": "dspark", "model": qwen_pair["draft"], "num_speculative_tokens": 7,
            "dspark": {"verification": "budget", "costs": COPIES_PAY}}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with llm_engine(qwen_pair["target"], speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        report = dspark_report(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == qwen_baseline
    held = report["held_context"]
    assert held["copy_steps_before_glue"] > 0 and held["before_glue_steps"] > held["copy_steps_before_glue"], held
    by_source = report["stats"]["by_source"]
    assert by_source.get("copy", {}).get("accepted", 0) > 0, by_source  # copies were verified and accepted
