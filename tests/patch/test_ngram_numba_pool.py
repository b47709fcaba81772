"""vLLM's n-gram proposer under a CPU worker's thread binding: torch keeps its threads with the patch.

Each case runs in a fresh interpreter, set up as vLLM's CPU worker is when it
builds the proposer: torch has 2 threads and has run a parallel op, and the main
thread is bound to one core, before numba is loaded. Numba's pool size is fixed when it loads, so a
fresh process is the only honest set-up (and this test process never loads
numba, see ``test_registry._loaded``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import json, os, sys
    from types import SimpleNamespace
    import torch
    torch.set_num_threads(2)
    x = torch.randn(256, 256)
    (x @ x).sum()  # the OpenMP team is running before numba loads, as after the worker's warm-up
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # vLLM binds the worker's main thread
    patched = sys.argv[1] == "patched"
    if patched:
        from vllm_dspark.patch import v1_spec_decode_ngram_proposer as mod
        mod.PATCH.apply()
        assert not mod.PATCH.applied and "numba" not in sys.modules  # waits for vLLM to import it
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(prompt_lookup_min=2, prompt_lookup_max=4, num_speculative_tokens=7),
        model_config=SimpleNamespace(max_model_len=64), scheduler_config=SimpleNamespace(max_num_seqs=2),
        parallel_config=SimpleNamespace(tensor_parallel_size=1))
    prop = NgramProposer(cfg)
    tokens = np.zeros((2, 64), dtype=np.int32)
    tokens[0, :10] = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8]
    drafts = prop.propose(7, [[8], []], np.array([10, 0], dtype=np.int32), tokens)
    import numba
    print(json.dumps({"torch_threads": torch.get_num_threads(), "numba_threads": numba.config.NUMBA_NUM_THREADS,
                      "drafts": drafts, "recorded": getattr(prop, "dspark_numba_threads", None),
                      "applied": mod.PATCH.applied if patched else None}))
''')


def _run(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs() -> dict:
    return {mode: _run(mode) for mode in ("plain", "patched")}


def test_without_the_patch_numba_takes_the_model_thread_down_to_one(runs):
    # The mechanism the patch exists for; if this stops holding, the patch can go.
    assert runs["plain"]["numba_threads"] == 1
    assert runs["plain"]["torch_threads"] == 1


def test_with_the_patch_torch_keeps_its_threads_and_proposals_are_unchanged(runs):
    got = runs["patched"]
    assert got["applied"] is True
    assert got["numba_threads"] == 2 and got["recorded"] == 2
    assert got["torch_threads"] == 2
    assert got["drafts"] == runs["plain"]["drafts"]
    assert got["drafts"][0] == [9, 10, 5, 6, 7, 8] and got["drafts"][1] == []
