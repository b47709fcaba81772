"""The copy source's part of the plan (``copy_policy.py``): pure logic, no engine.

Costs are pinned: ``FLAT`` makes every verified token free (any positive survival pays), ``LINEAR``
prices a verified token at a tenth of a decode step (a survival above ~0.1 pays) and ``DEAR`` at a
whole one (nothing but a certain token pays).
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_dspark.spec_decode.common import costs as C
from vllm_dspark.spec_decode.common.budget import DRAFT, SKIP, BudgetPolicy, Feedback, Plan, PlanMode, TrustConfig
from vllm_dspark.spec_decode.common.copy_policy import CopyPolicy
from vllm_dspark.spec_decode.common.copy_source import match_confidence

N = 7
FLAT = C.CostModel(verify=[(1, 0.01), (512, 0.01)], draft=[(1, 0.001), (64, 0.001)])
LINEAR = C.CostModel(verify=[(1, 0.01), (513, 0.01 + 512 * 0.001)], draft=[(1, 0.001), (64, 0.001)])
DEAR = C.CostModel(verify=[(1, 0.01), (513, 0.01 * 513)], draft=[(1, 0.001), (64, 0.001)])


def _policy(costs=LINEAR, **trust) -> tuple[BudgetPolicy, CopyPolicy]:
    p = BudgetPolicy(N, TrustConfig(**trust), costs=costs)
    return p, CopyPolicy(p)


def _offer(matches: list[int], lengths: list[int]) -> np.ndarray:
    conf = np.zeros((len(matches), N))
    for i, (m, n) in enumerate(zip(matches, lengths, strict=True)):
        conf[i, :n] = match_confidence(m)
    return conf


def _teach(cp: CopyPolicy, match: int, verified: int, accepted: int, times: int, kind=PlanMode.DRAFT):
    fb = [Feedback([match_confidence(match)] * verified, verified, accepted, False, "copy")] * times
    cp.policy.feedback(PlanMode.SKIP, fb)
    cp.feedback(kind, fb)


def test_the_plan_crosses_the_wire_with_its_copy_part():
    p = Plan(PlanMode.PROBE, (1, 3), 2, ("dspark", "copy"), (4, 0, 0, 0), PlanMode.PROBE)
    assert Plan.from_wire(p.to_wire()) == p
    old = ("draft", (), 0, ("dspark",))  # a plan of the wire's earlier form
    assert Plan.from_wire(old) == DRAFT and Plan.from_wire(old).copy_kept == ()
    assert not SKIP.drafter_runs and DRAFT.drafter_runs
    assert Plan(PlanMode.SKIP, sources=("copy",)).runs and not Plan(PlanMode.SKIP, sources=("copy",)).drafter_runs


def test_an_unproven_copy_is_probed_on_its_longest_matches():
    _, cp = _policy(DEAR, probe_requests=2, probe_tokens=2)
    conf = _offer([3, 12, 0, 6], [7, 5, 0, 1])
    plan = cp.plan(SKIP, conf, [7, 5, 0, 1], [7] * 4, np.zeros(4, bool))
    # Nothing pays on the pessimistic prior; its optimistic bound (1 before anything is measured) does.
    assert plan.copy_mode is PlanMode.PROBE and plan.sources == ("copy",)
    assert plan.copy_kept == (0, 2, 0, 1)  # rows 1 (match 12) and 3 (match 6), at most their copied length
    assert plan.mode is PlanMode.SKIP and not plan.drafter_runs


def test_probe_waits_double_on_rejection_and_halve_on_acceptance():
    _, cp = _policy(DEAR, probe_max_period=64)
    _teach(cp, 5, 2, 0, 1, kind=PlanMode.PROBE)
    assert cp.rhythm.period == 2 and cp.rhythm.wait == 2
    _teach(cp, 5, 2, 0, 1, kind=PlanMode.PROBE)
    assert cp.rhythm.period == 4
    _teach(cp, 5, 2, 2, 1, kind=PlanMode.PROBE)
    assert cp.rhythm.period == 2 and cp.counters["probes_accepted"] == 1


def test_a_copy_proven_accepted_is_sent_by_the_allocation():
    _, cp = _policy(LINEAR)
    _teach(cp, 12, 7, 7, 60)
    conf = _offer([12, 0], [7, 0])
    plan = cp.plan(SKIP, conf, [7, 0], [7, 7], np.zeros(2, bool))
    assert plan.copy_mode is PlanMode.DRAFT and plan.copy_kept[0] >= 5 and plan.copy_kept[1] == 0


def test_a_copy_proven_rejected_stops_being_sent():
    _, cp = _policy(DEAR, probe_max_period=8)
    _teach(cp, 4, 2, 0, 200)
    conf = _offer([4], [7])
    sent = [sum(cp.plan(SKIP, conf, [7], [7], np.zeros(1, bool)).copy_kept) for _ in range(64)]
    assert sum(1 for x in sent if x) <= 64 // 8 + 1  # a probe every max period at most


def test_copy_evidence_never_moves_the_drafters_state():
    p, cp = _policy(LINEAR)
    p.state, p.draft_pays_next = "drafting", True
    for _ in range(20):  # all-rejected copies in drafting steps: the drafter would be stopped by 8
        p.feedback(PlanMode.DRAFT, [Feedback([0.5] * 3, 3, 0, False, "copy")])
    assert p.state == "drafting" and p.reject_steps == 0
    assert p.calibrator_of("copy").total_counts.sum() == 20 and p.calibrator.total_counts.sum() == 0


def test_drafting_step_drops_the_forward_when_every_request_copies():
    p, cp = _policy(LINEAR)
    _teach(cp, 12, 7, 7, 60)
    for _ in range(40):  # the drafter measured poor: 1 in 10 at its first position
        p.feedback(PlanMode.DRAFT, [Feedback([0.9] * 2, 2, int(_ % 10 == 0), False)])
    conf = _offer([12, 20], [7, 7])
    plan = cp.plan(DRAFT, conf, [7, 7], [7, 7], np.zeros(2, bool))
    assert plan.sources == ("copy",) and not plan.drafter_runs and plan.mode is PlanMode.DRAFT
    assert min(plan.copy_kept) >= 5 and cp.counters["steps_copy_only"] == 1
    # One request without a copy: the poor drafter's forward would not pay for what it adds on that row.
    conf = _offer([12, 0], [7, 0])
    plan = cp.plan(DRAFT, conf, [7, 0], [7, 7], np.zeros(2, bool))
    assert plan.sources == ("copy",) and cp.counters["steps_copy_only"] == 2


def test_drafting_step_runs_the_forward_where_a_good_drafter_pays_beside_the_copies():
    p, cp = _policy(LINEAR)
    _teach(cp, 12, 7, 7, 60)
    for _ in range(60):  # the drafter measured good: 3 of 3 accepted
        p.feedback(PlanMode.DRAFT, [Feedback([0.9] * 3, 3, 3, False)])
    conf = _offer([12, 0], [7, 0])  # the second request has no copy: the drafter's row pays for its forward
    plan = cp.plan(DRAFT, conf, [7, 0], [7, 7], np.zeros(2, bool))
    assert plan.sources == ("dspark", "copy") and plan.copy_kept == ()
    # The same drafter, its forward priced at ten decode steps: the copies alone do better.
    p.costs = C.CostModel(verify=LINEAR.verify, draft=[(1, 0.1), (64, 0.1)])
    plan = cp.plan(DRAFT, conf, [7, 0], [7, 7], np.zeros(2, bool))
    assert plan.sources == ("copy",)


def test_drafting_step_probes_an_unproven_copy_beside_the_drafter():
    p, cp = _policy(LINEAR, probe_requests=1, probe_tokens=2)
    for _ in range(60):  # the drafter measured decent
        p.feedback(PlanMode.DRAFT, [Feedback([0.9] * 3, 3, 2, False)])
    conf = _offer([9, 3], [7, 7])
    plan = cp.plan(DRAFT, conf, [7, 7], [7, 7], np.zeros(2, bool))
    assert plan.drafter_runs and "copy" in plan.sources
    assert plan.copy_mode is PlanMode.PROBE and plan.copy_kept == (2, 0)


def test_choose_among_gives_each_request_the_source_that_promises_more():
    p, cp = _policy(FLAT)
    _teach(cp, 12, 7, 7, 60)
    for _ in range(60):
        p.feedback(PlanMode.DRAFT, [Feedback([0.5] * 2, 2, 0, False)])
    copy = _offer([12, 0], [7, 0])
    model = np.full((2, N), 0.5)
    alloc, picks = p.choose_among({"dspark": model, "copy": copy}, [7, 7], np.zeros(2, bool))
    assert picks == ["copy", "dspark"] and alloc.kept[0] == 7


def test_copies_winning_a_drafting_step_do_not_put_the_drafter_to_wait():
    p, cp = _policy(LINEAR)
    _teach(cp, 12, 7, 7, 60)
    for _ in range(60):  # the drafter measured decent: where nothing matches, it should draft
        p.feedback(PlanMode.DRAFT, [Feedback([0.9] * 3, 3, 2, False)])
    p.state, p.draft_pays_next = "drafting", True
    copy = _offer([12, 20], [7, 7])
    _, picks = p.choose_among({"dspark": np.full((2, N), 0.2), "copy": copy}, [7, 7], np.zeros(2, bool))
    assert picks == ["copy", "copy"] and p.draft_pays_next
    # The next step has no match: the drafter drafts at once, its wait not doubled by the copies' win.
    assert p.plan([7, 7], np.zeros(2, bool)) == DRAFT and p.rhythm.period == p.rhythm.shortest


@pytest.mark.parametrize("mode", [PlanMode.SKIP, PlanMode.PROBE])
def test_no_copy_leaves_the_drafters_plan_alone(mode):
    _, cp = _policy(FLAT)
    model = SKIP if mode is PlanMode.SKIP else Plan(PlanMode.PROBE, (0,), 2)
    assert cp.plan(model, np.zeros((2, N)), [0, 0], [7, 7], np.zeros(2, bool)) == model


def test_a_few_rows_survival_in_plain_floats_is_the_arrays_to_the_bit(monkeypatch):
    """At batch 1 (and up to SMALL slots) the copy's survival runs in plain floats; it must equal the numpy
    path (calibrate, clip, cumprod, zero past the copy) exactly, and take the small path there."""
    from vllm_dspark.spec_decode.common import copy_policy as CP
    from vllm_dspark.spec_decode.common.budget import survival

    rng = np.random.default_rng(5)
    _, cp = _policy()
    for step in range(40):
        verified = int(rng.integers(1, N + 1))
        _teach(cp, int(rng.integers(2, 40)), verified, int(rng.integers(0, verified + 1)), 1)
        r = (1, 2, 4)[step % 3]
        matches = rng.integers(0, 70, size=r).tolist()
        lengths = [int(x) for x in rng.integers(0, N + 1, size=r)]
        conf, sampled = _offer(matches, lengths), rng.random(r) < 0.3
        want = survival(cp.calibrator.calibrate_arrays(conf, sampled))
        want = np.where(np.arange(N)[None, :] < np.asarray(lengths)[:, None], want, 0.0)
        assert np.array_equal(cp.survival(conf, lengths, sampled), want), step
    monkeypatch.setattr(CP, "SMALL", -1)  # the arrays' path, as at batch 8
    assert np.array_equal(cp.survival(conf, lengths, sampled), want)
    calls = []
    monkeypatch.setattr(CP.CopyPolicy, "_survival_small", lambda self, *a: calls.append(a) or want)
    cp.survival(conf, lengths, sampled)
    assert not calls
    monkeypatch.setattr(CP, "SMALL", 32)
    cp.survival(conf, lengths, sampled)
    assert len(calls) == 1
