"""Rank-consistent decisions, without an engine: two "ranks" as threads, collectives as a barrier.

A dummy run under tensor parallelism is a collective: every rank must enter it.
Here each rank's dummy run waits at a shared barrier, so a rank that profiles
while the other loads a cache makes the barrier time out: the hang of a real
TP engine, as a test failure. With :class:`Consensus` the ranks agree first.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import types

import pytest

from vllm_dspark.spec_decode.common import costs as C
from vllm_dspark.spec_decode.common import profile as P
from vllm_dspark.spec_decode.common.consensus import Consensus, divergence_for_rank
from vllm_dspark.spec_decode.v1.step_inputs import unseeded_draft_seed as _unseeded_draft_seed

CACHED = {"verify": [[1, 0.001], [8, 0.002]], "draft": [[1, 0.0005], [4, 0.001]], "source": "x"}


class FakeGroup:
    """The part of vLLM's GroupCoordinator that Consensus uses, for ranks that are threads."""

    def __init__(self, rank: int, boxes: list[queue.Queue]):
        self.rank_in_group, self.world_size, self._boxes = rank, len(boxes), boxes

    def broadcast_object(self, obj=None, src: int = 0):
        if self.rank_in_group == src:
            for r, box in enumerate(self._boxes):
                if r != src:
                    box.put(obj)
            return obj
        return self._boxes[self.rank_in_group].get(timeout=10)


class FakeProposer:
    """What profile_or_load touches; every dummy run is a collective (the shared barrier)."""

    def __init__(self, barrier: threading.Barrier, first_run_s: float = 0.0):
        self.barrier = barrier
        self.first_run_s = first_run_s  # how long this rank's first dummy run takes
        self.dummy_runs = 0
        # What the real profile() reads: profile sizes 1, 2, 4 tokens and 1, 2 requests.
        self.vllm_config = types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(max_num_seqs=2, max_num_batched_tokens=4))
        self.block = 1
        self.profile_info = None
        self.settings = types.SimpleNamespace(profile_cache="on")  # the cache path itself is patched below

    def collective(self):
        self.dummy_runs += 1
        self.barrier.wait()
        if self.dummy_runs == 1 and self.first_run_s:
            time.sleep(self.first_run_s)  # rank-local work after the run's last collective


def _two_ranks(monkeypatch, tmp_path, cached_on: set[int], consensus: bool, hooks=({}, {}),
               real_profile: bool = False, first_run_s=(0.0, 0.0)):
    barrier = threading.Barrier(2, timeout=3)
    boxes = [queue.Queue(), queue.Queue()]
    proposers = [FakeProposer(barrier, first_run_s[0]), FakeProposer(barrier, first_run_s[1])]
    for r in (0, 1):
        d = tmp_path / f"rank{r}"
        d.mkdir()
        if r in cached_on:
            (d / "costs.json").write_text(json.dumps(CACHED))
        proposers[r].cache = d / "costs.json"
    monkeypatch.setattr(P, "cache_path", lambda p: p.cache)
    monkeypatch.setattr(P, "_verify_fn", lambda p, n: p.collective)
    monkeypatch.setattr(P, "_draft_fn", lambda p, r: p.collective)
    if not real_profile:
        monkeypatch.setattr(P, "profile", lambda p, draft_scale=1.0, consensus=None: _fake_profile(p, draft_scale))
    monkeypatch.setattr(P, "SPOT_TOLERANCE", 1e9)  # the fake runs' times say nothing about the cache
    results: dict = {}

    def rank(r):
        cons = Consensus(FakeGroup(r, boxes)) if consensus else Consensus(types.SimpleNamespace(world_size=1))
        try:
            results[r] = P.profile_or_load(proposers[r], cons, hooks[r])
        except threading.BrokenBarrierError as exc:
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results, proposers


def _fake_profile(p, scale):
    for _ in range(3):  # a profile is a series of dummy runs on every rank
        p.collective()
    return C.CostModel(verify=[(1, 0.01), (8, 0.02)], draft=[(1, 0.005 * scale)])


def test_without_agreement_a_cache_on_one_rank_only_hangs_the_other(monkeypatch, tmp_path):
    results, _ = _two_ranks(monkeypatch, tmp_path, cached_on={1}, consensus=False)
    # Rank 0 profiles, rank 1 loads and spot-checks: their dummy runs no longer pair up, and one
    # rank is left waiting in a collective (a hang on a real engine, a broken barrier here).
    assert any(isinstance(results[r], threading.BrokenBarrierError) for r in (0, 1)), results


@pytest.mark.parametrize("cached_on, decision", [({1}, "profiled"), ({0}, "loaded"), ({0, 1}, "loaded"),
                                                 (set(), "profiled")])
