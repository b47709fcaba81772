"""A gated Markov head inside vLLM's V1 runner: the V1 model loads ``markov_head.gate_proj``, the stage
drafts its greedy rows on the compiled op with the head's arguments ("compiled" in the trace; a fallback
would say "reference-gated"), and the output is still the target's own.

Two engines (the session's target-alone baseline and one DSpark engine)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import MAX_TOKENS
from vllm_dspark.tools.bench.engine import acceptance_summary, llm_engine, spec_metrics
from vllm_dspark.tools.tiny_pair import make_drafter

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def gated_run(qwen_pair, prompts, tmp_path_factory):
    from vllm import SamplingParams

    root = tmp_path_factory.mktemp("gated")
    # The session pair's target with a gated drafter: the bigram it knows, 80% right (real rejections).
    bigram = qwen_pair["bigram"].clone()
    g = torch.Generator().manual_seed(12)
    flip = torch.rand(bigram.numel(), generator=g) < 0.2
    bigram[flip] = torch.randint(0, 256, (int(flip.sum()),), generator=g)
    cfg = qwen_pair["config"].replace(markov_head_type="gated")
    draft = make_drafter(root / "draft", cfg, mode="oracle", bigram=bigram, seed=5, backbone_scale=0.05)
    trace = root / "trace.jsonl"
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 7,
            "dspark": {"verification": "fixed", "trace": str(trace)}}
    with llm_engine(qwen_pair["target"], speculative_config=spec) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        metrics = spec_metrics(llm)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    return tokens, metrics, records


def test_a_gated_drafter_is_lossless_and_drafts_through_its_head(gated_run, qwen_baseline):
    tokens, metrics, records = gated_run
    assert tokens == qwen_baseline
    s = acceptance_summary(metrics)
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] > 0, s
    paths = {r.get("path") for r in records if "draft" in r}
    # The Markov stage's greedy rows reach the op with the gated head's arguments (tests/ops and
    # tests/spec_decode/test_markov_heads.py check that it drafts the head, not a vanilla one).
    assert "compiled" in paths and None not in paths and "reference" not in paths, paths
