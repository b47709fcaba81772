"""Budgeted verification on hand-made confidences and cost tables (no engine)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_dspark.spec_decode.common import budget as B
from vllm_dspark.spec_decode.common import calibration as K
from vllm_dspark.spec_decode.common import costs as C


def flat(t=0.1, d=0.01):
    """A memory-bound machine: verifying 1 or 256 tokens costs the same."""
    return C.CostModel(verify=[(1, t), (256, t)], draft=[(1, d), (64, d)])


def linear(per_token=0.01, fixed=0.0, d=0.0):
    """A compute-bound machine: every token costs the same."""
    return C.CostModel(verify=[(1, fixed + per_token), (256, fixed + 256 * per_token)], draft=[(1, d), (64, d)])


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
    costs = C.CostModel(verify=[(3, 0.1), (12, 0.1 + 9 * 0.004)], draft=[(1, 0.0), (8, 0.0)])
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


def test_forecast_from_a_typical_survival():
    assert B.forecast_pays(np.full(7, 0.9), 4, 7, flat(d=0.01))
    assert not B.forecast_pays(np.full(7, 0.9), 4, 0, flat(d=0.01))
    assert not B.forecast_pays(np.full(7, 0.01), 4, 7, flat(d=0.05))


def test_cost_model_interpolates_extrapolates_and_keeps_the_verify_curves_dips():
    m = C.CostModel(verify=[(1, 0.1), (4, 0.09), (8, 0.2), (8, 0.19)], draft=[(1, 0.01), (2, 0.008), (4, 0.02)])
    assert m.verify == [(1, 0.1), (4, 0.09), (8, 0.2)]  # a measured dip stays; of two runs, the slower
    assert m.verify_time(6) == pytest.approx(0.145)
    assert m.verify_time(12) == pytest.approx(0.31)  # the last slope continues
    assert m.draft == [(1, 0.01), (2, 0.01), (4, 0.02)]  # more requests never cost the drafter less
    assert m.draft_time(3) == pytest.approx(0.015)


def test_profile_sizes_are_dense_where_the_gemm_changes_path():
    assert C.profile_sizes(256, C.DENSE_SIZES) == [*range(1, 17), 32, 64, 128, 256]
    assert C.profile_sizes(12, C.DENSE_SIZES) == list(range(1, 13))
    assert C.profile_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_a_dip_in_the_verify_curve_buys_drafts_that_barely_survive():
    # bf16 SmolLM2 on the 2-core EPYC (profile, ms): one token costs more than three to six.
    ms = {1: 23.4, 2: 24.3, 3: 22.5, 4: 22.2, 5: 22.1, 6: 22.1, 7: 24.0, 8: 25.2, 16: 29.1}
    m = C.CostModel(verify=[(n, t / 1e3) for n, t in ms.items()], draft=[(1, 0.005)])
    surv = B.survival(np.full((1, 7), 0.02))  # a weak copy: 2% at the first position
    a = B.allocate(surv, [7], m)
    assert a.kept == [5] and a.step_seconds == pytest.approx(0.0221)  # the cheapest step, 6 tokens
    assert a.rate > a.plain_rate
    lifted = C.CostModel(verify=C._monotone([(n, t / 1e3) for n, t in ms.items()]), draft=[(1, 0.005)])
    assert B.allocate(surv, [7], lifted).kept == [0]  # the same drafts on the curve lifted over its dip


def test_one_number_interpolates_as_an_array_does():
    # The budget's per-step queries take the plain-Python path; it must give the array path's times.
    rng = np.random.default_rng(0)
    for _ in range(300):
        xs = np.sort(rng.choice(np.arange(1, 600), size=int(rng.integers(1, 7)), replace=False))
        points = C._merged([(int(x), float(t)) for x, t in zip(xs, rng.random(len(xs)))])
        for x in (0, 0.5, int(xs[0]), int(xs[-1]), float(rng.uniform(0, 800)), int(rng.integers(0, 800)), 900):
            one = C._interp(points, x)
            assert isinstance(one, float)
            assert one == pytest.approx(float(C._interp(points, np.array([x]))[0]), rel=1e-12, abs=1e-15)


def test_expected_tokens_of_a_few_rows_in_plain_floats_are_the_arrays_to_the_bit(monkeypatch):
    rng = np.random.default_rng(8)
    cases = []
    for _ in range(500):
        r, n = int(rng.integers(1, 5)), int(rng.integers(1, B.PAIRWISE))
        surv = B.survival(rng.random((r, n)) * rng.choice([1e-3, 1.0]))
        cases.append((surv, rng.integers(0, n + 2, size=r).tolist()))
    with monkeypatch.context() as m:  # the plain-float path, proven: the arrays' np.where is never called
        m.setattr(np, "where", lambda *a: pytest.fail("expected_tokens took the arrays' path"))
        small = [B.expected_tokens(s, c) for s, c in cases]
    monkeypatch.setattr(B, "PAIRWISE", 0)  # every case through the arrays
    assert all(np.array_equal(a, B.expected_tokens(s, c)) for a, (s, c) in zip(small, cases, strict=True))


def test_one_point_in_plain_floats_is_the_arrays_to_the_bit():
    """verify_prefixes prices in plain floats (_interp_point); the array path's bits, at and between the
    points, before the first, past the last, on dips and flat stretches, and on one-point curves."""
    rng = np.random.default_rng(4)
    for _ in range(400):
        xs = np.sort(rng.choice(np.arange(1, 300), size=int(rng.integers(1, 9)), replace=False))
        ys = rng.random(len(xs)) * 0.1
        if len(ys) > 2:
            ys[1] = ys[2]  # a flat stretch
        points = C._merged([(int(x), float(t)) for x, t in zip(xs, ys)])
        arr = (np.array([p[0] for p in points], dtype=np.float64), np.array([p[1] for p in points], dtype=np.float64))
        grid = np.concatenate([np.arange(0, 320), xs.astype(np.float64), rng.uniform(0, 400, 50)])
        want = C._interp_xy(*arr, grid).tolist()
        got = [C._interp_point(points, float(x)) for x in grid]
        assert got == want


def test_verify_prefixes_price_as_the_curve_does_until_it_or_its_scale_changes():
    m = C.CostModel(verify=[(1, 0.04), (2, 0.045), (8, 0.07)], draft=[(1, 0.005)])

    def fresh(base, slots):
        return np.asarray(m.verify_time(base + np.arange(slots + 1)), dtype=np.float64).tolist()

    first = m.verify_prefixes(1, 7)
    assert first == fresh(1, 7) and m.verify_prefixes(1, 7) is first  # kept within a step
    assert m.verify_prefixes(3, 4) == fresh(3, 4)
    m.observe_verify(2, 0.06)  # the scale and the curve's shape both move
    assert m.verify_prefixes(1, 7) == fresh(1, 7) != first
    m.scale_verify *= 1.5  # set from outside: still repriced
    assert m.verify_prefixes(1, 7) == fresh(1, 7)


def test_level_survival_is_each_requests_mode_row_of_the_levels_survival():
    policy = B.BudgetPolicy(7)
    rng = np.random.default_rng(3)
    for _ in range(20):
        policy.calibrator.observe_many([(rng.random(7).tolist(), 7, int(rng.integers(0, 8)), bool(rng.random() < 0.5))
                                        for _ in range(3)])
        sampled = rng.random(5) < 0.5
        want = B.survival(policy.calibrator.levels()[sampled.astype(np.int64)])
        assert np.array_equal(policy.level_survival(sampled), want)
        opt = B.survival(policy.calibrator.levels_optimistic()[sampled.astype(np.int64)])
        assert np.array_equal(policy.level_survival(sampled, optimistic=True), opt)


def test_a_profile_the_corrections_keep_disowning_is_stale():
    m = C.CostModel(verify=[(1, 0.1), (100, 0.2)], draft=[(1, 0.01)], ema=0.5, patience=10)
    for _ in range(200):  # noise around the profile never makes it stale
        m.observe_verify(1, 0.1 * float(np.random.default_rng(len(str(_))).uniform(0.7, 1.4)))
    assert not m.stale
    while m.far_verify == 0:  # steps take a third of the profiled time (it was taken on a busy machine)
        m.observe_verify(1, 0.033)
    for _ in range(8):
        m.observe_verify(1, 0.033)
    assert m.scale_verify < 0.5 and m.far_verify == 9 and not m.stale
    m.observe_verify(1, 0.033)
    assert m.stale
    before = (m.verify_time(1), m.verify_time(100))
    assert before[0] == pytest.approx(0.033, rel=0.05)  # the scale and the point's own shape, together
    m.rebase()  # the corrections folded into the curves
    assert not m.stale and m.scale_verify == 1.0 and m.rebased == 1 and m.shape_verify == [1.0, 1.0]
    assert (m.verify_time(1), m.verify_time(100)) == pytest.approx(before)
    m2 = C.CostModel(verify=[(1, 0.1)], draft=[(1, 0.01)], ema=0.5, patience=3)
    for _ in range(3):
        m2.observe_draft(1, 0.1)  # the drafter is 10x slower than profiled
    assert m2.stale


def test_the_verify_curve_learns_each_points_own_error():
    # A batch-8 profile whose 16-token point came out slow beside its neighbours (profiling noise): the
    # first draft token of every request priced at several times its cost.
    m = C.CostModel(verify=[(8, 0.023), (16, 0.033), (32, 0.037), (64, 0.064)], draft=[(1, 0.004)])
    real = {8: 0.023, 12: 0.0245, 16: 0.026, 24: 0.031, 32: 0.037}  # ~0.6 ms a token from 8 to 32
    for i in range(400):
        n = list(real)[i % len(real)]
        m.observe_verify(n, real[n])
    for n, t in real.items():
        assert m.verify_time(n) == pytest.approx(t, rel=0.12), n
    assert m.verify_time(16) - m.verify_time(8) < 0.5 * (0.033 - 0.023)  # no longer a cliff
    given = C.CostModel.from_dict({"verify": [[8, 0.023], [16, 0.033]], "draft": [[1, 0.004]]}, given=True)
    for _ in range(50):
        given.observe_verify(16, 0.026)
    assert given.shape_verify == [1.0, 1.0]  # a table the user set keeps its shape (the scale still learns)


def test_online_corrections_follow_observed_times_but_clamp_outliers():
    m = C.CostModel(verify=[(1, 0.1), (100, 0.1)], draft=[(1, 0.01)], ema=0.5, learn_shape=False)
    m.observe_verify(10, 0.2)
    assert m.scale_verify == pytest.approx(1.5)
    m.observe_verify(10, 100.0)  # a stall: clamped to 4x before averaging
    assert m.scale_verify == pytest.approx(0.5 * 1.5 + 0.5 * 6.0)


def test_calibrator_starts_pessimistic_and_learns_from_the_first_position_outwards():
    cal = K.Calibrator(num_positions=3, prior_strength=4, prior_acceptance=0.1, bin_prior=10, memory=0)
    conf = np.array([[0.9, 0.9, 0.9]])
    # Nothing measured: the head's 0.9 is not believed; every position assumes the prior's 0.1.
    np.testing.assert_allclose(cal.levels()[0], [0.1, 0.1, 0.1])
    np.testing.assert_allclose(cal.calibrate(conf, np.array([False]))[0], [0.1, 0.1, 0.1])
    assert B.survival(cal.calibrate(conf, np.array([False])))[0, -1] == pytest.approx(1e-3)
    # Accepted drafts raise the levels of the positions they reached, and positions beyond follow.
    for _ in range(4):
        cal.observe([0.9, 0.9, 0.9], verified=2, accepted=2, sampled=False)
    lv = cal.levels()[0]
    assert lv[0] == pytest.approx((4 + 4 * 0.1) / 8)
    assert lv[1] == pytest.approx((4 + 4 * lv[0]) / 8) and lv[2] == pytest.approx(lv[1])
    assert cal.levels()[1][0] == pytest.approx(0.1)  # sampled requests prove themselves separately


def test_calibrator_learns_a_miscalibrated_head():
    cal = K.Calibrator(num_positions=3, prior_strength=4, bin_prior=10, memory=0)
    for _ in range(200):  # the head says 0.9, the target accepts position 0 only half the time
        cal.observe([0.9, 0.9, 0.9], verified=3, accepted=0, sampled=False)
        cal.observe([0.9, 0.9, 0.9], verified=3, accepted=3, sampled=False)
    got = cal.calibrate(np.array([[0.9, 0.9, 0.9]]), np.array([False]))[0]
    assert got[0] == pytest.approx(0.5, abs=0.01)
    assert got[1] > 0.95  # once position 0 is accepted, the rest always were
    t = cal.table()
    assert t["count"][0] == 400 and t["measured"][0] == pytest.approx(0.5)
    # One bin (0.9) pools all positions: measured (200 + 400) / 800.
    assert t["predicted"][0] == pytest.approx(0.9) and t["ece"] == pytest.approx(0.9 - 0.75)


def test_the_head_ranks_slots_within_a_position():
    cal = K.Calibrator(num_positions=1, prior_strength=4, memory=0)
    rng = np.random.default_rng(0)
    for _ in range(300):  # confidence 0.8 accepted 80 % of the time, 0.2 accepted 20 %
        c = float(rng.choice([0.2, 0.8]))
        cal.observe([c], verified=1, accepted=int(rng.random() < c), sampled=False)
    lo, hi = cal.calibrate(np.array([[0.2], [0.8]]), np.array([False, False]))[:, 0]
    assert lo == pytest.approx(0.2, abs=0.08) and hi == pytest.approx(0.8, abs=0.08)


def test_calibrator_forgets_old_evidence():
    cal = K.Calibrator(num_positions=1, prior_strength=4, memory=50)
    for _ in range(500):
        cal.observe([0.9], verified=1, accepted=1, sampled=False)
    assert cal.levels()[0, 0] > 0.9
    for _ in range(100):  # the workload changed: now never accepted
        cal.observe([0.9], verified=1, accepted=0, sampled=False)
    assert cal.levels()[0, 0] < 0.2
    assert cal.table()["count"][0] == 600  # the report keeps every observation


def test_calibrator_tables_are_recomputed_after_every_change():
    """The levels, the optimistic bound and the calibrated values are kept between changes of the
    tables; each observe and seed must drop them (a stale copy would keep vouching for old evidence)."""
    cal = K.Calibrator(num_positions=2, prior_strength=4)
    conf, greedy = np.array([[0.8, 0.8]]), np.zeros(1, dtype=bool)
    before = (cal.levels().copy(), cal.levels_optimistic().copy(), cal.calibrate(conf, greedy))
    assert not cal.levels().flags.writeable  # shared with callers, so read-only
    cal.observe([0.8, 0.8], verified=2, accepted=0, sampled=False)
    after = (cal.levels(), cal.levels_optimistic(), cal.calibrate(conf, greedy))
    for old, new in zip(before, after, strict=True):
        assert np.all(new[0] < old[0]), (old, new)
    fresh = K.Calibrator(num_positions=2, prior_strength=4)
    fresh.observe([0.8, 0.8], verified=2, accepted=0, sampled=False)
    np.testing.assert_array_equal(fresh.levels(), cal.levels())  # what a calibrator never cached says
    seeded = cal.levels().copy()
    cal.seed(np.full((2, 10), 40.0), np.full((2, 10), 40.0), np.full((2, 10), 32.0))  # a seed of acceptances
    assert np.all(cal.levels()[0] > seeded[0])


def _random_verdicts(rng, most: int) -> list:
    """Fewer than ``most`` requests' verdicts of a step: greedy and sampled mixed, empty and fully accepted."""
    items = []
    for _ in range(int(rng.integers(0, most))):
        verified = int(rng.integers(0, 8))
        accepted = int(rng.integers(0, verified + 1))
        items.append((rng.random(7).tolist(), verified, accepted, bool(rng.random() < 0.3)))
    return items


