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


def _prior(rate_by_bin: dict[int, float], positions: int = N, weight: float = 1000.0):
    from vllm_dspark.spec_decode.common.copy_prior import CopyPrior

    hits, counts, pred = (np.zeros((positions, 10)) for _ in range(3))
    for b, rate in rate_by_bin.items():
        counts[:, b], hits[:, b], pred[:, b] = weight, weight * rate, weight * (b + 0.5) / 10
    return CopyPrior(hits, counts, pred, 2, 8)


def test_with_a_prior_a_long_match_is_copied_from_the_first_step():
    """n-gram's eagerness where the copy's measured acceptance pays: no probe, no wait."""
    conf = np.array([[0.95] * N, [0.35] * N], np.float32)  # a long match; a 2-token match
    copy = CopyDrafts(conf, [N, N])
    quiet = settings(copy="auto", probe_tokens=0)  # no probes: the unproven drafter skips every step
    eager = StepPlanner(quiet, N, lambda fn: fn(), _prior({9: 0.99, 3: 0.02}))
    eager.costs = C.CostModel(verify=[(1, 0.03), (256, 0.03 + 255 * 0.002)], draft=[(1, 0.01), (64, 0.02)])
    plan = eager.plan([N, N], np.zeros(2, bool), copy)
    assert plan.mode is PlanMode.SKIP and plan.sources == (COPY_SOURCE,)
    assert plan.copy_mode is PlanMode.DRAFT and plan.copy_kept == (N, 0)  # the long match only
    unproven = StepPlanner(quiet, N, lambda fn: fn())
    unproven.costs = eager.costs
    assert unproven.plan([N, N], np.zeros(2, bool), copy).copy_kept == ()  # nothing before it is measured


@pytest.mark.parametrize("rule", ["threshold", "product", "fixed"])
def test_a_verification_rule_gives_each_request_the_source_that_promises_more(rule):
    decide, calls = decide_log()
    p = StepPlanner(settings(verification=rule, threshold=0.5, copy="auto"), N, decide, _prior({9: 0.99}))
    conf = np.array([[0.95] * N, [0.95] * 2 + [0] * 2, [0] * N], np.float32)
    copy = CopyDrafts(conf, [N, 2, 0])  # a full copy, a short one, none
    plan = p.plan([N, N, N], np.zeros(3, bool), copy)
    assert plan.mode is PlanMode.DRAFT and plan.sources == (MODEL_SOURCE, COPY_SOURCE)
    model = np.full((3, N), 0.9)
    kept, picks = p.allocate(plan, [N, N, N], np.zeros(3, bool), model, copy)
    # The drafter is unmeasured (its calibrated levels start low): the copies win where they exist, but
    # under fixed a short copy would verify fewer than the fixed count, so that request keeps the drafter.
    want_short = MODEL_SOURCE if rule == "fixed" else COPY_SOURCE
    assert picks == [COPY_SOURCE, want_short, MODEL_SOURCE]
    assert kept[0] == N and kept[1] == (N if rule == "fixed" else 2)
    assert calls[-1] == (kept, picks)  # the decider's choice is what every rank keeps
    off = StepPlanner(settings(verification=rule, threshold=0.5, copy="off"), N, lambda fn: fn())
    assert off.plan([N, N, N], np.zeros(3, bool), copy).sources == (MODEL_SOURCE,)


