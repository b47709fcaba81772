"""Shared pytest configuration: markers, and the CPU-first default run.

* ``requires_cuda``: needs a CUDA GPU and a CUDA build of the op; skipped on CPU
  machines (CI), run on a GPU machine with ``pytest -m requires_cuda``.
* ``ray``: starts a local Ray cluster; part of the default run.
* ``engine``: starts vLLM engines (about 40 s each on 2 cores); part of the default run.
"""

import os
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.harness.engine import llm_engine
from tests.helpers import MAX_TOKENS, make_prompts, tiny_pair
from tests.tiny_pair import make_drafter

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: the tiny models need little
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines in the test process: an engine-core process re-imports torch and vLLM and took 20 of an engine's
# 25 s start on 2 cores. Tests that run a command as a user would (README lines, the batch job's faults)
# leave this out of the command's environment.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Budget profiles the engines take go to a directory of this run, never the user's cache (and are not
# reused from an earlier run); tests that check the cache pin their own.
os.environ.setdefault("VLLM_DSPARK_PROFILE_CACHE", tempfile.mkdtemp(prefix="dspark-test-profiles-"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_cuda: needs a CUDA GPU and a CUDA build of the op (skipped otherwise)")
    config.addinivalue_line("markers", "engine: starts vLLM engines (slow start-up)")


def pytest_collection_modifyitems(config, items):

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (requires_cuda)")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A tiny random checkpoint in SpecForge's export layout (read-only: copy before corrupting)."""
    from tests.helpers import tiny_config

    return make_drafter(tmp_path_factory.mktemp("ckpt") / "tiny", tiny_config(), mode="random", seed=1)


# ---------------------------------------------------------------- engine pairs (session-wide)
@pytest.fixture(scope="session")
def qwen_pair(tmp_path_factory):
    """Qwen3 target (bigram-like) + DSpark drafter: Markov head mostly right, backbone live."""
    # A drafter that knows 80% of the table: real rejections, real acceptances.
    return tiny_pair(tmp_path_factory.mktemp("qwen_pair"), seed=3, target={"arch": "qwen3", "num_layers": 4},
                     drafter={"block_size": 7, "markov_rank": 64, "target_layer_ids": (0, 1, 2)},
                     known=0.8, known_seed=11, backbone_scale=0.05, draft_seed=5).as_dict()


@pytest.fixture(scope="session")
def prompts():
    return make_prompts()


@pytest.fixture(scope="session")
def qwen_baseline(qwen_pair, prompts):
    """Greedy tokens of the target alone, per prompt."""
    from vllm import SamplingParams

    with llm_engine(qwen_pair["target"]) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]