def test_a_steps_verdicts_at_once_leave_the_tables_as_one_by_one():
    """``observe_many`` (the budget's feedback, a step at a time) must fade and count exactly as ``observe``
    called per request in turn: greedy and sampled mixed, empty and fully accepted drafts, a short memory."""
    rng = np.random.default_rng(0)
    one, many = K.Calibrator(num_positions=7, memory=50.0), K.Calibrator(num_positions=7, memory=50.0)
    for _ in range(200):
        items = _random_verdicts(rng, 9)
        for it in items:
            one.observe(*it)
        many.observe_many(items)
    for name in ("hits", "counts", "pred_sum", "total_hits", "total_counts", "total_pred"):
        np.testing.assert_allclose(getattr(many, name), getattr(one, name), rtol=1e-10, atol=1e-12, err_msg=name)
    assert one.total_counts.sum() > 1000  # the walk verified enough to test something
    np.testing.assert_allclose(many.levels(), one.levels(), rtol=1e-10)


def test_optimistic_levels_shrink_with_evidence():
    cal = K.Calibrator(num_positions=3)
    np.testing.assert_allclose(cal.levels_optimistic()[0], [1.0, 1.0, 1.0])  # nothing measured: could be anything
    for n in (4, 16, 64):
        while cal.counts[0, 0].sum() < n:
            cal.observe([0.9, 0.9, 0.9], verified=3, accepted=0, sampled=False)
        ucb = cal.levels_optimistic()[0]
        assert ucb[0] < {4: 0.5, 16: 0.2, 64: 0.06}[n], (n, ucb)
        assert ucb[2] <= ucb[1] <= ucb[0]  # a position nothing reached is no better than the one before


