"""Shared pytest configuration: markers, and the CPU-first default run.

* ``requires_cuda``: needs a CUDA GPU and a CUDA build of the op; skipped on CPU
  machines (CI), run on a GPU machine with ``pytest -m requires_cuda``.
* ``ray``: starts a local Ray cluster; part of the default run.
* ``engine``: starts vLLM engines (about 40 s each on 2 cores); part of the default run.
"""

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: the tiny models need little
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_cuda: needs a CUDA GPU and a CUDA build of the op (skipped otherwise)")
    config.addinivalue_line("markers", "engine: starts vLLM engines (slow start-up)")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (requires_cuda)")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)
