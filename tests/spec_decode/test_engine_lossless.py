"""DSpark inside vLLM's V1 runner (CPU): lossless greedy decoding, acceptance, the op, the reference;
and sampled drafts (the default at temperature > 0): drafts drawn from the Markov-corrected,
top-k/top-p-filtered distribution at each request's temperature, their probabilities handed to the
rejection sampler, while greedy requests in the same batch still draft greedily through the op.

One engine for the module: method "dspark", the drafter's full block of 7, verified in full
(``verification: fixed``; the budget has its own module). The sampled tests come last: one of them
starts the trace anew, and the greedy run's fixture has read it by then.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.engine import (
    acceptance_summary,
    dspark_report,
    llm_engine,
    read_trace,
    spec_metrics,
    verified_draft_tokens,
)
from tests.helpers import MAX_TOKENS
from tests.reference_check import ReferenceDrafter, check_trace_against_reference

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def engine(qwen_pair, qwen_baseline, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    spec = {"method": "dspark", "model": qwen_pair["draft"], "num_speculative_tokens": 7,
            "dspark": {"verification": "fixed"}}
    with llm_engine(qwen_pair["target"], speculative_config=spec,
                    env={"VLLM_DSPARK_TRACE": str(trace)}) as llm:
        yield llm, trace


@pytest.fixture(scope="module")
def greedy_run(engine, prompts):
    from vllm import SamplingParams

    llm, trace = engine
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs], spec_metrics(llm), read_trace(trace)


def test_greedy_is_token_identical_to_no_speculation(greedy_run, qwen_baseline, prompts):
    tokens, _, _ = greedy_run
    assert len(tokens) == len(prompts) == 16
    for i, (got, want) in enumerate(zip(tokens, qwen_baseline)):
        assert torch.equal(torch.tensor(got), torch.tensor(want)), f"request {i} differs"


def test_drafts_are_accepted_and_counted(greedy_run):
    _, metrics, trace = greedy_run
    s = acceptance_summary(metrics)
    # The drafter knows 80% of the target's bigram table: long accepted runs, real rejections.
    assert 2.5 < s["mean_acceptance_length"] < 8.0, s
    assert len(s["per_position_acceptance"]) == 7
    # Fixed verification of the full block: every draft step verifies 7 tokens per request.
    assert s["num_draft_tokens"] == 7 * s["num_drafts"]
    assert all(r["kept"] == 7 for r in trace)
    # Each request's last proposal comes after its final token and is never verified.
    assert verified_draft_tokens(trace) == s["num_draft_tokens"]


def test_greedy_verify_took_the_cpu_shortcut_with_the_compiled_argmax(engine, greedy_run):
    report = dspark_report(engine[0])
    # The greedy run's verify steps went through the rejection-sampler patch's CPU shortcut (its
    # output is the token-identical one checked above), with the compiled row_argmax.
    # A verify step emits at most 1 + 7 tokens per request, so the 32-token run took at least
    # MAX_TOKENS // 8 of them after its prefill (9 in this tree: the 10 this asserted before was a count).
    assert report["greedy_verify_sampler_steps"] >= MAX_TOKENS // 8, report["greedy_verify_sampler_steps"]
    # Greedy requests with no logits processor at work: their bonus tokens took the same op.
    assert report["argmax_bonus_sampler_steps"] >= report["greedy_verify_sampler_steps"], report
    assert report["greedy_verify_argmax"] == "compiled"


def test_steps_are_timed_from_execute_model(engine, greedy_run):
    report = dspark_report(engine[0])
    assert report["step_clock"]["from"] == "execute_model"
    assert report["step_clock"]["marks"] >= report["stats"]["steps"] > 0


def test_the_compiled_markov_op_ran(greedy_run):
    _, _, trace = greedy_run
    assert trace, "the proposer wrote no trace records"
    assert {r["path"] for r in trace} == {"compiled"}


def test_drafts_match_the_reference_drafter(greedy_run, qwen_pair, prompts):
    tokens, _, trace = greedy_run
    sequences = [p + t for p, t in zip(prompts, tokens)]
    ref = ReferenceDrafter(qwen_pair["target"], qwen_pair["draft"])
    checked = check_trace_against_reference(trace, sequences, ref, samples=40)
    assert checked >= 10


def test_seeded_sampling_completes_and_reproduces(engine, prompts):
    from vllm import SamplingParams

    llm, _ = engine
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    first = [list(o.outputs[0].token_ids) for o in llm.generate(reqs, params)]
    second = [list(o.outputs[0].token_ids) for o in llm.generate(reqs, params)]
    assert all(len(t) == 24 for t in first)
    assert first == second


def test_rejected_context_rows_were_left_out_of_the_layout(engine, greedy_run):
    # The greedy run verified 7 drafts a step and rejected some (acceptance < 8): those steps' rejected
    # rows skipped fc and the context K/V (accepted_context), and the drafts still match the reference
    # drafter and the output the target alone (the tests above).
    report = dspark_report(engine[0])
    assert report["layout"]["rejected_rows_dropped"] > 0, report["layout"]


# ---------------------------------------------------------------- sampled drafts
def test_greedy_requests_stay_token_identical(engine, prompts, qwen_baseline):
    from vllm import SamplingParams

    llm, _ = engine
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    for i, (o, want) in enumerate(zip(outs, qwen_baseline)):
        assert torch.equal(torch.tensor(list(o.outputs[0].token_ids)), torch.tensor(want)), f"request {i}"


def test_sampled_drafts_reproduce_and_are_accepted(engine, prompts):
    from vllm import SamplingParams

    llm, trace = engine
    reqs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=7 + i, ignore_eos=True) for i in range(len(reqs))]
    before = spec_metrics(llm)
    first = [list(o.outputs[0].token_ids) for o in llm.generate(reqs, params)]
    after = spec_metrics(llm)
    # Seeded requests alone give the same tokens as in the batch: the draft noise is per request.
    alone = [list(llm.generate([reqs[i]], params[i])[0].outputs[0].token_ids) for i in (0, 5)]
    assert all(len(t) == 24 for t in first)
    assert alone == [first[0], first[5]]
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert drafts > 0 and 1 + accepted / drafts > 2.0  # the bigram target is peaked: most drafts pass
    recs = read_trace(trace)
    assert {r["path"] for r in recs if r["sampled"]} == {"sampled"} and any(r["sampled"] for r in recs)
    assert acceptance_summary(after)["num_drafts"] == after["num_drafts"]


def test_greedy_and_sampled_requests_in_one_batch(engine, prompts, qwen_baseline):
    from vllm import SamplingParams

    llm, trace = engine
    reqs = [{"prompt_token_ids": p} for p in prompts[:6]]
    params = [SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 1.0, seed=None if i % 2 else 40 + i,
                             ignore_eos=True) for i in range(6)]
    trace.unlink(missing_ok=True)
    outs = llm.generate(reqs, params)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    for i in range(1, 6, 2):  # the greedy rows are the target's own greedy tokens, sampled rows beside them
        got = torch.tensor(list(outs[i].outputs[0].token_ids))
        assert torch.equal(got, torch.tensor(qwen_baseline[i][:16])), f"greedy request {i}"
    recs = read_trace(trace)
    assert {r["path"] for r in recs if not r["sampled"]} == {"compiled"}  # greedy rows: the op
    assert any(r["sampled"] for r in recs)


def test_top_k_and_top_p_requests_complete_and_reproduce(engine, prompts):
    from vllm import SamplingParams

    llm, _ = engine
    reqs = [{"prompt_token_ids": p} for p in prompts[:4]]
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_k=5, top_p=0.9, seed=90 + i, ignore_eos=True)
              for i in range(4)]
    first = [list(o.outputs[0].token_ids) for o in llm.generate(reqs, params)]
    second = [list(o.outputs[0].token_ids) for o in llm.generate(reqs, params)]
    assert first == second and all(len(t) == 16 for t in first)