def test_cache_round_trip(tmp_path):
    m = C.CostModel(verify=[(1, 0.1), (8, 0.2)], draft=[(1, 0.01), (4, 0.02)])
    C.save_cached(tmp_path / "c.json", m)
    got = C.load_cached(tmp_path / "c.json")
    assert got.verify == m.verify and got.draft == m.draft
    (tmp_path / "bad.json").write_text("{")
    assert C.load_cached(tmp_path / "bad.json") is None


# ------------------------------------------------------------------ the policy, simulated
def cpu_costs():
    """This machine's float32 record of the default pair, extended linearly: 85 ms to decode, 158 ms to
    verify 8 tokens at batch 1 (about 10 ms per token, compute-bound); drafter 12 ms + 4 ms a request."""
    return C.CostModel(verify=[(1, 0.085), (8, 0.158), (512, 0.085 + 511 * 0.0104)],
                       draft=[(1, 0.012), (64, 0.012 + 63 * 0.004)])


def gpu_costs():
    """Verifying is nearly free (the test pairs, a GPU at small batch): 30 ms a step, 2-4 ms of drafting."""
    return C.CostModel(verify=[(1, 0.030), (256, 0.031), (512, 0.06)], draft=[(1, 0.002), (64, 0.004)])


def simulate(costs, r, steps, alpha, conf=0.9, *, fixed=None, seed=0, switch=(), trust=None):
    """Run the policy against a drafter whose every draft is accepted with probability ``alpha`` (given the
    ones before it), its head saying ``conf`` (a number, or "informative": 0.8 +- noise). Step times come
    from ``costs``: a skipped step costs a decode step, a drafting step or a probe adds the drafter and
    the verified tokens (a probe is charged the whole drafter). Output is counted in expected tokens
    (less noise than the draws, which only feed the policy). ``switch``: ``(step, alpha)`` changes.

    Returns (tokens per second, [(mode, drafts verified)] per step, the policy).
    """
    rng = np.random.default_rng(seed)
    pol = B.BudgetPolicy(7, trust, costs=costs)
    n, t, out, prev, kind, log = 7, 0.0, 0.0, [], "skip", []
    changes = dict(switch)
    for step in range(steps):
        alpha = changes.get(step, alpha)
        results = []
        for c, k in prev:
            acc = 0
            while acc < k and rng.random() < alpha:
                acc += 1
            results.append((c, k, acc, False))
            out += sum(alpha ** j for j in range(1, k + 1))
        if fixed is None:
            pol.feedback(kind, results)
        caps, sampled = [n] * r, np.zeros(r, dtype=bool)
        plan = (B.DRAFT if fixed else B.SKIP) if fixed is not None else pol.plan(caps, sampled)
        c = (np.full((r, n), conf) if conf != "informative"
             else np.clip(rng.normal(0.8, 0.05, (r, n)), 0.0, 1.0))
        if plan.mode == "skip":
            kept = [0] * r
        elif plan.mode == "probe":
            kept = pol.probe_kept(plan, caps)
        else:
            kept = [fixed] * r if fixed is not None else pol.choose(c, caps, sampled).kept
        t += float(costs.verify_time(r + sum(kept))) + (costs.draft_time(r) if plan.mode != "skip" else 0.0)
        out += r
        prev = [(c[i].tolist(), kept[i]) for i in range(r) if kept[i] > 0]
        kind = plan.mode
        log.append((plan.mode, sum(kept)))
    return out / t, log, pol


