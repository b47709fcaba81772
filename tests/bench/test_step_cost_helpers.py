"""The step-cost benchmark's pure helpers (the benchmark itself is a script, not a test)."""

import math

from vllm_dspark.tools.bench.step_cost import (
    classify_op,
    interleaved,
    linear_slope,
    ratio_summary,
    spread_allows,
    step_phases,
    summarize,
)


def test_summaries_and_goals():
    s = summarize([3.0, 1.0, 2.0, float("nan")])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert math.isnan(summarize([])["median"])
    r = ratio_summary([1.0, 2.2, 3.0], [1.0, 2.0, 2.0])  # per-repeat ratios 1.0, 1.1, 1.5
    assert r["median"] == 1.1 and r["max"] == 1.5
    assert spread_allows({"median": 1.0, "min": 0.9, "max": 1.02, "n": 3}, 1.03) == "met"
    assert spread_allows({"median": 1.0, "min": 0.9, "max": 1.2, "n": 3}, 1.03) == "within noise"
    assert spread_allows({"median": 1.3, "min": 1.2, "max": 1.4, "n": 3}, 1.03) == "missed"


def test_order_classes_and_phases():
    assert interleaved(["a", "b"], 2) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert linear_slope([1, 2, 3], [2.0, 4.0, 6.0]) == 2.0 and linear_slope([1], [1.0]) == 0.0
    assert classify_op("_C::onednn_mm") == "gemm" and classify_op("aten::addmm") == "gemm"
    assert classify_op("_C::cpu_attention_with_kv_cache") == "attention"
    assert classify_op("_C::rotary_embedding") == "rope" and classify_op("aten::mul") == "elementwise"
    t = {"step": 10.0, "schedule": 1.0, "update_from_output": 0.5, "post_step": 0.5, "execute_model": 5.0,
         "forward": 3.0, "logits": 1.0, "sample_tokens": 2.5, "sampler": 0.5, "draft": 1.5, "propose": 1.0,
         "bookkeeping": 0.25}
    p = step_phases(t)
    assert p["scheduler"] == 2.0 and p["input_prep"] == 1.0 and p["drafter"] == 1.0 and p["draft_glue"] == 0.5
    assert p["sample_other"] == 0.25 and p["engine_other"] == 0.5 and p["target_step"] == 9.0
