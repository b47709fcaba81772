"""The compiled Markov draft op (CPU twin) against the PyTorch reference.

Tokens compare with ``torch.equal``; confidences within CONF_ATOL (both sides
take an fp64 sigmoid and round to fp32, so they differ by at most an ulp).
Every op call goes through ``run_op``, which
asserts that the compiled kernel (not the Python fallback) ran.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_dspark.ops import markov as M
from vllm_dspark.ops.markov_reference import (
    gumbel_hash,
    gumbel_noise,
    markov_row_norms,
    mix32,
)

from .markov_cases import (
    CONF_ATOL,
    EXAMPLE_CONF,
    K3_VOCAB,
    assert_matches,
    constant_conf_case,
    make_case,
    nan_case,
    run_reference,
    temperatures,
)


def test_compiled_op_is_loaded():
    # A silent fallback to Python must not let the kernel tests below pass.
    assert M.is_compiled_available("cpu"), M._why_not(
        torch.zeros(1, 1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1))
    assert torch._C._dispatch_has_kernel_for_dispatch_key("vllm_dspark::markov_draft", "CPU")


def run_op(case, temperature, **kw):
    out = M.markov_draft(
        case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
        markov_row_norms(case["markov_w2"]), case["conf_base"], case["conf_w_markov"],
        temperature, case["seeds"], allow_fallback=False, return_stats=True, **kw)
    assert out.path == "compiled"
    return out


SMALL_SHAPES = [  # (R, B, V, rank)
    (1, 7, 111, 1),
    (1, 1, 111, 256),
    (5, 7, 111, 256),
    (3, 1, 111, 1),
    (4, 7, 1000, 16),
]


@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: "R{}-B{}-V{}-r{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
def test_op_matches_reference_small(shape, dtype, mode):
    R, B, V, rank = shape
    case = make_case(R, B, V, rank, dtype, seed=hash((shape, mode)) % 1000)
    temp = temperatures(R, mode)
    assert_matches(run_op(case, temp), run_reference(case, temp))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("peaky", [False, True], ids=["flat", "peaky"])
def test_op_matches_reference_k3_vocab(dtype, mode, peaky):
    R = 2 if mode == "greedy" else 1  # the fp64 reference is slow at this size
    case = make_case(R, 7, K3_VOCAB, 256, dtype, seed=11, peaky=peaky)
    temp = temperatures(R, mode)
    out = run_op(case, temp)
    assert_matches(out, run_reference(case, temp))
    # The pruning really prunes on these regimes.
    assert int(out.stats.max()) < K3_VOCAB // 100, out.stats


@pytest.mark.parametrize("base_dtype,w_dtype", [
    (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32)], ids=["fp16", "fp32-base-bf16-w", "bf16-base-fp32-w"])
def test_op_other_dtype_pairs(base_dtype, w_dtype):
    case = make_case(3, 7, 2000, 32, seed=15)
    case["base_logits"] = case["base_logits"].to(base_dtype)
    case["markov_w1"] = case["markov_w1"].to(w_dtype)
    case["markov_w2"] = case["markov_w2"].to(w_dtype)
    temp = temperatures(3, "mixed")
    assert_matches(run_op(case, temp), run_reference(case, temp))


def test_op_matches_reference_k3_vocab_rank1():
    case = make_case(3, 7, K3_VOCAB, 1, seed=5)
    temp = temperatures(3, "mixed")
    assert_matches(run_op(case, temp), run_reference(case, temp))


def test_no_confidence_head_fills_ones():
    case = make_case(2, 7, 111, 8, seed=2, conf=False)
    out = run_op(case, torch.zeros(2))
    assert torch.equal(out.conf, torch.ones(2, 7))
    assert_matches(out, run_reference(case, torch.zeros(2)))


# --- adversarial pruning cases ---------------------------------------------------

@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_markov_bias_outweighs_base(mode):
    # Bias std ~ 16 x the base std: the bound is loose, pruning must stay exact.
    case = make_case(3, 7, 3000, 64, seed=3, base_std=0.05, w_std=0.5)
    temp = temperatures(3, mode)
    assert_matches(run_op(case, temp), run_reference(case, temp))


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_bias_at_the_cauchy_schwarz_bound(mode):
    # w2 rows parallel to w1[prev]: the bias equals ||w2_j|| ||e|| exactly, so
    # the upper bound is tight; near-winners are separated by a few ulps.
    V, rank, R, B = 5000, 32, 2, 7
    case = make_case(R, B, V, rank, seed=4, base_std=1.0, w_std=0.1)
    w1, w2 = case["markov_w1"], case["markov_w2"]
    v = torch.randn(rank)
    w1[:] = v / v.norm()  # every previous token has the same embedding
    scale = torch.rand(V) * 2.0 - 1.0
    scale[777], scale[123] = 1.0, -1.0  # 777: bias = +bound, 123: bias = -bound
    w2[:] = scale[:, None] * v[None, :]
    base = case["base_logits"]
    base[:, :, 123] = 5.0
    # 777 wins by ~2 ulp, and only because its bias reaches the bound exactly.
    base[:, :, 777] = 5.0 - 2.0 * v.norm() + 1e-6
    temp = temperatures(R, mode)
    assert_matches(run_op(case, temp), run_reference(case, temp))


def test_ties_go_to_the_lowest_token():
    V, rank = 2000, 16
    case = make_case(2, 7, V, rank, seed=6, base_std=0.1)
    base, w2 = case["base_logits"], case["markov_w2"]
    for j in (1500, 40, 900):  # identical base and identical w2 rows
        base[:, :, j] = 10.0
        w2[j] = w2[40]
    out = run_op(case, torch.zeros(2))
    assert_matches(out, run_reference(case, torch.zeros(2)))
    assert bool((out.tokens == 40).all())


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_all_equal_base_forces_dense_fallback(mode):
    V = 20000
    case = make_case(2, 3, V, 8, seed=7)
    case["base_logits"].fill_(0.25)
    case["markov_w2"].zero_()  # every token ties exactly
    temp = temperatures(2, mode)
    out = run_op(case, temp)
    assert_matches(out, run_reference(case, temp))
    if mode == "greedy":
        assert bool((out.tokens == 0).all())
        assert bool((out.stats == V).all()), out.stats  # every row went dense


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_minus_inf_entries(mode, dtype):
    V = 6000
    case = make_case(3, 7, V, 32, dtype, seed=8)
    g = torch.Generator().manual_seed(9)
    base = case["base_logits"]
    base[torch.rand(base.shape, generator=g) < 0.6] = float("-inf")
    base[0, 2] = float("-inf")  # a whole row masked: token 0 by the tie rule
    base[1, :, :4000] = float("-inf")  # a masked prefix longer than the candidate cap
    temp = temperatures(3, mode)
    out = run_op(case, temp)
    assert_matches(out, run_reference(case, temp))
    assert out.tokens[0, 2].item() == 0


@pytest.mark.parametrize("mode", ["greedy", "mixed"])
def test_out_logits_takes_the_dense_path(mode):
    case = make_case(3, 7, 777, 32, torch.bfloat16, seed=10)
    temp = temperatures(3, mode)
    out = run_op(case, temp, return_logits=True)
    ref = run_reference(case, temp, return_logits=True)
    assert_matches(out, ref)
    torch.testing.assert_close(out.logits, ref[2], atol=1e-6, rtol=1e-6)
    assert bool((out.stats == 777).all())


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_out_logits_with_all_equal_logits(mode):
    # Ties everywhere: the pick over the dense row must score every token.
    V = 9000
    case = make_case(2, 3, V, 8, seed=16)
    case["base_logits"].fill_(-1.5)
    case["markov_w2"].zero_()
    temp = temperatures(2, mode)
    out = run_op(case, temp, return_logits=True)
    ref = run_reference(case, temp, return_logits=True)
    assert_matches(out, ref)
    assert torch.equal(out.logits, ref[2])


# --- the op as a torch.library op -------------------------------------------------

def _op_args(case, temperature, with_logits):
    R, B, V = case["base_logits"].shape
    return (case["base_logits"], case["anchor_ids"], case["markov_w1"], case["markov_w2"],
            markov_row_norms(case["markov_w2"]), case["conf_base"], case["conf_w_markov"],
            temperature, case["seeds"],
            torch.empty(R, B, dtype=torch.int64), torch.empty(R, B),
            torch.empty(R, B, V) if with_logits else None,
            torch.empty(R, B, dtype=torch.int32))


@pytest.mark.parametrize("with_logits", [False, True])
def test_opcheck(with_logits):
    assert M.is_compiled_available("cpu")
    case = make_case(3, 4, 111, 8, seed=12)
    args = _op_args(case, temperatures(3, "mixed"), with_logits)
    torch.library.opcheck(torch.ops.vllm_dspark.markov_draft.default, args)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_out_of_range_anchor_has_no_markov_embedding(mode):
    # Anchor policy: no range check (no host sync), no out-of-bounds read; an
    # anchor outside [0, V) drafts position 0 with e = 0.
    case = make_case(4, 5, 300, 8, seed=13)
    case["anchor_ids"] = torch.tensor([300, -1, 7, 2**40])
    temp = temperatures(4, mode)
    out = run_op(case, temp)
    ref = run_reference(case, temp)
    assert_matches(out, ref)
    # Position 0 of an invalid anchor: bias 0 and conf = sigmoid(conf_base).
    expect0 = torch.sigmoid(case["conf_base"][[0, 1, 3], 0].double()).float()
    torch.testing.assert_close(out.conf[[0, 1, 3], 0], expect0, atol=CONF_ATOL, rtol=0)
    if mode == "greedy":
        base0 = case["base_logits"][[0, 1, 3], 0].float()
        assert torch.equal(out.tokens[[0, 1, 3], 0], base0.argmax(-1))


# --- confidences of a known head -------------------------------------------------

@pytest.mark.parametrize("impl", ["reference", "compiled"])
def test_constant_confidences_come_out_exact(impl):
    case = constant_conf_case(EXAMPLE_CONF)
    run = run_reference if impl == "reference" else run_op
    conf = run(case, torch.zeros(1))[1]
    torch.testing.assert_close(conf[0], torch.tensor(EXAMPLE_CONF), atol=1e-6, rtol=0)


# --- NaN policy: NaN ranks below -inf; a row of only NaN proposes token 0 -------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("with_logits", [False, True], ids=["pruned", "dense"])
def test_nan_policy(dtype, mode, with_logits):
    case = nan_case(dtype)
    temp = temperatures(4, mode)
    ref = run_reference(case, temp)
    out = run_op(case, temp, return_logits=with_logits)
    assert_matches(out, ref)
    assert out.tokens[0, 1].item() == 0
    assert out.tokens[1, 0].item() == 3
    assert out.tokens[0, 0].item() != 17
    assert not bool(torch.isnan(case["base_logits"][1, 1, out.tokens[1, 1]]))
    if mode == "greedy":
        assert bool((out.tokens[2] == 1).all())


def test_reference_nan_argmax_helper():
    from vllm_dspark.ops.markov_reference import _argmax_nan_last
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[nan, 1.0, 2.0], [nan, -inf, -inf], [nan, nan, nan],
                         [-inf, -inf, -inf], [inf, nan, inf]])
    assert _argmax_nan_last(rows).tolist() == [2, 1, 0, 0, 0]


# --- wrapper behaviour --------------------------------------------------------------

def test_wrapper_falls_back_and_says_why(caplog):
    case = make_case(2, 3, 50, 4, seed=14)
    base64 = case["base_logits"].to(torch.float64)  # no compiled path for fp64
    reason = M._why_not(base64, case["markov_w1"], case["markov_w2"],
                        markov_row_norms(case["markov_w2"]))
    assert reason and "float64" in reason
    with caplog.at_level("WARNING", logger=M.__name__):
        out = M.markov_draft(base64, case["anchor_ids"], case["markov_w1"], case["markov_w2"])
        M.markov_draft(base64, case["anchor_ids"], case["markov_w1"], case["markov_w2"])
    assert out.path == "reference"
    assert sum(reason in r.getMessage() for r in caplog.records) <= 1  # logged once
    assert out.tokens.shape == (2, 3) and out.stats is None
    with pytest.raises(RuntimeError, match="float64"):
        M.markov_draft(base64, case["anchor_ids"], case["markov_w1"], case["markov_w2"],
                       allow_fallback=False)


def test_row_norms():
    w2 = torch.randn(300, 17).to(torch.bfloat16)
    torch.testing.assert_close(markov_row_norms(w2), w2.float().norm(dim=1), rtol=1e-6, atol=0)
    assert markov_row_norms(w2).dtype == torch.float32


# --- the noise definition ------------------------------------------------------------

def _mix32_py(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    x ^= x >> 16
    return x


def test_hash_is_the_documented_32_bit_hash():
    xs = torch.tensor([0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF])
    assert mix32(xs).tolist() == [_mix32_py(int(x)) for x in xs]
    seed, pos, V = -123456789012345, 3, 40
    s = seed & 0xFFFFFFFFFFFFFFFF
    k = _mix32_py((s & 0xFFFFFFFF) ^ 0x9E3779B9)
    k = _mix32_py(k ^ (s >> 32))
    k = _mix32_py(k ^ pos)
    expect = [_mix32_py(k ^ ((j * 0x9E3779B1) & 0xFFFFFFFF)) for j in range(V)]
    assert gumbel_hash(torch.tensor([seed]), pos, V)[0].tolist() == expect


def test_gumbel_noise_statistics():
    g = gumbel_noise(torch.tensor([7, 8]), 0, 200000)
    assert g.dtype == torch.float32 and bool(torch.isfinite(g).all())
    assert abs(g.double().mean().item() - 0.5772156649) < 0.01  # Euler-Mascheroni
    assert abs(g.double().var().item() - math.pi ** 2 / 6) < 0.03
    assert not torch.equal(g[0], g[1])