def plain_rate(costs, r):
    return r / float(costs.verify_time(r))


def best_fixed(costs, r, steps, alpha):
    return max(simulate(costs, r, steps, alpha, fixed=k)[0] for k in range(8))


@pytest.mark.parametrize("costs", [cpu_costs, gpu_costs])
@pytest.mark.parametrize("r", [1, 32])
def test_a_confidently_wrong_drafter_costs_at_most_3_percent_from_the_first_seconds(costs, r):
    costs = costs()
    steps = int(10.0 / float(costs.verify_time(r)))  # the first 10 seconds
    rate, log, pol = simulate(costs, r, steps, alpha=0.0, conf=0.9)
    assert rate >= 0.97 * plain_rate(costs, r), (rate / plain_rate(costs, r), pol.report())
    assert sum(k for _, k in log) <= 4 * pol.trust.probe_requests * pol.trust.probe_tokens + 7 * r, pol.report()
    probes = [i for i, (m, _) in enumerate(log) if m == "probe"]
    gaps = np.diff(probes)
    # Re-probes back off; a look after STALE_STEPS unmeasured steps (the evidence softened) starts afresh.
    assert all(b >= 2 * a or b >= B.STALE_STEPS or a >= B.STALE_STEPS for a, b in zip(gaps, gaps[1:])), probes
    assert pol.state in ("waiting", "blocked")