def test_the_ranks_agree_on_loading_or_profiling(monkeypatch, tmp_path, cached_on, decision):
    results, proposers = _two_ranks(monkeypatch, tmp_path, cached_on=cached_on, consensus=True,
                                    hooks=({}, {"draft_time_scale": 1000.0}))
    models = [results[0], results[1]]
    assert all(isinstance(m, C.CostModel) for m in models), results
    # Rank 0's numbers everywhere (rank 1's drafter times were 1000x: the hook).
    assert (models[0].verify, models[0].draft) == (models[1].verify, models[1].draft)
    assert models[0].verify[0][1] == (0.001 if decision == "loaded" else 0.01)
    assert [p.profile_info["decision"] for p in proposers] == [decision, decision]
    assert [p.profile_info["local_cache_hit"] for p in proposers] == [0 in cached_on, 1 in cached_on]
    assert proposers[0].dummy_runs == proposers[1].dummy_runs > 0
    # Only the deciding rank writes the cache.
    assert (tmp_path / "rank0" / "costs.json").exists()
    assert (tmp_path / "rank1" / "costs.json").exists() == (1 in cached_on)


@pytest.mark.parametrize("consensus", [False, True])
def test_the_ranks_run_as_many_dummy_runs_when_one_ranks_first_run_is_long(monkeypatch, tmp_path, consensus):
    """The real profile(): a point whose first run takes PROFILE_LONG_S or more gets fewer runs.

    Rank 1's first dummy run is slow (a busy machine), rank 0's is not. Decided rank by rank,
    rank 1 runs fewer dummy runs at that point and rank 0 waits in a collective (the Ray TP=2
    test's intermittent start-up hang in CI); agreed, both run the same ones.
    """
    results, proposers = _two_ranks(monkeypatch, tmp_path, cached_on=set(), consensus=consensus,
                                    real_profile=True, first_run_s=(0.0, 1.5 * P.PROFILE_LONG_S))
    if not consensus:
        assert any(isinstance(results[r], threading.BrokenBarrierError) for r in (0, 1)), results
        return
    assert all(isinstance(results[r], C.CostModel) for r in (0, 1)), results
    assert proposers[0].dummy_runs == proposers[1].dummy_runs
    # 4 verify sizes (1 to 4 tokens) and 2 draft sizes, each an untimed run and PROFILE_REPS timed ones.
    assert proposers[0].dummy_runs == 6 * (1 + P.PROFILE_REPS)
    assert (results[0].verify, results[0].draft) == (results[1].verify, results[1].draft)


def test_decide_runs_only_on_the_deciding_rank():
    boxes = [queue.Queue(), queue.Queue()]
    calls = []
    c1 = Consensus(FakeGroup(1, boxes))
    c0 = Consensus(FakeGroup(0, boxes))
    assert c0.is_decider and not c1.is_decider and c1.world_size == 2
    assert c0.decide(lambda: calls.append(0) or "rank 0's") == "rank 0's"
    assert c1.decide(lambda: calls.append(1) or "rank 1's") == "rank 0's"
    assert calls == [0] and c1.broadcasts == 1
    single = Consensus(types.SimpleNamespace(world_size=1, rank_in_group=0))
    assert single.decide(lambda: 7) == 7 and single.broadcasts == 0  # one rank: nothing sent


def test_divergence_hook_names_one_rank(monkeypatch):
    monkeypatch.setenv("VLLM_DSPARK_TEST_DIVERGENCE", json.dumps({"rank": 1, "draft_time_scale": 5}))
    assert divergence_for_rank(0) == {} and divergence_for_rank(1)["draft_time_scale"] == 5
    monkeypatch.setenv("VLLM_DSPARK_TEST_DIVERGENCE", "{not json")
    assert divergence_for_rank(1) == {}


def test_divergence_hook_gives_each_listed_rank_its_share(monkeypatch):
    monkeypatch.setenv("VLLM_DSPARK_TEST_DIVERGENCE", json.dumps([{"rank": 0, "draft_time_scale": 0.5},
                                                                  {"rank": 1, "draft_time_scale": 5}]))
    assert divergence_for_rank(0)["draft_time_scale"] == 0.5 and divergence_for_rank(1)["draft_time_scale"] == 5
    assert divergence_for_rank(2) == {}


def test_unseeded_draft_seeds_are_a_function_of_request_and_position():
    a = _unseeded_draft_seed(0, "req-1", 17)
    assert a == _unseeded_draft_seed(0, "req-1", 17) and 0 <= a < 2 ** 62
    assert len({a, _unseeded_draft_seed(0, "req-1", 18), _unseeded_draft_seed(0, "req-2", 17),
                _unseeded_draft_seed(1, "req-1", 17)}) == 4
    assert a == 4235063154444373869  # the same in every process and on every rank (no salted hash)
