"""The CUDA implementation of markov_draft against the reference (GPU only).

Runs only with a CUDA device and a CUDA build of ``vllm_dspark._C``
(``requires_cuda``); the default CPU run skips it. Same tolerances as the CPU
tests: tokens and lengths equal, confidences within 1e-6. Also against an
upstream-style dense loop (per position: gather, matmul, add, argmax) on rows
with clear winners, the policies (NaN, out-of-range anchors, the length rule),
host tensors being rejected, and CUDA-graph capture of the raw op. The same
kernel source runs on the CPU in ``tests/ops/test_simt_emulation.py``.
"""

from __future__ import annotations

import pytest
import torch

from vllm_dspark.ops import markov as M
from vllm_dspark.ops.markov_reference import (
    markov_draft_reference,
    markov_max_norms,
    markov_row_norms,
)

from .test_markov_op import (
    CONF_ATOL,
    EXAMPLE_CONF,
    K3_VOCAB,
    _constant_conf_case,
    _nan_case,
    make_case,
    temperatures,
)

pytestmark = [
    pytest.mark.requires_cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _to(case, dev):
    return {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def _run(case, temp, thr, *, with_max_norms=True, **kw):
    norms = markov_row_norms(case["markov_w2"])
    out = M.markov_draft(case["base_logits"], case["anchor_ids"], case["markov_w1"],
                         case["markov_w2"], norms, case["conf_base"], case["conf_w_markov"],
                         temp, case["seeds"], thr, allow_fallback=False, return_stats=True,
                         max_norms=markov_max_norms(case["markov_w1"], norms)
                         if with_max_norms else None, **kw)
    assert out.path == "compiled"
    return out


def _ref(case, temp, thr, **kw):
    return markov_draft_reference(case["base_logits"], case["anchor_ids"], case["markov_w1"],
                                  case["markov_w2"], case["conf_base"], case["conf_w_markov"],
                                  temp, case["seeds"], thr, **kw)


def _check(out, ref):
    assert torch.equal(out.tokens, ref[0])
    torch.testing.assert_close(out.conf, ref[1], atol=CONF_ATOL, rtol=0)
    assert torch.equal(out.lengths, ref[2])


def test_cuda_kernel_is_loaded():
    assert M.is_compiled_available("cuda"), "vllm_dspark._C was built without CUDA"


@pytest.mark.parametrize("shape", [(1, 7, 111, 1), (5, 7, 111, 256), (8, 7, K3_VOCAB, 256),
                                   (2, 1, 5000, 64), (64, 7, K3_VOCAB, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
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


def upstream_loop(case):
    """Upstream vLLM's greedy loop: per position gather, matmul, add, argmax."""
    base, w1, w2 = case["base_logits"], case["markov_w1"], case["markov_w2"]
    prev = case["anchor_ids"]
    toks = []
    for i in range(base.shape[1]):
        logits = base[:, i].float() + (w1[prev] @ w2.T).float()
        prev = logits.argmax(dim=-1)
        toks.append(prev)
    return torch.stack(toks, dim=1)


@pytest.mark.parametrize("R", [1, 8, 64])
def test_cuda_matches_upstream_loop_on_clear_winners(R):
    torch.backends.cuda.matmul.allow_tf32 = False
    case = _to(make_case(R, 7, K3_VOCAB, 256, torch.float32, seed=4, peaky=True), "cuda")
    out = _run(case, torch.zeros(R, device="cuda"), 0.5)
    assert torch.equal(out.tokens, upstream_loop(case))
    _check(out, _ref(case, torch.zeros(R, device="cuda"), 0.5))


@pytest.mark.parametrize("with_max_norms", [True, False])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_cuda_flat_rows_and_max_norms_on_device(with_max_norms, mode):
    case = _to(make_case(4, 7, K3_VOCAB, 256, torch.bfloat16, seed=6), "cuda")
    temp = temperatures(4, mode).cuda()
    _check(_run(case, temp, 0.5, with_max_norms=with_max_norms), _ref(case, temp, 0.5))


@pytest.mark.parametrize("with_logits", [False, True], ids=["pruned", "dense"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_cuda_nan_policy(with_logits, mode):
    case = _to(_nan_case(torch.float32), "cuda")
    temp = temperatures(4, mode).cuda()
    out = _run(case, temp, 0.5, return_logits=with_logits)
    _check(out, _ref(case, temp, 0.5))
    assert out.tokens[0, 1].item() == 0 and out.tokens[1, 0].item() == 3


def test_cuda_out_of_range_anchor():
    case = _to(make_case(4, 5, 300, 8, seed=13), "cuda")
    case["anchor_ids"] = torch.tensor([300, -1, 7, 2**40], device="cuda")
    for mode in ("greedy", "sampled"):
        temp = temperatures(4, mode).cuda()
        _check(_run(case, temp, 0.5), _ref(case, temp, 0.5))


def test_cuda_length_rule():
    case = _to(_constant_conf_case(EXAMPLE_CONF), "cuda")
    out = _run(case, torch.zeros(1, device="cuda"), 0.8)
    assert out.lengths.tolist() == [6]


@pytest.mark.parametrize("name", ["conf_base", "conf_w_markov", "out_logits", "out_stats",
                                  "max_norms"])
def test_cuda_rejects_host_tensors(name):
    case = _to(make_case(2, 3, 111, 8, seed=14), "cuda")
    R, B, V = case["base_logits"].shape
    norms = markov_row_norms(case["markov_w2"])
    args = dict(conf_base=case["conf_base"], conf_w_markov=case["conf_w_markov"],
                out_logits=torch.empty(R, B, V, device="cuda"),
                out_stats=torch.empty(R, B, dtype=torch.int32, device="cuda"),
                max_norms=markov_max_norms(case["markov_w1"], norms))
    args[name] = args[name].cpu()
    with pytest.raises(RuntimeError, match=name):
        torch.ops.vllm_dspark.markov_draft(
            case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
            norms, args["conf_base"], args["conf_w_markov"], torch.zeros(R, device="cuda"),
            case["seeds"], 0.5, torch.empty(R, B, dtype=torch.int64, device="cuda"),
            torch.empty(R, B, device="cuda"), torch.empty(R, dtype=torch.int32, device="cuda"),
            args["out_logits"], args["out_stats"], args["max_norms"])


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
    max_norms = markov_max_norms(case["markov_w1"], norms)
    temp = temperatures(R, "mixed").cuda()
    outs = (torch.empty(R, B, dtype=torch.int64, device="cuda"),
            torch.empty(R, B, device="cuda"), torch.empty(R, dtype=torch.int32, device="cuda"))

    def step():
        torch.ops.vllm_dspark.markov_draft(
            case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
            norms, case["conf_base"], case["conf_w_markov"], temp, case["seeds"], 0.5,
            *outs, None, None, max_norms)

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