@pytest.mark.parametrize("costs, r", [(gpu_costs, 1), (gpu_costs, 8), (gpu_costs, 32), (cpu_costs, 1)])
def test_an_accepted_drafter_is_admitted_within_a_few_steps_and_keeps_its_gain(costs, r):
    costs = costs()
    for seed in range(3):
        rate, log, pol = simulate(costs, r, 300, alpha=0.8, conf="informative", seed=seed)
        first = next(i for i, (m, k) in enumerate(log) if m == "draft" and k > 0)
        assert first <= 10, (seed, log[:12])
        assert rate >= 0.95 * best_fixed(costs, r, 300, 0.8), (seed, pol.report())


@pytest.mark.parametrize("costs, r", [(cpu_costs, 1), (gpu_costs, 8)])
def test_a_drafter_put_out_of_use_is_looked_at_again_when_the_workload_changes(costs, r):
    """Hundreds of rejections shut the drafter's upper bound, so no probe would measure it again; when it
    has gone unmeasured for STALE_STEPS its evidence is softened and a probe looks. Here the workload
    turns easy after 1,500 steps: it drafts again within STALE_STEPS and a few probes."""
    switch = 1500
    rate, log, pol = simulate(costs(), r, switch + 2 * B.STALE_STEPS, alpha=0.02, conf="informative",
                              switch=[(switch, 0.8)])
    assert pol.counters["softened"] >= 1, pol.report()
    late = [m for m, k in log[switch - 300:switch] if m != "skip"]
    assert len(late) <= 12, late  # before the change: out of use, a look now and then
    drafting = [i for i, (m, k) in enumerate(log[switch:]) if m == "draft" and k > 0]
    assert drafting and drafting[0] <= B.STALE_STEPS + 40, (drafting[:5], pol.report())
    assert len(drafting) >= B.STALE_STEPS // 2  # and keeps drafting


