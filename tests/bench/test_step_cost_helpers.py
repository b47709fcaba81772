"""The step-cost benchmark's pure helpers (the benchmark itself is a script, not a test)."""

import math

from benchmarks.harness.step_common import classify_op
from benchmarks.harness.step_cost import interleaved
from benchmarks.harness.step_cost_report import linear_slope, ratio_summary, spread_allows, summarize
from benchmarks.harness.step_engine import step_phases


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


def test_cell_groups_pair_each_goal_with_its_floor():
    from benchmarks.harness.step_cost import cell_groups

    groups = cell_groups([1], [0, 7], [1, 8])
    assert groups[:2] == [[("plain", 1, 0), ("spec", 1, 0), ("floor", 1, 1)], [("spec", 1, 7), ("floor", 1, 8)]]
    # Every cell runs exactly once per repeat: the paired ones and, alone, the floor's F.linear reference.
    assert sorted(c for g in groups for c in g) == sorted(
        [("plain", 1, 0), ("spec", 1, 0), ("spec", 1, 7), ("floor", 1, 1), ("floor", 1, 8), ("floor_linear", 1, 1),
         ("floor_linear", 1, 8)])
    assert [g for g in groups if len(g) == 1] == [[("floor_linear", 1, 1)], [("floor_linear", 1, 8)]]
    # Without a no-draft cell the plain decode cell is still paired with the 1-token floor.
    assert [("plain", 2, 0), ("floor", 2, 1)] in cell_groups([2], [3], [1, 4, 8])


class _FakeWorker:
    """A worker whose steps take the given seconds; it logs every call."""

    def __init__(self, name, dt, log):
        self.name, self.dt, self.log, self.open = name, dt, log, False

    def call(self, cmd, **kw):
        self.log.append((self.name, cmd))
        if cmd == "open_cell":
            self.open = True
            return None
        if cmd == "step_cell":
            assert self.open
            return self.dt
        assert cmd == "close_cell"
        self.open = False
        return {"name": self.name, "steps": sum(1 for n, c in self.log if n == self.name and c == "step_cell")}


def test_lockstep_steps_every_cell_each_round_in_alternating_order():
    import pytest

    from benchmarks.harness.step_cost import run_lockstep

    log: list = []
    fast, slow = _FakeWorker("fast", 1 / 64, log), _FakeWorker("slow", 1 / 16, log)  # exact in binary
    res, rounds = run_lockstep([(fast, {}), (slow, {})], min_seconds=0.125, min_steps=3)
    # The fast cell needs 8 steps for its 0.125 s: both cells run 8 rounds, not the slow one's 3.
    assert rounds == 8 and [r["steps"] for r in res] == [8, 8]
    steps = [n for n, c in log if c == "step_cell"]
    assert steps[:4] == ["fast", "slow", "slow", "fast"]
    assert not fast.open and not slow.open
    with pytest.raises(ValueError, match="one cell per worker"):
        run_lockstep([(fast, {}), (fast, {})], 0.1, 1)


def test_lockstep_closes_the_opened_cells_when_a_step_fails():
    import pytest

    from benchmarks.harness.step_cost import run_lockstep

    log: list = []
    ok = _FakeWorker("ok", 0.01, log)

    class Broken(_FakeWorker):
        def call(self, cmd, **kw):
            if cmd == "step_cell":
                raise RuntimeError("step failed")
            return super().call(cmd, **kw)

    bad = Broken("bad", 0.01, log)
    with pytest.raises(RuntimeError, match="step failed"):
        run_lockstep([(ok, {}), (bad, {})], 0.1, 1)
    assert not ok.open and not bad.open


def test_run_until_counts_only_steps_of_the_cells_shape():
    from benchmarks.harness.step_common import run_until

    seq = iter([0.0, 0.2, 0.0, 0.2, 0.2])
    assert run_until(lambda: next(seq), min_seconds=0.3, min_steps=2, max_steps=10) == 4
    assert run_until(lambda: 0.0, min_seconds=0.3, min_steps=2, max_steps=7) == 7


def test_position_bias_compares_even_and_odd_rounds():
    from benchmarks.harness.step_cost_report import position_bias

    assert position_bias([9.0, 2.0, 1.0, 2.0, 1.0]) == 0.5  # the first step is left out
    assert math.isnan(position_bias([1.0, 2.0]))


def test_lockstep_pauses_before_every_step():
    import time

    from benchmarks.harness.step_cost import run_lockstep

    log: list = []
    w = _FakeWorker("w", 1.0, log)
    t0 = time.perf_counter()
    _, rounds = run_lockstep([(w, {})], min_seconds=3.0, min_steps=1, gap_s=0.02)
    assert rounds == 3 and time.perf_counter() - t0 >= 0.06


def test_pair_order_names_each_engine_and_the_floor_once():
    import pytest

    from benchmarks.harness.step_common import EngineSpec
    from benchmarks.harness.step_worker import PairServer

    for order in (("plain",), ("plain", "plain"), ("plain", "spec", "floor", "floor"), ("plain", "spec", "hf"),
                  ("plain", "spec")):
        with pytest.raises(ValueError, match="order must name"):
            PairServer(EngineSpec("pair", "/nonexistent", None, "bfloat16", order=order))
