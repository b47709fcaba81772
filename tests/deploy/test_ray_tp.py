"""Tensor parallel 2 through vLLM's Ray executor on CPU, with the DSpark drafter.

A local Ray head (``ray start --head`` on 127.0.0.1, with the test-only
``vllm_dspark_cpu_test_slot`` resource standing in for GPUs) serves a tiny
Qwen3 target at tensor_parallel_size=2 through
``tests.deploy.ray_cpu.RayCpuTestExecutor``. Three engines, one start
each (module-scoped): Ray + DSpark, multiprocessing + DSpark, multiprocessing
without speculation. Greedy tokens must be identical across all three, the
drafter must really draft (and be partly rejected: its bigram table differs
from the target's in a quarter of the entries), and the vllm_dspark plugin
must have been loaded by vLLM inside each Ray worker actor.

Both DSpark engines run with rank 1's inputs diverging on purpose
(``VLLM_DSPARK_TEST_DIVERGENCE``): rank 1 finds a cached cost profile that rank
0 lacks (one that says drafting never pays) and measures its drafter 1000x
slower than it is, while rank 0 measures its drafter 1000x faster and expects
the table's acceptance, so that its budget drafts whatever the machine's load.
Decided rank by rank, rank 1 would load while rank 0 runs the profile's dummy
runs (collectives: a hang), and then skip the drafter's block forward while
rank 0 runs it. The budget's decisions are made on rank 0 and broadcast, so the
ranks agree, outputs stay identical, and nothing hangs; each such test has its
own timeout, so a hang fails the test, not the run.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.timeout(900)]

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[default]==2.60.0'")

PROMPTS = ["hello world", "The quick brown fox", "abc", "0123456789"]
MAX_TOKENS = 32
K3_ENV = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"
# Rank 1's inputs differ from rank 0's: a profile cache only it has (saying drafting never pays),
# and its drafter's measured times scaled by 1000.
NEVER_PAYS = {"verify": [[1, 0.01], [512, 5.12]], "draft": [[1, 1.0], [64, 1.0]]}
# Whether rank 0's budget drafts must not depend on how busy the machine is while it profiles (a CI
# run under load measured a drafter that never paid, and sent one probe). So rank 0's drafter times
# are scaled to nearly nothing, and the acceptance the budget expects is pinned at the quarter-wrong
# table's 0.75 (prior_strength 1e9 outweighs any evidence): drafting pays on rank 0 under any load,
# while rank 1, left to itself, would never draft.
DIVERGENCE = {"VLLM_DSPARK_TEST_DIVERGENCE": json.dumps([
    {"rank": 0, "draft_time_scale": 1e-3},
    {"rank": 1, "draft_time_scale": 1000.0, "cached_costs": NEVER_PAYS}])}
PINNED_ACCEPTANCE = {"prior_acceptance": 0.75, "prior_strength": 1e9}
HANG_TIMEOUT = 600  # an engine start and a generate on this machine take about 60-120 s


@pytest.fixture(scope="module")
def models(tiny_models, engine_env, tmp_path_factory):
    # The profile each engine takes is cached in a temporary directory of its own, not the user's cache.
    return {**tiny_models, "env": engine_env, "cache": tmp_path_factory.mktemp("dspark_cache")}


def _run(models, *, backend, spec: bool, extra_env: dict | None = None) -> dict:
    from vllm import SamplingParams

    from benchmarks.harness.engine import acceptance_summary, llm_engine, spec_metrics
    from tests.deploy.ray_cpu import probe_worker

    speculative_config = ({"method": "dspark", "model": models["draft"], "num_speculative_tokens": 7,
                           "dspark": PINNED_ACCEPTANCE} if spec else None)
    t0 = time.time()
    cache = models["cache"] / f"{getattr(backend, '__name__', backend)}-{'spec' if spec else 'nospec'}"
    with llm_engine(models["target"], speculative_config=speculative_config,
                    env={**models["env"], "VLLM_DSPARK_PROFILE_CACHE": str(cache), "OMP_NUM_THREADS": "1",
                         # collective_rpc(probe_worker) pickles a function
                         "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **(extra_env or {})}, tensor_parallel_size=2,
                    distributed_executor_backend=backend, dtype="float32", max_model_len=512,
                    max_num_seqs=8) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "workers": llm.collective_rpc(probe_worker),
            "reports": llm.collective_rpc("dspark_report") if spec else None,
            "acceptance": acceptance_summary(spec_metrics(llm)) if spec else None,
            "seconds": time.time() - t0,
        }


@pytest.fixture(scope="module")
def ray_spec(models, ray_head):
    from tests.deploy.ray_cpu import RayCpuTestExecutor

    # RAY_ADDRESS: the engine process attaches to the head instead of starting its own Ray.
    # K3_ENV=1 here only to see that the driver's VLLM_* variables reach the Ray actors
    # (the K3 residual-stream switch depends on that); it has no effect on a Qwen3 target.
    return _run(models, backend=RayCpuTestExecutor, spec=True,
                extra_env={"RAY_ADDRESS": ray_head, K3_ENV: "1", **DIVERGENCE})


@pytest.fixture(scope="module")
def mp_spec(models):
    return _run(models, backend="mp", spec=True, extra_env=DIVERGENCE)


@pytest.fixture(scope="module")
def mp_nospec(models):
    return _run(models, backend="mp", spec=False)


@pytest.mark.timeout(HANG_TIMEOUT)
def test_ray_tp2_runs_workers_as_ray_actors_with_the_plugin(ray_spec):
    workers = ray_spec["workers"]
    assert len(workers) == 2
    assert all(w["ray_actor_id"] for w in workers), workers  # really Ray actors
    assert len({w["pid"] for w in workers}) == 2
    # Loaded by vLLM's plugin loader in that very process, not imported by the probe.
    assert all(w["plugin_loaded"] and w["plugin_pid"] == w["pid"] for w in workers), workers
    assert all(w["aux_attn_res_stream_env"] == "1" for w in workers), workers


@pytest.mark.timeout(HANG_TIMEOUT)
def test_ray_tp2_dspark_drafts_and_rejects(ray_spec):
    acc = ray_spec["acceptance"]
    assert acc["num_drafts"] > 0 and acc["num_draft_tokens"] > 0
    # A quarter of the drafter's table is wrong: some drafts accepted, not all.
    r0 = ray_spec["reports"][0]
    why = {"acceptance": acc, "stats": r0["stats"], "policy": r0["policy"], "costs": r0["costs"],
           "calibration": r0["calibration"]}
    assert 0 < acc["num_accepted_tokens"] < acc["num_draft_tokens"], why


@pytest.mark.timeout(HANG_TIMEOUT)
def test_ray_tokens_identical_to_multiprocessing(ray_spec, mp_spec):
    assert all(w["ray_actor_id"] is None for w in mp_spec["workers"])
    assert torch.equal(torch.tensor(ray_spec["tokens"]), torch.tensor(mp_spec["tokens"]))
    # (The two engines' budgets decide from their own rank 0's step times, so how much each
    # drafted may differ; what each verified is lossless either way.)
    assert mp_spec["acceptance"]["num_draft_tokens"] > 0


@pytest.mark.timeout(HANG_TIMEOUT)
@pytest.mark.parametrize("engine", ["ray_spec", "mp_spec"])
def test_tp2_ranks_decide_alike_when_their_inputs_diverge(engine, request):
    reports = request.getfixturevalue(engine)["reports"]
    assert [r["consensus"]["rank"] for r in reports] == [0, 1]
    assert all(r["consensus"]["world_size"] == 2 and r["consensus"]["broadcasts"] > 0 for r in reports)
    p0, p1 = reports[0]["profile"], reports[1]["profile"]
    # The inputs diverged: only rank 1 had a cached profile, and its drafter timed 1000x slower ...
    assert not p0["local_cache_hit"] and p1["local_cache_hit"], (p0, p1)
    assert p1["local_draft_1"] > 100 * p0["local_draft_1"], (p0, p1)
    # ... yet both profiled, and both hold rank 0's cost model ...
    assert p0["decision"] == p1["decision"] == "profiled"
    c0, c1 = reports[0]["costs"], reports[1]["costs"]
    assert (c0["verify"], c0["draft"]) == (c1["verify"], c1["draft"])
    # ... and every step's plan and every request's drafts were the same on both ranks.
    assert reports[0]["stats"] == reports[1]["stats"], (reports[0]["stats"], reports[1]["stats"])
    assert reports[0]["stats"]["tokens_admitted"] > 0  # rank 0 drafted (rank 1 alone never would)
    # Only full drafting steps time the drafter online (probes do not). How many the budget runs
    # depends on this machine's step times: one CI run had probes only, and both scales stayed 1.
    st = reports[0]["stats"]
    if st["steps_drafted"] > st["steps_probed"]:
        assert c1["scale_draft"] > c0["scale_draft"]  # rank 1 kept measuring its (scaled) drafter


@pytest.mark.timeout(HANG_TIMEOUT)
def test_ray_tokens_identical_to_no_speculation(ray_spec, mp_nospec):
    assert torch.equal(torch.tensor(ray_spec["tokens"]), torch.tensor(mp_nospec["tokens"]))
    assert all(len(t) == MAX_TOKENS for t in mp_nospec["tokens"])
