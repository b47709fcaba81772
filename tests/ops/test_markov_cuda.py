"""The CUDA implementation of markov_draft against the reference (GPU only).

Runs only with a CUDA device and a CUDA build of ``vllm_dspark._C``
(``requires_cuda``); the default CPU run skips it. Same tolerances as the CPU
tests: tokens and lengths equal, confidences within 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dspark.ops import markov as M
from vllm_dspark.ops.markov_reference import markov_draft_reference, markov_row_norms

from .test_markov_op import CONF_ATOL, K3_VOCAB, make_case, temperatures

pytestmark = [
    pytest.mark.requires_cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _to(case, dev):
    return {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def _run(case, temp, thr, **kw):
    out = M.markov_draft(case["base_logits"], case["anchor_ids"], case["markov_w1"],
                         case["markov_w2"], markov_row_norms(case["markov_w2"]),
                         case["conf_base"], case["conf_w_markov"], temp, case["seeds"], thr,
                         allow_fallback=False, return_stats=True, **kw)
    assert M.last_path() == "compiled"
    return out


def test_cuda_kernel_is_loaded():
    assert M.is_compiled_available("cuda"), "vllm_dspark._C was built without CUDA"


@pytest.mark.parametrize("shape", [(1, 7, 111, 1), (5, 7, 111, 256), (8, 7, K3_VOCAB, 256),
                                   (2, 1, 5000, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("dense", [False, True], ids=["pruned", "dense"])
def test_cuda_matches_reference(shape, dtype, mode, dense):
    R, B, V, rank = shape
    case = _to(make_case(R, B, V, rank, dtype, seed=3, peaky=V > 1000), "cuda")
    temp = temperatures(R, mode).cuda()
    out = _run(case, temp, 0.5, return_logits=dense)
    ref = markov_draft_reference(case["base_logits"], case["anchor_ids"], case["markov_w1"],
                                 case["markov_w2"], case["conf_base"], case["conf_w_markov"],
                                 temp, case["seeds"], 0.5, return_logits=dense)
    assert torch.equal(out.tokens, ref[0])
    torch.testing.assert_close(out.conf, ref[1], atol=CONF_ATOL, rtol=0)
    assert torch.equal(out.lengths, ref[2])
    if dense:
        torch.testing.assert_close(out.logits, ref[3], atol=1e-6, rtol=1e-6)
        assert bool((out.stats == V).all())


def test_cuda_all_equal_base_goes_dense():
    case = _to(make_case(2, 3, 20000, 8, seed=7), "cuda")
    case["base_logits"].fill_(0.25)
    case["markov_w2"].zero_()
    out = _run(case, torch.zeros(2, device="cuda"), 0.0)
    assert bool((out.tokens == 0).all()) and bool((out.stats == 20000).all())


def test_cuda_graph_capture():
    case = _to(make_case(4, 7, 4096, 64, seed=9), "cuda")
    R, B, V = case["base_logits"].shape
    norms = markov_row_norms(case["markov_w2"])
    temp = temperatures(R, "mixed").cuda()
    outs = (torch.empty(R, B, dtype=torch.int64, device="cuda"),
            torch.empty(R, B, device="cuda"), torch.empty(R, dtype=torch.int32, device="cuda"))

    def step():
        torch.ops.vllm_dspark.markov_draft(
            case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
            norms, case["conf_base"], case["conf_w_markov"], temp, case["seeds"], 0.5,
            *outs, None, None)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    case["base_logits"].copy_(torch.randn_like(case["base_logits"]))
    g.replay()
    torch.cuda.synchronize()
    ref = markov_draft_reference(case["base_logits"], case["anchor_ids"], case["markov_w1"],
                                 case["markov_w2"], case["conf_base"], case["conf_w_markov"],
                                 temp, case["seeds"], 0.5)
    assert torch.equal(outs[0], ref[0]) and torch.equal(outs[2], ref[2])