@pytest.mark.parametrize("r", [1, 8, 32])
def test_a_run_of_rejections_stops_admitting_within_a_few_steps(r):
    rate, log, pol = simulate(gpu_costs(), r, 400, alpha=0.9, conf="informative", switch=[(200, 0.0)])
    assert sum(k for m, k in log[150:200] if m == "draft") > 0  # it was drafting
    admitting = [i for i, (m, k) in enumerate(log[200:]) if m == "draft" and k > 0]
    assert len(admitting) <= 3 and all(i <= 3 for i in admitting), admitting
    probes = [i for i, (m, _) in enumerate(log[200:]) if m == "probe"]
    assert len(probes) <= 9 and np.all(np.diff(probes) >= 2), probes  # re-probes are rare, with backoff
    assert pol.counters["stops"] >= 1 or pol.state == "waiting"


def test_a_stopped_drafter_is_readmitted_once_a_probe_is_accepted():
    rate, log, pol = simulate(gpu_costs(), 1, 400, alpha=0.9, conf="informative",
                              switch=[(100, 0.0), (160, 0.9)])
    assert not any(m == "draft" and k > 0 for m, k in log[110:160])
    back = next(i for i, (m, k) in enumerate(log[160:]) if m == "draft" and k > 0)
    assert back <= 70, back  # the next probe (after a backed-off wait) is accepted, drafting resumes
    assert pol.counters["unblocks"] >= 1 or pol.counters["probes_accepted"] >= 1


def test_no_probe_when_not_even_an_always_accepted_drafter_could_pay():
    never = C.CostModel(verify=[(1, 0.01), (512, 5.12)], draft=[(1, 1.0), (64, 1.0)])
    for r in (1, 16):
        rate, log, pol = simulate(never, r, 100, alpha=1.0)
        assert all(m == "skip" for m, _ in log), log[:10]
        assert pol.counters["probes"] == 0


def test_probes_rotate_over_the_requests_within_their_caps():
    pol = B.BudgetPolicy(7, costs=cpu_costs())
    caps, sampled = [7, 0, 7, 1, 7, 7], np.zeros(6, dtype=bool)
    plan = pol.plan(caps, sampled)
    assert plan == B.Plan("probe", (0, 2, 3, 4), 2)  # request 1 is gated; 4 requests per probe
    assert pol.probe_kept(plan, caps) == [2, 0, 2, 1, 2, 0]
    pol.feedback("probe", [([0.9] * 7, k, k, False) for k in (2, 2, 1, 2)])  # accepted, but not yet enough
    assert pol.plan(caps, sampled).rows == (0, 2, 3, 5)  # the next four, wrapping around
    pol.feedback("probe", [([0.9] * 7, k, 0, False) for k in (2, 2, 1, 2)])
    assert pol.plan(caps, sampled) == B.SKIP and pol.rhythm.period == 2  # rejected: the wait doubled
    assert B.Plan.from_wire(plan.to_wire()) == plan


def test_a_mode_nothing_has_measured_is_probed_when_it_joins():
    pol = B.BudgetPolicy(7, costs=cpu_costs())
    caps, greedy = [7] * 4, np.zeros(4, dtype=bool)
    for _ in range(60):  # greedy probes, every one rejected: the shared wait grows
        plan = pol.plan(caps, greedy)
        kept = pol.probe_kept(plan, caps) if plan.mode == "probe" else []
        pol.feedback(plan.mode, [([0.9] * 7, k, 0, False) for k in kept if k])
    assert pol.rhythm.period >= 16 and pol.rhythm.wait > 1, pol.report()
    assert pol.plan(caps, greedy) == B.SKIP  # greedy requests alone keep waiting
    caps6, mixed = [7] * 6, np.array([False, True, False, False, True, False])  # two sampled requests join
    assert not pol.calibrator.measured(True)
    plan = pol.plan(caps6, mixed)
    assert plan.mode == "probe" and {1, 4} <= set(plan.rows), (plan, pol.report())
    kept = pol.probe_kept(plan, caps6)
    pol.feedback("probe", [([0.9] * 7, k, 0, bool(mixed[i])) for i, k in enumerate(kept) if k])
    assert pol.calibrator.measured(True)
    assert pol.plan(caps6, mixed) == B.SKIP  # measured now: the sampled requests wait like the others
    lv = pol.calibrator.levels()[:, 0]
    assert lv[1] < pol.trust.prior_acceptance and lv[1] > lv[0], lv  # its own two rejections, not greedy's


