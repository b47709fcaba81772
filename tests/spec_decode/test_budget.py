"""Budgeted verification on hand-made confidences and cost tables (no engine)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_dspark.spec_decode import budget as B


def flat(t=0.1, d=0.01):
    """A memory-bound machine: verifying 1 or 256 tokens costs the same."""
    return B.CostModel(verify=[(1, t), (256, t)], draft=[(1, d), (64, d)])


def linear(per_token=0.01, fixed=0.0, d=0.0):
    """A compute-bound machine: every token costs the same."""
    return B.CostModel(verify=[(1, fixed + per_token), (256, fixed + 256 * per_token)], draft=[(1, d), (64, d)])


def test_survival_is_the_running_product():
    s = B.survival(np.array([[0.9, 0.5, 1.0], [0.2, 0.9, 0.9]]))
    np.testing.assert_allclose(s, [[0.9, 0.45, 0.45], [0.2, 0.18, 0.162]])


def test_free_verification_admits_every_slot():
    surv = B.survival(np.full((3, 7), 0.3))
    a = B.allocate(surv, [7, 7, 7], flat())
    assert a.kept == [7, 7, 7] and a.rate > a.plain_rate


def test_purely_compute_bound_never_speculates():
    # Every token costs the same and nothing is fixed: a draft token can never be worth its cost.
    surv = np.array([[0.99, 0.98, 0.6, 0.3], [0.5, 0.2, 0.1, 0.05]])
    assert B.allocate(surv, [4, 4], linear(per_token=0.01)).kept == [0, 0]


def test_marginal_slots_must_beat_the_current_rate():
    # T(n) = 0.05 + 0.01 n: a slot pays while its survival exceeds rate x 0.01 s.
    surv = np.array([[0.99, 0.98, 0.6, 0.3], [0.5, 0.2, 0.1, 0.05]])
    a = B.allocate(surv, [4, 4], linear(per_token=0.01, fixed=0.05))
    assert a.kept == [3, 1], a  # 0.99, 0.98, 0.6, 0.5 admitted; 0.3 would lower the rate
    assert a.expected_tokens == pytest.approx(2 + 0.99 + 0.98 + 0.6 + 0.5)
    assert a.rate == pytest.approx(5.07 / 0.11)


def test_zero_drafts_when_no_slot_pays():
    surv = B.survival(np.full((4, 7), 0.1))
    a = B.allocate(surv, [7] * 4, linear(per_token=0.01, fixed=0.0, d=0.05))
    assert a.kept == [0, 0, 0, 0]
    assert not a.draft_pays  # and the drafter should not run next step


def test_ranking_is_global_across_requests_and_keeps_prefixes():
    surv = np.array([[0.95, 0.9, 0.85], [0.97, 0.2, 0.1], [0.5, 0.4, 0.3]])
    # Fixed + per-token cost: admits the best slots of all requests.
    costs = B.CostModel(verify=[(3, 0.1), (12, 0.1 + 9 * 0.004)], draft=[(1, 0.0), (8, 0.0)])
    a = B.allocate(surv, [3, 3, 3], costs)
    assert a.kept[0] >= a.kept[2] and a.kept[1] <= 1
    for row, k in zip(surv, a.kept):  # admitted slots always form a prefix of each request
        assert k == 0 or all(row[j] >= 0 for j in range(k))


def test_caps_and_gated_requests():
    surv = B.survival(np.full((3, 5), 0.9))
    a = B.allocate(surv, [5, 2, 0], flat())
    assert a.kept == [5, 2, 0]


def test_drafter_cost_decides_whether_drafting_pays():
    surv = B.survival(np.full((1, 7), 0.5))  # ~1 token gained per step
    assert B.allocate(surv, [7], flat(t=0.1, d=0.01)).draft_pays
    assert not B.allocate(surv, [7], flat(t=0.1, d=0.2)).draft_pays  # the drafter costs 2 decode steps


def test_forecast_uses_the_survival_profile():
    prof = B.SurvivalProfile(7, init=0.9)
    assert B.forecast_pays(prof.value, 4, 7, flat(d=0.01))
    assert not B.forecast_pays(prof.value, 4, 0, flat(d=0.01))
    prof.value = np.full(7, 0.01)
    assert not B.forecast_pays(prof.value, 4, 7, flat(d=0.05))


def test_cost_model_interpolates_extrapolates_and_stays_monotone():
    m = B.CostModel(verify=[(1, 0.1), (4, 0.09), (8, 0.2)], draft=[(1, 0.01)])
    assert m.verify == [(1, 0.1), (4, 0.1), (8, 0.2)]  # profiling noise cannot make tokens cheaper
    assert m.verify_time(6) == pytest.approx(0.15)
    assert m.verify_time(12) == pytest.approx(0.3)  # the last slope continues
    assert m.draft_time(5) == pytest.approx(0.01)


def test_online_corrections_follow_observed_times_but_clamp_outliers():
    m = B.CostModel(verify=[(1, 0.1), (100, 0.1)], draft=[(1, 0.01)], ema=0.5)
    m.observe_verify(10, 0.2)
    assert m.scale_verify == pytest.approx(1.5)
    m.observe_verify(10, 100.0)  # a stall: clamped to 4x before averaging
    assert m.scale_verify == pytest.approx(0.5 * 1.5 + 0.5 * 6.0)


def test_calibrator_learns_a_miscalibrated_head():
    cal = B.Calibrator(num_positions=3, prior=10)
    conf = np.array([[0.9, 0.9, 0.9]])
    assert cal.calibrate(conf, np.array([False]))[0, 0] == pytest.approx(0.9)  # no data: trust the head
    for _ in range(200):  # the head says 0.9, the target accepts position 0 only half the time
        cal.observe([0.9, 0.9, 0.9], verified=3, accepted=0, sampled=False)
        cal.observe([0.9, 0.9, 0.9], verified=3, accepted=3, sampled=False)
    got = cal.calibrate(conf, np.array([False]))[0]
    assert got[0] == pytest.approx((200 + 10 * 0.9) / (400 + 10))
    assert got[1] > 0.95  # once position 0 is accepted, the rest always were
    # Sampled requests keep their own table.
    assert cal.calibrate(conf, np.array([True]))[0, 0] == pytest.approx(0.9)
    t = cal.table()
    assert t["count"][0] == 400 and t["measured"][0] == pytest.approx(0.5)


def test_cache_round_trip(tmp_path):
    m = B.CostModel(verify=[(1, 0.1), (8, 0.2)], draft=[(1, 0.01), (4, 0.02)])
    B.save_cached(tmp_path / "c.json", m)
    got = B.load_cached(tmp_path / "c.json")
    assert got.verify == m.verify and got.draft == m.draft
    (tmp_path / "bad.json").write_text("{")
    assert B.load_cached(tmp_path / "bad.json") is None
