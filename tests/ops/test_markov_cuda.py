"""The CUDA implementation of markov_draft against the reference (GPU only).

Runs only with a CUDA device and a CUDA build of ``vllm_dspark._C``
(``requires_cuda``); the default CPU run skips it. The checks themselves live in
``tests/ops/markov_cases.py`` (``CUDA_CHECKS``), which ``scripts/gpu_check.py``
runs without pytest on a GPU machine: the kernel against the reference over
batch 1 to 64, vocab 111 to 163840, fp32/bf16/fp16, greedy/sampled/mixed,
pruned and dense (tokens equal, confidences within 1e-6); against an
upstream-style dense loop (per position: gather, matmul, add, argmax) on rows
with clear winners; the policies (NaN, out-of-range anchors, the length rule);
host tensors being rejected; and CUDA-graph capture of the raw op. The same
kernel source runs on the CPU in ``tests/ops/test_simt_emulation.py``.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dspark.ops import markov as M

from .markov_cases import CUDA_CHECKS, Check

pytestmark = [
    pytest.mark.requires_cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_kernel_is_loaded():
    assert M.is_compiled_available("cuda"), "vllm_dspark._C was built without CUDA"


@pytest.mark.parametrize("check", CUDA_CHECKS, ids=lambda c: c.name)
def test_cuda_check(check: Check):
    check.run("cuda")