def test_a_batch_that_starts_with_one_request_keeps_its_probes_when_the_rest_arrive():
    # vLLM's engine core may step on a batch's first request before the others arrive. The probe burst
    # holds at the batch's size that follows: here a probe of four requests costs 5x one of one request.
    costs = C.CostModel(verify=[(1, 0.0057), (64, 0.0062)], draft=[(1, 0.001), (4, 0.006), (8, 0.006)])
    pol = B.BudgetPolicy(7, costs=costs)
    plan = pol.plan([7], np.zeros(1, dtype=bool))
    assert plan.mode == "probe" and plan.rows == (0,)
    pol.feedback("probe", [([0.5] * 7, 2, 0, False)])  # rejected at its first draft
    caps, greedy = [7] * 4, np.zeros(4, dtype=bool)
    plan = pol.plan(caps, greedy)  # the batch grew 4x: look again now, with the credit left
    assert plan.mode == "probe" and len(plan.rows) == 4, (plan, pol.report())


def test_a_stale_cached_profile_is_profiled_again_and_can_be_dropped(tmp_path):
    from vllm_dspark.spec_decode.common import profile as P

    cached = C.CostModel(verify=[(1, 0.001), (8, 0.002)], draft=[(1, 0.0005), (4, 0.001)])
    assert P.judge_spot_check(cached, {"verify_1": 0.0012, "draft_1": 0.0004}) is None
    why = P.judge_spot_check(cached, {"verify_1": 0.0004, "draft_1": 0.0005})  # 2.5x faster than cached
    assert why and "verify_1" in why
    assert P.judge_spot_check(cached, {"verify_1": 0.001, "draft_1": 0.0011})  # the drafter 2.2x slower
    f = tmp_path / "c.json"
    f.write_text("{}")
    assert P.drop_cached(f) and not f.exists() and not P.drop_cached(f) and not P.drop_cached(None)


def test_a_loaded_profile_starts_from_what_the_spot_check_measured():
    """Within the spot check's tolerance a cached profile is kept, and its corrections start where the
    spot check found the machine: a drafter cached 1.8x too slow is priced at its current cost at once."""
    from vllm_dspark.spec_decode.common import profile as P

    cached = C.CostModel(verify=[(1, 0.020), (8, 0.024)], draft=[(1, 0.009), (4, 0.012)])
    spot = {"verify_1": 0.022, "draft_1": 0.005}
    assert P.judge_spot_check(cached, spot) is None
    P.seed_scales(cached, spot)
    assert cached.verify_time(1) == pytest.approx(0.022) and cached.draft_time(1) == pytest.approx(0.005)
    assert cached.verify_time(8) == pytest.approx(0.024 * 1.1)  # the whole curve moves with its scale
    P.seed_scales(cached, {"verify_1": 1.0, "draft_1": 0.0})  # past the tolerance: clamped to it
    assert (cached.scale_verify, cached.scale_draft) == (P.SPOT_TOLERANCE, 1 / P.SPOT_TOLERANCE)


def test_a_verify_point_times_the_target_and_its_logits_without_the_drafter():
    """vLLM's dummy run also runs the drafter's dummy forward and scores one token a request: the verify
    curve came out flat up to 16 tokens. The point runs the target with the drafter's dummy run shadowed,
    scores every token, and leaves the drafter as it was."""
    import types

    import torch

    from vllm_dspark.spec_decode.common import profile as P

    calls: list = []

    class Drafter:
        def dummy_run(self, n, **kwargs):
            calls.append(("drafter", n))

    drafter = Drafter()

    def dummy_run(n, force_attention=False):
        drafter.dummy_run(n)  # as vLLM's _dummy_run does
        calls.append(("target", n, force_attention))
        hidden = torch.zeros(n, 3)
        return hidden, hidden[-1:]

    logits = types.SimpleNamespace(compute_logits=lambda h: calls.append(("logits", len(h))))
    runner = types.SimpleNamespace(drafter=drafter, _dummy_run=dummy_run, model=logits)
    P._verify_fn(types.SimpleNamespace(runner=runner), 8)()
    assert calls == [("target", 8, True), ("logits", 8)]
    assert "dummy_run" not in vars(drafter)  # the method again
    drafter.dummy_run(1)
    assert calls[-1] == ("drafter", 1)


def test_a_load_change_starts_the_backoff_afresh():
    # Probes rejected at batch 8 doubled the wait to its longest; at batch 1 the drafter looks at once and
    # backs off from the shortest period again (the evidence for the long wait was another load's).
    p = B.BudgetPolicy(7, B.TrustConfig(probe_max_period=256), costs=linear(per_token=0.0002, fixed=0.01, d=0.001))
    for _ in range(10):
        p.rhythm.rejected()
    p.wait_batch = 8
    assert p.rhythm.period == 256
    plan = p.plan([7], np.zeros(1, bool))
    assert plan.mode is B.PlanMode.PROBE and p.rhythm.period == 1
    p.feedback(B.PlanMode.PROBE, [B.Feedback([0.9, 0.9], 2, 0, False)])  # rejected: the wait doubles from 1
    assert p.rhythm.period == 2


def _random_costs(rng) -> C.CostModel:
    sizes = sorted({1, *rng.integers(2, 80, size=4).tolist()})
    verify = [(n, 0.02 + 0.002 * n + float(rng.random()) * 0.003) for n in sizes]
    return C.CostModel(verify=verify, draft=[(1, 0.004), (8, 0.006 + float(rng.random()) * 0.004)])


