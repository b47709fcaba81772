"""Serving past the drafter's trained context (issue 11), on a tiny pair in vLLM's CPU runner.

The drafter is trained (``max_position_embeddings``) for 128 positions; the
target serves 1,024. Prompts of ~40 tokens stay inside the trained context,
prompts of ~700 tokens run 5x past it. One in-process engine per
configuration, so the scheduler's KV-cache manager can be inspected:

* no speculation (the reference outputs);
* DSpark with the default window (= the trained context, 128 tokens);
* DSpark with the window off.

Checked: greedy outputs identical to no speculation; acceptance at long
context within 20% of short context; the drafter's KV blocks bounded by the
window (and growing with the context when the window is off), equal to what
``vllm-dspark plan`` computes with vLLM's own spec; the recorded drafts at
long positions equal the plain-PyTorch reference drafter with the same window.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.engine import (
    acceptance_summary,
    draft_kv_blocks,
    dspark_report,
    llm_engine,
    read_trace,
    spec_metrics,
)
from tests.helpers import tiny_pair
from tests.reference_check import ReferenceDrafter, match_sequence
from vllm_dspark.serving.settings import DSparkSettings

pytestmark = pytest.mark.engine
VOCAB = 384
TRAINED = 128
SERVED = 1024
BLOCK = 5
MAX_TOKENS = 24
ENGINE = dict(max_model_len=SERVED, max_num_seqs=8, max_num_batched_tokens=256, enable_prefix_caching=False)
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the scheduler and the proposer live in this process


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # A live backbone (not silenced): its attention over the context shapes the confidences,
    # so wrong rotary angles or a wrong window would show in the reference check.
    pair = tiny_pair(tmp_path_factory.mktemp("long_pair"), seed=21,
                     target={"num_layers": 4, "max_position_embeddings": 4096},
                     drafter={"block_size": BLOCK, "markov_rank": 64, "target_layer_ids": (0, 1, 2), "num_layers": 2},
                     config_changes={"max_position_embeddings": TRAINED},
                     known=0.85, known_seed=5, backbone_scale=0.3, draft_seed=9)
    return {"target": pair.target, "draft": pair.draft}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length + 3 * i,), generator=g).tolist() for i in range(n)]


SHORT = prompts(4, 40, 1)
LONG = prompts(4, 700, 2)


def _generate(llm, batch):
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _acceptance(llm, batch):
    before = spec_metrics(llm)
    out = _generate(llm, batch)
    after = spec_metrics(llm)
    delta = {k: ([a - b for a, b in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list)
                 else v - before.get(k, 0)) for k, v in after.items()}
    return out, acceptance_summary(delta)


def _blocks_during(llm, prompt):
    """Draft-layer KV blocks one request holds after each step (decode phase), and the target's."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    eng.add_request("probe", {"prompt_token_ids": prompt},
                    SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    draft, target, info = [], [], {}
    while eng.has_unfinished_requests():
        eng.step()
        info = draft_kv_blocks(llm)
        rid = next((r for r in info["draft"] if r.startswith("probe")), None)  # vLLM may suffix the id
        if rid is not None and info["decoding"].get(rid):  # decode steps (the prompt is in the cache)
            draft.append(info["draft"][rid])
            target.append(info["target"][rid])
    return draft, target, info.get("block_size"), info.get("draft_group_spec")


@pytest.fixture(scope="module")
def baseline(pair):
    with llm_engine(pair["target"], env=ENV, **ENGINE) as llm:
        return {"short": _generate(llm, SHORT), "long": _generate(llm, LONG)}


