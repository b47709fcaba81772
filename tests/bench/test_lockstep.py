"""The lockstep benchmark: engines stepped in turn, the control's bracket, and a real run on the toy pair."""

import math
from types import SimpleNamespace

import pytest

from benchmarks.harness.e2e import EngineConfig, dspark_spec, toy_pair
from benchmarks.harness.lockstep import CONTROL, build_order, rotated, run_cell, run_lockstep, speedups


class FakeEngine:
    """An LLM whose engine finishes each request after ``steps_per_request`` steps of one token."""

    def __init__(self, name: str, calls: list, steps_per_request: int):
        self.name, self.calls, self.per = name, calls, steps_per_request
        self.left: dict[str, int] = {}
        self.resets = 0
        self.llm_engine = self

    def reset_prefix_cache(self):
        self.resets += 1

    def add_request(self, rid, prompt, params):
        self.left[rid] = self.per

    def has_unfinished_requests(self):
        return bool(self.left)

    def step(self):
        self.calls.append(self.name)
        out = []
        for rid in list(self.left):
            self.left[rid] -= 1
            if not self.left[rid]:
                del self.left[rid]
                out.append(SimpleNamespace(request_id=rid, finished=True,
                                           outputs=[SimpleNamespace(token_ids=[1] * self.per)]))
        return out


def test_engines_take_one_step_each_in_turn_until_their_requests_are_done():
    calls: list[str] = []
    engines = {"a": FakeEngine("a", calls, 3), "b": FakeEngine("b", calls, 2)}
    res = run_cell(engines, ["p0", "p1", "p2"], 2, None, ["b", "a"], "t")
    # Two waves (2 prompts, then 1): b, a alternate while both run; a finishes its wave alone.
    assert calls == ["b", "a", "b", "a", "a"] * 2
    assert res["a"]["steps"] == 6 and res["b"]["steps"] == 4
    assert res["a"]["tokens"] == 9 and res["b"]["tokens"] == 6
    assert res["a"]["outputs"] == [[1, 1, 1]] * 3  # prompt order, every request finished
    assert all(e.resets == 1 for e in engines.values())


class QueuedEngine(FakeEngine):
    """A FakeEngine whose scheduler runs at most ``max_num_active_reqs`` requests, admitting in order;
    odd-numbered requests take twice as many steps."""

    def __init__(self, *args):
        super().__init__(*args)
        self.max_num_active_reqs = 8
        self.engine_core = SimpleNamespace(engine_core=SimpleNamespace(scheduler=self))
        self.batches: list[int] = []
        self.length: dict[str, int] = {}

    def add_request(self, rid, prompt, params):
        self.left[rid] = self.length[rid] = self.per * (1 + int(rid.rsplit("-", 1)[1]) % 2)

    def step(self):
        running = list(self.left)[: self.max_num_active_reqs]
        self.batches.append(len(running))
        self.calls.append(self.name)
        out = []
        for rid in running:
            self.left[rid] -= 1
            if not self.left[rid]:
                del self.left[rid]
                out.append(SimpleNamespace(request_id=rid, finished=True,
                                           outputs=[SimpleNamespace(token_ids=[1] * self.length[rid])]))
        return out


def test_a_queued_cell_keeps_the_batch_full_while_the_queue_lasts():
    calls: list[str] = []
    eng = QueuedEngine("a", calls, 2)
    res = run_cell({"a": eng}, [f"p{i}" for i in range(5)], 2, None, ["a"], "t", queued=True)
    # Five requests (2, 4, 2, 4, 2 steps) queued at once, two running: a full batch until the queue is out.
    assert eng.batches == [2, 2, 2, 2, 2, 2, 1, 1] and res["a"]["tokens"] == 14
    assert eng.max_num_active_reqs == 8  # the engine's own limit is back after the cell
    waves = QueuedEngine("b", calls, 2)
    assert run_cell({"b": waves}, [f"p{i}" for i in range(5)], 2, None, ["b"], "t")["b"]["tokens"] == 14
    assert waves.batches == [2, 2, 1, 1, 2, 2, 1, 1, 1, 1]  # waves of 2: each waits for its longest request