def test_a_few_slots_allocate_in_plain_floats_exactly_as_the_arrays_do(monkeypatch):
    """The small-batch path (``SMALL`` slots or fewer) must give the array path's allocation to the bit:
    ties, caps past N, zero caps, an empty batch, prefill tokens beside and a source's own cost."""
    rng = np.random.default_rng(7)
    cases = []
    for _ in range(300):
        r, n = int(rng.integers(0, 9)), int(rng.integers(1, 8))  # past SMALL too: the path is forced below
        surv = np.round(rng.random((r, n)), int(rng.integers(1, 4)))  # rounded: equal values, ties to break
        caps = rng.integers(0, n + 3, size=r).tolist()
        cases.append((surv, caps, _random_costs(rng), int(rng.integers(0, 5)), float(rng.random()) * 0.01))
    monkeypatch.setattr(B, "SMALL", 10**6)  # every case in plain floats
    small = [B.allocate(s, c, m, extra_tokens=e, source_cost=sc) for s, c, m, e, sc in cases]
    monkeypatch.setattr(B, "SMALL", -1)  # every case through the arrays
    arrays = [B.allocate(s, c, m, extra_tokens=e, source_cost=sc) for s, c, m, e, sc in cases]
    assert small == arrays
    assert sum(sum(a.kept) for a in small) > 100 and any(a.draft_pays for a in small)


def test_few_verdicts_and_slots_calibrate_in_plain_floats_exactly_as_the_arrays_do(monkeypatch):
    rng = np.random.default_rng(3)
    fast, slow = K.Calibrator(num_positions=7, memory=300.0), K.Calibrator(num_positions=7, memory=300.0)
    steps = []
    for _ in range(120):
        items = _random_verdicts(rng, 6)
        steps.append(items)
    monkeypatch.setattr(K, "SMALL_VERDICTS", 10**6)  # every step's verdicts in plain floats
    for items in steps:
        fast.observe_many(items)
    monkeypatch.setattr(K, "SMALL_VERDICTS", -1)  # every step's through np.bincount
    for items in steps:
        slow.observe_many(items)
    for name in ("hits", "counts", "pred_sum", "total_hits", "total_counts", "total_pred"):
        assert np.array_equal(getattr(fast, name), getattr(slow, name)), name
    for r in (1, 3, 8):
        conf = rng.random((r, 7))
        conf[0, :2] = (0.0, 1.0)  # the bins' edges
        sampled = rng.random(r) < 0.4
        assert np.array_equal(fast.calibrate_small(conf, sampled), fast.calibrate_arrays(conf, sampled))
    assert fast.total_counts.sum() > 300


def test_the_plain_float_lists_are_the_tables_numbers_whichever_is_asked_first():
    """``_memo_lists`` (mean confidences and levels from one sum of each table, filling the levels' memo)
    must equal :meth:`_mean_pred` and :meth:`_levels` to the bit, asked before or after ``levels()``."""
    rng = np.random.default_rng(11)
    cal = K.Calibrator(num_positions=7, memory=80.0)
    cal.seed(rng.random((7, 10)) * 5, rng.random((7, 10)) * 5 + 5, rng.random((7, 10)) * 5)
    for step in range(60):
        cal.observe_many(_random_verdicts(rng, 4))
        if step % 2:
            cal.levels()  # the levels' memo first: the lists take it
        mean, levels = cal._memo_lists()
        assert mean == cal._mean_pred().tolist() and levels == cal._levels().tolist()
        assert np.array_equal(cal.levels(), cal._levels())


def test_a_batch_1_step_takes_the_plain_float_paths(monkeypatch):
    """Batch 1 (7 slots) is what the small paths are for: prove they run there, and not at batch 8."""
    calls = {"allocate": 0, "calibrate": 0}
    small_alloc, small_cal = B._allocate_small, K.Calibrator.calibrate_small

    def alloc_spy(*a, **k):
        calls["allocate"] += 1
        return small_alloc(*a, **k)

    def cal_spy(self, *a, **k):
        calls["calibrate"] += 1
        return small_cal(self, *a, **k)

    monkeypatch.setattr(B, "_allocate_small", alloc_spy)
    monkeypatch.setattr(K.Calibrator, "calibrate_small", cal_spy)
    costs, cal = _random_costs(np.random.default_rng(1)), K.Calibrator(num_positions=7)
    B.allocate(np.full((1, 7), 0.5), [7], costs)
    cal.calibrate(np.full((1, 7), 0.5), np.zeros(1, dtype=bool))
    assert calls == {"allocate": 1, "calibrate": 1}
    B.allocate(np.full((8, 7), 0.5), [7] * 8, costs)
    cal.calibrate(np.full((8, 7), 0.5), np.zeros(8, dtype=bool))
    assert calls == {"allocate": 1, "calibrate": 1}
