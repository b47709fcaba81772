"""The step planner (``spec_decode/common/planner.py``): feedback -> plan -> source per request ->
allocation, without torch or vLLM."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from vllm_dspark.serving.settings import DSparkSettings
from vllm_dspark.spec_decode.common import budget
from vllm_dspark.spec_decode.common import costs as C
from vllm_dspark.spec_decode.common.budget import Plan, PlanMode
from vllm_dspark.spec_decode.common.planner import CopyDrafts, StepPlanner
from vllm_dspark.spec_decode.common.sources import COPY_SOURCE, MODEL_SOURCE

N = 4


def settings(**changes) -> DSparkSettings:
    base = dict(draft="d", block_size=N, num_draft_tokens=N, max_draft_tokens=N, query_layout="anchor_first",
                has_confidence_head=True, verification="budget", threshold=0.5, window=None,
                max_draft_context=None, draft_sampling="auto", use_markov=True, trained_context=4096,
                served_context=4096)
    return DSparkSettings(**{**base, **changes})


def decide_log():
    calls: list[object] = []

    def decide(fn):
        out = fn()
        calls.append(out)
        return out
    return decide, calls


def cheap_verify() -> C.CostModel:
    """Verification nearly free, the drafter free: every draft with any chance pays."""
    return C.CostModel(verify=[(1, 0.1), (256, 0.1 + 1e-6)], draft=[(1, 0.0), (64, 0.0)])


def test_the_planner_imports_neither_torch_nor_vllm():
    code = ("import sys, vllm_dspark.spec_decode.common.planner\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm'))\n"
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_no_cap_skips_and_a_fixed_rule_drafts_every_cap():
    decide, calls = decide_log()
    p = StepPlanner(settings(verification="fixed"), N, decide)
    assert p.plan([0, 0], np.zeros(2, bool)) is budget.SKIP
    plan = p.plan([N, 2], np.zeros(2, bool))
    assert plan is budget.DRAFT
    kept, picks = p.allocate(plan, [N, 2], np.zeros(2, bool), np.full((2, N), 0.9))
    assert kept == [N, 2] and picks == [MODEL_SOURCE] * 2 and calls == []  # fixed: nothing to broadcast


def test_the_budget_without_a_cost_model_says_what_did_not_run():
    p = StepPlanner(settings(), N, lambda fn: fn())
    with pytest.raises(RuntimeError, match="no cost model"):
        p.plan([N], np.zeros(1, bool))


def test_a_threshold_rule_is_broadcast_by_the_decider():
    decide, calls = decide_log()
    p = StepPlanner(settings(verification="threshold", threshold=0.5), N, decide)
    conf = np.array([[0.9, 0.8, 0.2, 0.9]])
    kept = p.verify(conf, [N], np.zeros(1, bool))
    assert kept == [2] and calls == [[2]]


def test_sent_drafts_are_judged_by_the_next_feedback():
    p = StepPlanner(settings(verification="fixed"), N, lambda fn: fn())
    plan = Plan(PlanMode.DRAFT)
    p.record(["a", "b", "c"], plan, N, [3, 0, 4], [MODEL_SOURCE, MODEL_SOURCE, COPY_SOURCE],
             [[0.9] * N, [0.5] * N, [0.4] * N], np.zeros(3, bool))
    assert set(p.sent) == {"a", "c"} and p.sent_kind is PlanMode.DRAFT
    # b left the batch; a had 1 of its 3 rejected, c all of its 4 accepted.
    records = p.feedback(["a", "c"], [1, 0], trace=True)
    assert [(r["req_id"], r["verified"], r["accepted"], r["source"]) for r in records] == [
        ("a", 3, 2, MODEL_SOURCE), ("c", 4, 4, COPY_SOURCE)]
    by = p.stats.as_dict()["by_source"]
    assert by[MODEL_SOURCE]["accepted"] == 2 and by[COPY_SOURCE]["accepted"] == 4
    assert p.step == 1 and records[0]["step"] == 1
    p.record_none(N, 2)
    assert p.sent == {} and p.feedback(["a"], [0]) == [] and p.step == 2


def test_feedback_moves_the_drafters_calibration():
    p = StepPlanner(settings(), N, lambda fn: fn())
    before = p.policy.calibrator.table()
    for _ in range(20):
        p.record(["a"], Plan(PlanMode.DRAFT), N, [N], [MODEL_SOURCE], [[0.9] * N], np.zeros(1, bool))
        p.feedback(["a"], [N])  # every draft rejected
    assert p.policy.calibrator.table() != before


def test_a_probe_keeps_its_few_and_a_copy_probe_fills_rows_the_drafter_left():
    p = StepPlanner(settings(), N, lambda fn: fn())
    plan = Plan(PlanMode.PROBE, rows=(0,), tokens=2, copy_kept=(0, 3), copy_mode=PlanMode.PROBE)
    kept, picks = p.allocate(plan, [N, N], np.zeros(2, bool), np.full((2, N), 0.9))
    assert kept == [2, 3] and picks == [MODEL_SOURCE, COPY_SOURCE]


def test_a_copy_only_step_sends_what_the_plan_copies():
    p = StepPlanner(settings(), N, lambda fn: fn())
    plan = Plan(PlanMode.SKIP, sources=(COPY_SOURCE,), copy_kept=(3, 0), copy_mode=PlanMode.DRAFT)
    copy = CopyDrafts(np.zeros((2, N), np.float32), [3, 0])
    assert p.allocate(plan, [N, N], np.zeros(2, bool), None, copy) == ([3, 0], [COPY_SOURCE, MODEL_SOURCE])


def test_the_choice_among_sources_is_the_budgets_cut_at_the_copy_and_keeps_copy_probes(monkeypatch):
    decide, calls = decide_log()
    p = StepPlanner(settings(copy="auto"), N, decide)
    p.costs = cheap_verify()
    assert p.copy_policy is not None and p.costs is p.policy.costs
    seen = {}

    def choose_among(confs, caps, sampled):
        seen.update(confs=confs, caps=list(caps))
        return budget.Allocation([3, 4, 0], 0, 0, 0, 0, 0, True), [MODEL_SOURCE, COPY_SOURCE, MODEL_SOURCE]

    monkeypatch.setattr(p.policy, "choose_among", choose_among)
    model = np.full((3, N), 0.8)
    copy = CopyDrafts(np.array([[0.5] * N, [0.9, 0.9, 0, 0], [0.7, 0.7, 0.7, 0]], np.float32), [4, 2, 3])
    plan = Plan(PlanMode.DRAFT, sources=(MODEL_SOURCE, COPY_SOURCE), copy_kept=(0, 0, 3), copy_mode=PlanMode.PROBE)
    kept, picks = p.allocate(plan, [N, N, N], np.zeros(3, bool), model, copy)
    # Row 1's copy is cut at its 2 copied tokens; row 2 probes the copy, so the choice left it out.
    assert kept == [3, 2, 3] and picks == [MODEL_SOURCE, COPY_SOURCE, COPY_SOURCE]
    assert seen["caps"] == [N, N, 0] and seen["confs"][COPY_SOURCE].dtype == np.float64
    assert calls == [(kept, picks)]