def test_the_control_brackets_the_drafters_and_ngram_comes_last():
    cfgs = [EngineConfig("ngram", {"method": "ngram"}), EngineConfig("dspark", {"method": "dspark"}),
            EngineConfig("no-spec"), EngineConfig("fixed", {"method": "dspark"})]
    assert [c.name for c in build_order(cfgs)] == ["no-spec", "dspark", "fixed", CONTROL, "ngram"]
    built = build_order(cfgs)
    assert [c.name for c in rotated(built, 1)] == ["dspark", "fixed", CONTROL, "no-spec", "ngram"]
    assert [c.name for c in rotated(built, 4)] == [c.name for c in built]  # 4 bracketed engines: a full turn
    with pytest.raises(ValueError, match="needs the no-spec configuration"):
        build_order([EngineConfig("dspark")])
    with pytest.raises(ValueError, match="rename that configuration"):
        build_order([EngineConfig("no-spec"), EngineConfig(CONTROL)])


def test_speedups_are_against_both_controls_and_the_control_against_no_spec():
    rates = {"no-spec": [10.0, 20.0], CONTROL: [10.4, 20.8], "x": [9.0, 18.0]}
    s = speedups(rates)
    assert s[CONTROL] == pytest.approx([1.04, 1.04])
    assert s["x"] == pytest.approx([9.0 / math.sqrt(104.0), 18.0 / math.sqrt(416.0)])
    assert s["no-spec"] == pytest.approx([1 / math.sqrt(1.04)] * 2)


@pytest.mark.engine  # eight engines, built twice in this process
def test_lockstep_on_the_toy_pair_is_lossless_and_every_engine_stepped():
    pair = toy_pair(2)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    # n-gram loads numba: the second build must still start (patch kernel-scan-fake-dict).
    cfgs = [EngineConfig("no-spec"), EngineConfig("fixed-3", dspark_spec(pair.draft, 3, verification="fixed")),
            EngineConfig("ngram", ngram)]
    logs: list[str] = []
    rows = run_lockstep(pair, cfgs, pair.datasets, concurrencies=(2,), max_tokens=12, repeats=1, builds=2,
                        log=logs.append, share=True)
    by = {r["config"]: r for r in rows}
    assert list(by) == ["no-spec", "fixed-3", CONTROL, "ngram"]
    assert by["fixed-3"]["outputs"] == by["no-spec"]["outputs"] == by[CONTROL]["outputs"]  # float32, greedy
    assert by["ngram"]["outputs"] == by["no-spec"]["outputs"]
    assert all(len(r["repeats"]) == 2 and all(x > 0 for x in r["repeats"]) for r in rows)
    # Accepted drafts: the drafter's engine needed fewer steps for the same tokens.
    assert by["fixed-3"]["num_accepted_tokens"] > 0
    assert sum(by["fixed-3"]["lockstep"]["steps"]) < sum(by["no-spec"]["lockstep"]["steps"])
    assert by[CONTROL]["lockstep"]["against"] == "no-spec"
    # Two builds in rotated orders: the second one started with the drafter's engine.
    ups = [m for m in logs if "engine up" in m]
    assert [m.split("] [")[1].split("]")[0] for m in ups] == ["no-spec", "fixed-3", CONTROL, "ngram",
                                                               "fixed-3", CONTROL, "no-spec", "ngram"]
    assert len(by["fixed-3"]["lockstep"]["speedup_per_build"]) == 2
    # Every engine but the first-built read the first one's target weights, and the outputs above held.
    shared = [m for m in logs if "target weights" in m]
    assert len(shared) == 6 and all(int(m.split("(")[1].split()[0]) > 10 for m in shared), shared
    assert by["fixed-3"]["lockstep"]["shared_weights"] is True
    # Each build logs what the drafter's engine did in the cell: its drafts by source and the budget's state.
    cell_lines = [m for m in logs if "[fixed-3]" in m and "drafts/verified/accepted" in m]
    assert len(cell_lines) == 2 and all(" C=2: " in m and "; budget " in m for m in cell_lines), cell_lines
    logged = [m.split("accepted: dspark ")[1].split(";")[0].split("/") for m in cell_lines]
    row = by["fixed-3"]["dspark"]["stats"]["by_source"]["dspark"]
    assert [sum(int(x[i]) for x in logged) for i in range(3)] == [row["drafts"], row["verified"], row["accepted"]]


def test_a_set_smaller_than_its_cell_repeats_and_a_larger_one_is_cut():
    from benchmarks.harness.e2e import _cells

    cells = list(_cells({"copy": ["a", "b", "c"]}, [0.0], [1, 2], lambda c: 4 * c))
    assert [(c, "".join(p)) for _, _, c, p in cells] == [(1, "abca"), (2, "abcabcab")]
    assert list(_cells({"chat": list("abcdef")}, [0.0], [1], lambda c: 2))[0][3] == ["a", "b"]
