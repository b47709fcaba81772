"""Reliability of DSpark in vLLM's V1 runner (CPU): cancellations, prefix caching, preemption and
structured output, each checked against the target alone.

Two in-process engines with the same settings, one after the other: the target alone (the
reference), then DSpark (verification ``fixed``, so every draft token is verified and a wrong
context would show in the acceptance). Both run the same four workloads:

* **cancellations**: 8 requests stepped by hand, 4 aborted mid-decode. The survivors must
  decode exactly as without the aborts; afterwards every KV block is free again, the
  scheduler, the model runner, its batch and the proposer hold nothing of the aborted
  requests, and 8 new requests (``max_num_seqs``) run at once.
* **prefix caching** (on, 32-token blocks): 4 prompts sharing a 192-token prefix, each run
  alone, first with the prefix cache emptied before each one ("cold": no hit, as with prefix
  caching off), then again with the cache kept ("warm": the shared prefix comes from the
  cache). A prefix-cache hit skips the target's forward over the cached tokens, so the
  drafter's context K/V for them is never recomputed: they must come from the drafter's own
  cached blocks, written when the prefix was first computed. Checked: warm tokens, drafts
  and acceptance are those of the cold run, and the tokens are the target's.
* **preemption**: the KV cache is 16 blocks (512 tokens); 6 requests of 90-140 prompt tokens
  and 40 new tokens do not fit at once, so the scheduler preempts (recompute) and resumes.
* **structured output**: a JSON schema (``StructuredOutputsParams(json=...)``, xgrammar) on
  text prompts. Valid JSON, and DSpark's tokens are the target's. The engine sets
  ``disable_any_whitespace`` (vLLM 0.32 ignores the per-request flag; with whitespace
  allowed, this tiny random target fills every answer with spaces).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from benchmarks.harness.engine import acceptance_summary, llm_engine, read_trace, spec_metrics
from tests.helpers import tiny_pair

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
VOCAB = 384
BLOCK = 32
NUM_BLOCKS = 16
MAX_SEQS = 8
ENGINE = dict(max_model_len=384, max_num_seqs=MAX_SEQS, enable_prefix_caching=True, block_size=BLOCK,
              max_num_batched_tokens=128, num_gpu_blocks_override=NUM_BLOCKS,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
              worker_extension_cls="vllm_dspark.spec_decode.v1.worker_ext.DSparkWorkerExtension")
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # scheduler, runner and proposer live in this process
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
PREFIX = 192
TEXT_PROMPTS = ["Give me a person as JSON: ", "name age ok = ", "{}", "The record reads"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # A live backbone: its attention over the context K/V shapes drafts and confidences, so a
    # missing or stale context (e.g. after a prefix-cache hit) changes what it drafts.
    return tiny_pair(tmp_path_factory.mktemp("reliability_pair"), seed=3, target={"num_layers": 4},
                     drafter={"block_size": 7, "markov_rank": 64, "target_layer_ids": (0, 1, 2)},
                     known=0.8, known_seed=11, backbone_scale=0.3, draft_seed=5).as_dict()


def _ids(n: int, lo: int, step: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (lo + step * i,), generator=g).tolist() for i in range(n)]


def _prefix_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 256, (PREFIX,), generator=g).tolist()
    return [prefix + torch.randint(0, 256, (10 + 5 * i,), generator=g).tolist() for i in range(4)]


def _counter(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name)


def _delta(after: dict, before: dict) -> dict:
    return {k: ([a - b for a, b in zip(v, before.get(k, [0] * len(v)), strict=True)] if isinstance(v, list)
                else v - before.get(k, 0)) for k, v in after.items()}


def _core(llm):
    return llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore


def _state(llm) -> dict:
    core = _core(llm)
    sched = core.scheduler
    return {"free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
            "scheduler_requests": sorted(sched.requests), "running": len(sched.running),
            "waiting": len(sched.waiting), **llm.collective_rpc("dspark_state")[0]}


def _cancellations(llm) -> dict:
    from vllm import SamplingParams

    eng = llm.llm_engine
    prompts = _ids(MAX_SEQS, 30, 5, seed=1)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    before = _state(llm)
    internal, done = {}, {}
    for i, p in enumerate(prompts):
        internal[f"c{i}"] = eng.add_request(f"c{i}", {"prompt_token_ids": p}, params)
    cancelled = [f"c{i}" for i in (1, 2, 3, 4)]  # admitted first: the KV cache cannot hold all 8
    steps, mid = 0, None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if mid is None:
            # Mid-decode: abort once every request to cancel has its first tokens (prefill done,
            # draft/verify steps under way); how many steps that takes depends on the drafts.
            n = {rid: len(_core(llm).scheduler.requests[internal[rid]].output_token_ids) for rid in cancelled}
            if min(n.values()) >= 1:
                mid = n
                eng.abort_request(cancelled)
        assert steps < 500
    after_abort = _state(llm)
    # Full capacity again: MAX_SEQS requests run side by side.
    fresh = _ids(MAX_SEQS, 12, 2, seed=2)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    fresh_internal = [eng.add_request(f"f{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(fresh)]
    peak, fresh_out = 0, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                fresh_out[out.request_id] = list(out.outputs[0].token_ids)
        peak = max(peak, len(_core(llm).scheduler.running))
    # One more step so the runner learns that the last requests ended.
    tail = list(llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, temperature=0.0),
                             use_tqdm=False)[0].outputs[0].token_ids)
    return {"before": before, "after_abort": after_abort, "after": _state(llm), "mid": mid,
            "survivors": {k: v for k, v in done.items() if k not in cancelled},
            "cancelled_internal": [internal[r] for r in cancelled], "steps": steps, "peak_running": peak,
            "fresh": fresh_out, "fresh_internal": fresh_internal, "tail": tail}


def _decode_records(recs: list[dict], prompts: list[list[int]]) -> list[dict]:
    """Draft records of decode steps only. The proposer also drafts (and vLLM discards) at the
    end of every partial prefill chunk, and a cache hit skips chunks: those records differ by
    design. Requests ran one at a time, so the i-th request id seen is prompt i."""
    order: list[str] = []
    for r in recs:
        if r["req_id"] not in order:
            order.append(r["req_id"])
    return [r for r in recs if r["pos"] >= len(prompts[order.index(r["req_id"])])]


def _prefix(llm, trace) -> dict:
    from vllm import SamplingParams

    prompts = _prefix_prompts()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    res = {}
    for phase in ("cold", "warm"):
        m0, h0, t0 = spec_metrics(llm), _counter(llm, "vllm:prefix_cache_hits"), len(read_trace(trace)) if trace else 0
        tokens = []
        for p in prompts:
            if phase == "cold":
                assert llm.reset_prefix_cache()
            tokens.append(list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids))
        recs = _decode_records(read_trace(trace)[t0:], prompts) if trace else []
        res[phase] = {"tokens": tokens, "hits": _counter(llm, "vllm:prefix_cache_hits") - h0,
                      "acceptance": acceptance_summary(_delta(spec_metrics(llm), m0)) if trace else None,
                      "drafts": [(r["pos"], r["anchor"], r["draft"], r["kept"]) for r in recs],
                      "confidence": [r["confidence"] for r in recs]}
    return res


def _preemption(llm) -> dict:
    from vllm import SamplingParams

    p0 = _counter(llm, "vllm:num_preemptions")
    outs = llm.generate([{"prompt_token_ids": p} for p in _ids(6, 90, 10, seed=3)],
                        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "preemptions": _counter(llm, "vllm:num_preemptions") - p0}


def _structured(llm) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate(TEXT_PROMPTS, params, use_tqdm=False)
    tok = llm.get_tokenizer()
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "text": [tok.decode(list(o.outputs[0].token_ids), skip_special_tokens=True) for o in outs],
            "finish": [o.outputs[0].finish_reason for o in outs]}


def _run_all(llm, trace=None) -> dict:
    out, seconds = {}, {}
    for name, fn in (("cancel", _cancellations), ("prefix", lambda x: _prefix(x, trace)),
                     ("preempt", _preemption), ("structured", _structured)):
        t0 = time.monotonic()
        out[name] = fn(llm)
        seconds[name] = round(time.monotonic() - t0, 1)
    out["seconds"] = seconds
    return out


@pytest.fixture(scope="module")
def baseline(pair):
    t0 = time.monotonic()
    with llm_engine(pair["target"], env=ENV, **ENGINE) as llm:
        start = time.monotonic() - t0
        res = _run_all(llm)
        res["seconds"]["start"] = round(start, 1)
        return res


@pytest.fixture(scope="module")
def dspark(pair, baseline, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    spec = {"method": "dspark", "model": pair["draft"], "num_speculative_tokens": 7,
            "dspark": {"verification": "fixed"}}
    t0 = time.monotonic()
    with llm_engine(pair["target"], speculative_config=spec, env={**ENV, "VLLM_DSPARK_TRACE": str(trace)},
                    **ENGINE) as llm:
        start = time.monotonic() - t0
        res = _run_all(llm, trace)
        res["seconds"]["start"] = round(start, 1)
        res["acceptance_total"] = acceptance_summary(spec_metrics(llm))
        return res


# ------------------------------------------------------------------ cancellations
def test_cancelled_requests_leave_no_state_and_free_their_blocks(dspark, baseline):
    c = dspark["cancel"]
    assert c["before"]["drafter"] == "DSparkProposer"
    assert all(0 < n < 32 for n in c["mid"].values()), c["mid"]  # aborted mid-decode
    # Survivors decode exactly as without speculation (and without the aborts there).
    assert c["survivors"] == baseline["cancel"]["survivors"]
    assert sorted(c["survivors"]) == ["c0", "c5", "c6", "c7"] and all(len(t) == 32 for t in c["survivors"].values())
    for key in ("after_abort", "after"):
        s = c[key]
        assert s["free_blocks"] == c["before"]["free_blocks"], (key, s)  # every block back
        assert s["scheduler_requests"] == [] and s["running"] == 0 and s["waiting"] == 0, (key, s)
    s = c["after"]
    held = set(s["runner_requests"]) | set(s["batch_requests"]) | set(s["prev"] or [])
    assert not held & set(c["cancelled_internal"]), s
    assert not held & set(c["fresh_internal"]), s  # finished requests are released too
    assert len(s["runner_requests"]) <= 1, s  # at most the last one, released at the next step


def test_full_capacity_after_cancellations(dspark, baseline):
    c = dspark["cancel"]
    assert c["peak_running"] == MAX_SEQS
    assert c["fresh"] == baseline["cancel"]["fresh"] and len(c["fresh"]) == MAX_SEQS


# ------------------------------------------------------------------ prefix caching
def test_prefix_cache_hits_keep_outputs_lossless(dspark, baseline):
    p, b = dspark["prefix"], baseline["prefix"]
    # Every warm request finds the shared prefix but its last block, which vLLM recomputes for
    # hidden-state speculators (the drafter needs the target's hidden states there).
    assert p["cold"]["hits"] == 0 and p["warm"]["hits"] >= 4 * (PREFIX - BLOCK), (p["cold"]["hits"], p["warm"]["hits"])
    assert p["cold"]["tokens"] == b["cold"]["tokens"] == b["warm"]["tokens"]
    assert p["warm"]["tokens"] == b["warm"]["tokens"]


def test_prefix_cache_hits_keep_the_drafters_context(dspark):
    """With the drafter's context K/V of a cached prefix missing or stale, the warm run would
    draft differently from the cold run and accept fewer tokens."""
    cold, warm = dspark["prefix"]["cold"], dspark["prefix"]["warm"]
    assert cold["drafts"] and warm["drafts"] == cold["drafts"]
    flat = lambda rows: torch.tensor([x for r in rows for x in r])  # noqa: E731
    assert torch.allclose(flat(warm["confidence"]), flat(cold["confidence"]), atol=1e-4)
    a_cold, a_warm = cold["acceptance"], warm["acceptance"]
    assert a_cold["num_drafts"] > 0 and a_cold["mean_acceptance_length"] > 1.5, a_cold
    assert a_warm["mean_acceptance_length"] >= a_cold["mean_acceptance_length"] - 0.05, (a_cold, a_warm)


# ------------------------------------------------------------------ preemption
def test_preemption_keeps_outputs_lossless(dspark, baseline):
    p = dspark["preempt"]
    assert p["preemptions"] > 0, "the tiny KV cache should have forced preemptions"
    assert p["tokens"] == baseline["preempt"]["tokens"]
    assert all(len(t) == 40 for t in p["tokens"])


# ------------------------------------------------------------------ structured output
def test_structured_output_is_valid_json_and_lossless(dspark, baseline):
    s = dspark["structured"]
    assert s["tokens"] == baseline["structured"]["tokens"]
    for text, finish in zip(s["text"], s["finish"], strict=True):
        obj = json.loads(text)
        assert finish == "stop" and set(obj) == {"name", "age", "ok"}, text
        assert obj["name"].isalpha() and 0 <= obj["age"] <= 120 and isinstance(obj["ok"], bool), text


def test_speculation_really_ran(dspark, baseline):
    acc = dspark["acceptance_total"]
    assert acc["num_drafts"] > 100 and acc["mean_acceptance_length"] > 1.5, acc
    print("workload seconds: dspark", dspark["seconds"], "baseline", baseline["seconds"])