@pytest.fixture(scope="module")
def windowed(pair, baseline, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    spec = {"method": "dspark", "model": pair["draft"], "num_speculative_tokens": BLOCK,
            "dspark": {"verification": "fixed", "trace": str(trace)}}
    with llm_engine(pair["target"], speculative_config=spec, env=ENV, **ENGINE) as llm:
        short, acc_short = _acceptance(llm, SHORT)
        long, acc_long = _acceptance(llm, LONG)
        blocks = {n: _blocks_during(llm, prompts(1, n, 7)[0]) for n in (200, 500, 900)}
        settings = DSparkSettings.from_dict(dspark_report(llm)["settings"])
    return {"short": short, "long": long, "acc_short": acc_short, "acc_long": acc_long, "blocks": blocks,
            "trace": read_trace(trace), "settings": settings}


@pytest.fixture(scope="module")
def unwindowed(pair):
    spec = {"method": "dspark", "model": pair["draft"], "num_speculative_tokens": BLOCK,
            "dspark": {"verification": "fixed", "window": "off"}}
    with llm_engine(pair["target"], speculative_config=spec, env=ENV, **ENGINE) as llm:
        return {n: _blocks_during(llm, prompts(1, n, 7)[0]) for n in (200, 900)}


def test_window_defaults_to_the_trained_context(windowed):
    s = windowed["settings"]
    assert (s.window, s.trained_context, s.served_context) == (TRAINED, TRAINED, SERVED)
    assert s.source("window").startswith("default")
    assert "most recent 128" in s.context_note()


def test_greedy_is_identical_to_no_speculation_past_the_trained_context(windowed, baseline):
    assert windowed["short"] == baseline["short"]
    assert windowed["long"] == baseline["long"]


def test_acceptance_holds_past_the_trained_context(windowed):
    short, long = windowed["acc_short"], windowed["acc_long"]
    assert short["num_drafts"] > 0 and long["num_drafts"] > 0  # drafting did not stop past 128
    assert short["mean_acceptance_length"] > 2.0, short
    assert long["mean_acceptance_length"] >= 0.8 * short["mean_acceptance_length"], (short, long)


def test_draft_kv_blocks_stay_bounded_by_the_window(windowed, unwindowed):
    from vllm_dspark.tools.deploy.plan import draft_kv_blocks_per_sequence

    _, _, bs, kind = windowed["blocks"][900]
    assert kind == "SlidingWindowSpec"  # vLLM's KV-cache manager, not a mask, bounds the draft cache
    # The plan's two figures: decode (1 + drafts in flight) and the prefill peak (a whole
    # scheduler step in flight, which the first decode steps after a chunked prefill still hold).
    bound = draft_kv_blocks_per_sequence(block_size=bs, window=TRAINED, decode_tokens=BLOCK + 1, context=SERVED)
    peak = draft_kv_blocks_per_sequence(block_size=bs, window=TRAINED,
                                        decode_tokens=ENGINE["max_num_batched_tokens"], context=SERVED)
    peaks = {n: max(d) for n, (d, _, _, _) in windowed["blocks"].items()}
    # The same at 200, 500 and 900 tokens of context, up to the one block a window that does not
    # start on a block boundary straddles.
    assert max(peaks.values()) - min(peaks.values()) <= 1, peaks
    assert bound <= max(peaks.values()) <= peak, (peaks, bound, peak)  # what the plan reports
    _, t900, _, _ = windowed["blocks"][900]
    assert t900[-1] >= 900 // bs  # the target's own cache grows with the context
    no_window = {n: max(d) for n, (d, _, _, _) in unwindowed.items()}
    assert no_window[900] > 3 * no_window[200] / 2 and no_window[900] > 2 * bound


def test_long_context_drafts_match_the_reference_with_the_window(windowed, pair):
    seqs = [p + t for p, t in zip(LONG, windowed["long"])]
    first = len(SHORT)  # LLM.generate numbers requests across calls
    ref = ReferenceDrafter(pair["target"], pair["draft"])
    checked = 0
    for rec in windowed["trace"]:
        if not str(rec["req_id"]).split("-")[0].isdigit():
            continue  # the KV probes' requests
        n = int(str(rec["req_id"]).split("-")[0]) - first
        if not 0 <= n < len(LONG) or rec["pos"] < len(LONG[n]):
            continue  # a short prompt, or a chunked-prefill step (vLLM discards its draft)
        idx = match_sequence(rec, seqs, first_request=first)
        if idx is None or rec["pos"] < 3 * TRAINED:
            continue
        aux = ref.aux(seqs[idx])[: rec["pos"]].unsqueeze(0)
        emb = ref.target.get_input_embeddings().weight
        head = ref.target.get_output_embeddings().weight
        out = ref.draft.draft(aux, torch.tensor([rec["pos"]]), torch.tensor([seqs[idx][rec["pos"]]]), emb, head,
                              window=TRAINED)
        assert rec["draft"] == out.tokens[0].tolist(), rec
        assert torch.allclose(torch.tensor(rec["confidence"]), out.confidence[0], atol=2e-3), rec
        checked += 1
        if checked >= 6:
            break
    assert checked >= 4
