"""Confidence-gated early stop and num_speculative_tokens below the block, on a Llama target.

One engine: a Llama target with an odd vocabulary (301), a block-5 drafter,
num_speculative_tokens 4 and threshold 0.4 from the environment (the DSpark
reference rule). The trace the proposer writes gives each step's confidences;
the kept draft must be the drafts before the first position whose confidence
is below 0.4, capped at 4, and the target must verify exactly those tokens.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.engine import (
    acceptance_summary,
    llm_engine,
    read_trace,
    spec_metrics,
    verified_draft_tokens,
)
from tests.helpers import MAX_TOKENS, make_prompts, tiny_pair
from tests.reference_check import ReferenceDrafter, check_trace_against_reference
from tests.tiny_pair import expected_length

pytestmark = pytest.mark.engine
VOCAB = 301
THRESHOLD = 0.4
N = 4


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    pair = tiny_pair(tmp_path_factory.mktemp("llama_pair"), vocab=VOCAB, seed=7,
                     target={"arch": "llama", "num_layers": 3, "hidden_size": 128, "num_heads": 2, "num_kv_heads": 2},
                     drafter={"block_size": 5, "markov_rank": 64, "target_layer_ids": (0, 2), "num_layers": 2},
                     backbone_scale=0.05, draft_seed=9)
    return {"target": pair.target, "draft": pair.draft}


@pytest.fixture(scope="module")
def runs(llama_pair, tmp_path_factory):
    from vllm import SamplingParams

    prompts = make_prompts(seed=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    with llm_engine(llama_pair["target"]) as llm:
        baseline = [list(o.outputs[0].token_ids) for o in llm.generate(reqs, params)]
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    spec = {"method": "dspark", "model": llama_pair["draft"], "num_speculative_tokens": N}
    # The threshold rule on the drafter's confidences alone (the copy, on by default, has its own tests).
    with llm_engine(llama_pair["target"], speculative_config=spec,
                    env={"VLLM_DSPARK_TRACE": str(trace), "VLLM_DSPARK_CONFIDENCE_THRESHOLD": str(THRESHOLD),
                         "VLLM_DSPARK_COPY": "off"}) as llm:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(reqs, params)]
        metrics = spec_metrics(llm)
    return prompts, baseline, got, metrics, read_trace(trace)


def test_lossless_with_early_stop_and_short_drafts(runs):
    _, baseline, got, _, _ = runs
    for i, (a, b) in enumerate(zip(got, baseline)):
        assert torch.equal(torch.tensor(a), torch.tensor(b)), f"request {i} differs"


def test_kept_length_follows_the_confidences(runs):
    _, _, _, _, trace = runs
    assert trace and {r["path"] for r in trace} == {"compiled"}
    kept = []
    for r in trace:
        assert len(r["draft"]) == 5  # the drafter runs its full trained block
        assert r["kept"] == min(N, expected_length(r["confidence"], THRESHOLD)), r
        kept.append(r["kept"])
    # The gate must have really acted both ways in this run.
    assert any(k < N for k in kept) and any(k == N for k in kept)


def test_target_verifies_only_the_kept_drafts(runs):
    _, _, _, metrics, trace = runs
    s = acceptance_summary(metrics)
    assert s["num_draft_tokens"] == verified_draft_tokens(trace)
    # Early stop really cut target work: fewer tokens verified than N per proposal made (a
    # proposal cut to 0 is a plain decode step and does not count in vLLM's num_drafts).
    proposals = len(trace) - len({r["req_id"] for r in trace})  # each request's last is never verified
    assert s["num_draft_tokens"] < N * proposals
    assert len(s["per_position_acceptance"]) >= N


def test_confidences_match_the_reference(runs, llama_pair):
    prompts, _, got, _, trace = runs
    sequences = [p + t for p, t in zip(prompts, got)]
    ref = ReferenceDrafter(llama_pair["target"], llama_pair["draft"])
    checked = check_trace_against_reference(trace, sequences, ref, samples=25, threshold=THRESHOLD, cap=N)
    assert checked >= 8