def test_a_sources_own_cost_is_learnt_from_a_profile_and_fixed_by_a_given_table():
    learnt = C.CostModel(verify=[(1, 0.03), (64, 0.06)], draft=[(1, 0.01), (64, 0.02)])
    assert not learnt.has_source(COPY_SOURCE)
    learnt.observe_source(COPY_SOURCE, 2, 0.040)  # the first step runs cold: not learnt
    assert not learnt.has_source(COPY_SOURCE)
    learnt.observe_source(COPY_SOURCE, 1, 0.004)
    assert learnt.draft_time(1, COPY_SOURCE) == pytest.approx(0.004)
    assert learnt.draft_time(8, COPY_SOURCE) == pytest.approx(0.004)  # one point: flat
    # A new batch size starts from the curve and moves as an EMA: one slow step there (a stall, or its
    # first run) cannot price the size at its own time.
    learnt.observe_source(COPY_SOURCE, 8, 0.100)
    assert learnt.draft_time(8, COPY_SOURCE) == pytest.approx(0.004 + 0.1 * (4 * 0.004 - 0.004))
    for _ in range(200):
        learnt.observe_source(COPY_SOURCE, 8, 0.010)
    assert learnt.draft_time(8, COPY_SOURCE) == pytest.approx(0.010, rel=1e-3)
    assert learnt.draft_time(4, COPY_SOURCE) == pytest.approx(0.004 + 3 * 0.006 / 7, rel=1e-3)
    given = C.CostModel.from_dict({"verify": [[1, 0.03]], "draft": [[1, 0.01]],
                                   "sources": {COPY_SOURCE: [[1, 0.002]]}}, given=True)
    given.observe_source(COPY_SOURCE, 1, 1.0)  # a busy machine's step: not learnt
    assert given.draft_time(1, COPY_SOURCE) == pytest.approx(0.002)
    bare = C.CostModel.from_dict({"verify": [[1, 0.03]], "draft": [[1, 0.01]]}, given=True)
    bare.observe_source(COPY_SOURCE, 1, 1.0)
    assert not bare.has_source(COPY_SOURCE)  # a given table without the copy's cost: 0, whatever the load


def test_a_copy_that_does_not_pay_for_its_own_step_is_declined():
    surv = np.array([[0.9, 0.8, 0.7, 0.6]])
    costs = C.CostModel(verify=[(1, 0.030), (64, 0.030 + 63 * 0.001)], draft=[(1, 0.01), (64, 0.02)])
    assert sum(budget.allocate(surv, [N], costs).kept) == N
    assert sum(budget.allocate(surv, [N], costs, source_cost=0.2).kept) == 0  # 0.2 s a step: never pays


def test_with_nothing_to_copy_the_forward_runs_only_where_the_drafter_alone_pays():
    """The drafting state can stand on copies: the budget's last allocation priced both sources. A step with
    nothing to copy then runs the drafter's forward only where its own measured levels pay for it, and
    otherwise ends the drafting state as failing levels do, so the drafter's probes resume (nothing measures
    it in that state while its forward is skipped). With the copy off the drafting state is the drafter's
    own forecast, and stands."""
    # A 30 ms step up to 8 tokens, 1 ms a token past it, a 12 ms forward (batch 8 on the 2-core EPYC, roughly).
    costs = C.CostModel(verify=[(1, 0.030), (8, 0.030), (64, 0.086)], draft=[(1, 0.012), (8, 0.012)])
    caps, greedy = [N] * 8, np.zeros(8, bool)
    nothing = CopyDrafts(np.zeros((8, N)), [0] * 8)
    plans = {}
    for copy in ("auto", "off"):
        p = StepPlanner(settings(copy=copy), N, decide_log()[0])
        p.costs = costs
        p.policy.state, p.policy.draft_pays_next = "drafting", True
        plans[copy] = p.plan(caps, greedy, nothing if copy == "auto" else None)
        assert p.policy.state == ("waiting" if copy == "auto" else "drafting"), copy
    assert plans["auto"].mode is not PlanMode.DRAFT  # at most a probe's few rows (this drafter is unmeasured)
    assert plans["off"].mode is PlanMode.DRAFT

    # After it, the drafter is looked at again within its wait, and drafts once its levels pay.
    p = StepPlanner(settings(copy="auto"), N, decide_log()[0])
    p.costs = costs
    p.policy.state, p.policy.draft_pays_next = "drafting", True
    assert not p.policy.drafter_pays(caps, greedy)  # the unproven drafter's pessimistic levels
    assert p.plan(caps, greedy, nothing).mode is not PlanMode.DRAFT
    for _ in range(200):  # a drafter accepted 90% a position
        p.policy.feedback(PlanMode.DRAFT, [budget.Feedback([0.9] * N, N, N, False)])
    assert p.policy.drafter_pays(caps, greedy)
    modes = [p.plan(caps, greedy, nothing) for _ in range(p.policy.rhythm.period + 1)]
    assert any(m.drafter_runs for m in modes) and p.policy.state == "drafting"
